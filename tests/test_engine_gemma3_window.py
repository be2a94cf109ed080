"""Gemma 3's local layers keep only their window where the MLX graph decodes (the GPU; here the CPU with
``HF2Q_NO_HOST_DECODE=1``), and the logits stay transformers' on a prompt many windows long; with the CPU
host decode step (its kernels address every position) they keep every position, as ``info`` counts.
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


@pytest.fixture
def graph_runner(gemma3, monkeypatch):
    monkeypatch.setenv("HF2Q_NO_HOST_DECODE", "1")
    return load_runner(gemma3[1], gemma3[0])


def test_graph_decode_keeps_the_window_only_and_matches_transformers(gemma3, graph_runner):
    import torch
    import transformers

    runner = graph_runner
    assert runner.host_decoder is None and runner.window_layers == (16, frozenset({0, 1}))
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
    np.testing.assert_allclose(got, runner.prefill(runner.new_sequence(), prompt), atol=1e-4, rtol=0)


def test_host_decode_keeps_every_position(gemma3):
    runner = load_runner(gemma3[1], gemma3[0])
    if runner.host_decoder is None:
        pytest.skip("the CPU host decode kernels are not built on this machine")
    assert runner.window_layers is None and runner.new_sequence().window is None and runner.trims_prefix
    need = kv_need(runner.gguf.hparams, 4, on_cpu=True)
    assert need.window_layers == 0 and need.per_token == runner.kv_bytes_per_token
