"""Gemma 3's local layers keep only their window on the MLX graph (the GPU; here the CPU with
``HF2Q_NO_HOST_DECODE=1``) and on the CPU's host decode step over a float cache (``attend_layer`` reads a window
buffer from its base), and the logits stay transformers' on a prompt many windows long; over an 8-bit cache the
host step's attention addresses every position, so there they keep every position, as ``info`` counts.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from hf2q.engine.memory_plan import kv_need
from hf2q.sched.ledger import reusable_prefix
from tests.engine_support import convert_f32, load_runner, random_tokens

pytestmark = pytest.mark.slow  # converts the checkpoint and runs transformers on 1,410 tokens

PROMPT, DECODE, CHUNK = 1400, 10, 256


@pytest.fixture(scope="module")
def gemma3(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("gemma3")
    return src, convert_f32(src, tmp_path_factory.mktemp("gemma3") / "f32.gguf")


@pytest.fixture(params=["host", "graph"])
def runner(gemma3, monkeypatch, request):
    if request.param == "graph":
        monkeypatch.setenv("HF2Q_NO_HOST_DECODE", "1")
    r = load_runner(gemma3[1], gemma3[0])
    if request.param == "host" and r.host_decoder is None:
        pytest.skip("the CPU host decode kernels are not built on this machine")
    return r


def test_decode_keeps_the_window_only_and_matches_transformers(gemma3, runner):
    import torch
    import transformers

    assert runner.window_layers == (16, frozenset({0, 1}))
    tokens = random_tokens(PROMPT + DECODE, seed=21)
    seq, ends, out = runner.new_sequence(), [], []
    for first in range(0, PROMPT, CHUNK):
        out.append(runner.prefill(seq, tokens[first:min(first + CHUNK, PROMPT)]))
        ends.append(min(first + CHUNK, PROMPT) - 1)
    for pos in range(PROMPT, len(tokens)):
        out.append(runner.decode([seq], [tokens[pos]])[0])
        ends.append(pos)
    assert seq.window.base >= 512 and seq.window_nbytes <= runner.kv_bytes_per_slot + CHUNK * 2 * seq.position_bytes
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma3[0], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()
    assert float(np.abs(np.stack(out) - ref[ends]).max()) < 1e-3
    need = kv_need(runner.gguf.hparams, seq.dtype.size, on_cpu=False)
    assert (need.per_token, need.window_bytes()) == (runner.kv_bytes_per_token, runner.kv_bytes_per_slot)
    assert runner.kv_bytes_per_token == seq.bytes_per_token and not runner.trims_prefix

    held = tokens  # the slot now holds the whole prompt and its decoded tokens
    prompt = held[:1300] + random_tokens(50, seed=22)
    reuse = reusable_prefix(held, prompt, points=seq.published_points)
    assert 1024 <= reuse <= 1300
    seq.trim(reuse)
    got = runner.prefill(seq, prompt[reuse:])
    # on the host step the reused prompt's short tail runs as host rows, the cold prompt's last chunk on the graph
    same = 1e-4 if runner.host_decoder is None else 1e-3
    np.testing.assert_allclose(got, runner.prefill(runner.new_sequence(), prompt), atol=same, rtol=0)


def test_host_decode_over_an_8bit_cache_keeps_every_position(gemma3):
    from hf2q.engine.runner import MlxModelRunner

    f16 = load_runner(gemma3[1], gemma3[0])
    if f16.host_decoder is None:
        pytest.skip("the CPU host decode kernels are not built on this machine")
    runner = MlxModelRunner(f16.gguf, f16.model, f16.dtype, None, "q8")
    assert runner.host_decoder is not None and not runner.host_decoder.keeps_windows
    assert runner.window_layers is None and runner.new_sequence().window is None and runner.trims_prefix
    need = kv_need(runner.gguf.hparams, 4, on_cpu=True, kv_type="q8")
    assert need.window_layers == 0 and need.per_token == runner.kv_bytes_per_token
    assert kv_need(runner.gguf.hparams, 4, on_cpu=True).window_layers == 2  # a float cache: windowed