"""Gemma 4 (``gemma4``: dense, E2B-style, MoE) against transformers' ``Gemma4ForCausalLM``.

The GGUFs are ``hf2q convert`` (byte-identical to llama.cpp's converter, ``test_convert_gemma4``) of the
tiny random dense checkpoint (``tests/models/tiny.py``): two sliding layers (2 KV heads × 32, window 16,
rope base 1e4) and a global one (1 KV head × 64 whose keys double as values, proportional rope with a
quarter of the pairs rotated, base 1e6), layer output scales, soft-cap 30. The prompt is longer than the
window and than one prefill chunk, then ten tokens are decoded; chunking and batching must not change
the logits, and the GGUF check must pass exactly the tensors the engine reads. The E2B-style checkpoint
adds per-layer embeddings, two KV-shared layers (no K/V of their own) and a double-wide MLP on them; the
MoE one routed experts beside every dense MLP.
"""

from __future__ import annotations

from pathlib import Path

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q.engine.runner import MlxModelRunner
from hf2q.errors import InputError
from hf2q.formats.gguf_check import check_servable
from hf2q.formats.gguf_file import open_gguf
from hf2q.formats.gguf_keys import Keys
from tests.engine_support import convert_f32, prefill_each, random_tokens

TOL_F32 = 1e-3
TOL_F16 = 0.05  # f16 weights against transformers' f32 (measured max 0.024 on this model)
CHUNK = 32
PROMPT = 80  # > two chunks, five windows
DECODE = 10
WINDOW = 16


def _reference(src: Path, tokens: list[int]) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.fixture(scope="module")
def gemma4(tiny_checkpoint, tmp_path_factory):
    """(checkpoint folder, f32 GGUF path, the test tokens, transformers logits of them)."""
    src = tiny_checkpoint("gemma4")
    f32 = convert_f32(src, tmp_path_factory.mktemp("gemma4") / "f32.gguf")
    tokens = random_tokens(PROMPT + DECODE, seed=5)
    return src, f32, tokens, _reference(src, tokens)


@pytest.fixture(scope="module")
def runner(gemma4):
    return MlxModelRunner.load(gemma4[1])


def _forward(runner, tokens, chunk=CHUNK, n_prompt=PROMPT) -> tuple[list[int], np.ndarray]:
    """``(positions, logits)``: the last logits of every prefill chunk of the prompt, then those of every
    decoded token, each with the position it predicts from."""
    seq, ends, out = runner.new_sequence(), [], []
    for first in range(0, n_prompt, chunk):
        piece = tokens[first:min(first + chunk, n_prompt)]
        out.append(runner.prefill(seq, piece))
        ends.append(first + len(piece) - 1)
    for pos in range(n_prompt, len(tokens)):
        out.append(runner.decode([seq], [tokens[pos]])[0])
        ends.append(pos)
    assert seq.length == len(tokens)
    return ends, np.stack(out)


def _max_error(runner, tokens, ref) -> float:
    ends, logits = _forward(runner, tokens)
    return float(np.abs(logits - ref[ends]).max())


def _assert_chunking_invariant(runner, tokens, chunks=(7, WINDOW, CHUNK)):
    """The prompt's last logits and every decode step's are those of a one-shot prefill."""
    tail = len(tokens) - PROMPT + 1
    want = _forward(runner, tokens, chunk=PROMPT)[1][-tail:]
    for chunk in chunks:
        np.testing.assert_allclose(_forward(runner, tokens, chunk=chunk)[1][-tail:], want, atol=1e-4, rtol=0)


@pytest.mark.slow  # the module fixture converts the checkpoint and runs transformers (~15 s)
def test_f32_logits_match_transformers(runner, gemma4):
    model = runner.model
    from hf2q.engine.cpu_decode_gemma4 import HostGemma4

    assert runner.arch == "gemma4" and isinstance(runner.host_decoder, HostGemma4)  # decode rows on the host
    assert [s.sliding for s in model.shapes] == [True, True, False]
    assert [(s.n_kv, s.head_dim) for s in model.shapes] == [(2, 32), (2, 32), (1, 64)]
    assert model.blocks[2].attn.v is None and model.blocks[0].attn.v is not None  # K as V on the global layer
    assert model.shapes[0].window == WINDOW < PROMPT
    ref = gemma4[3]
    assert float(np.std(ref)) > 0.5  # the reference is not flat
    assert _max_error(runner, gemma4[2], ref) < TOL_F32


@pytest.fixture(scope="module")
def e2b(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("gemma4_e2b")
    return MlxModelRunner.load(convert_f32(src, tmp_path_factory.mktemp("gemma4_e2b") / "f32.gguf")), src


@pytest.mark.slow
def test_e2b_logits_match_transformers(e2b):
    runner, src = e2b
    model = runner.model
    assert [s.kv_source for s in model.shapes] == [0, 1, 0, 1] and model.kv_shape[0] == 2
    assert model.blocks[3].attn.k is None and model.blocks[3].ffn.gate.shape[0] == 2 * model.blocks[0].ffn.gate.shape[0]
    assert model.cfg.ple_dim == 8
    tokens = random_tokens(PROMPT + DECODE, seed=6)
    ref = _reference(src, tokens)
    assert float(np.std(ref)) > 0.5
    assert _max_error(runner, tokens, ref) < TOL_F32
    _assert_chunking_invariant(runner, tokens, chunks=(7,))


@pytest.mark.slow
def test_e2b_batched_decode_and_tensors_read(e2b):
    runner = e2b[0]
    _batched_equals_single(runner)
    g = open_gguf(runner.gguf.path)
    check_servable(g)
    from hf2q.engine.models.gemma4 import build

    g.tensors = _Reads(g.tensors)
    build(g, mx.float32)
    assert g.tensors.read == set(g.tensors)


@pytest.mark.slow
def test_moe_logits_match_transformers(tiny_checkpoint, tmp_path):
    """26B-A4B-style: the dense MLP beside 4 routed experts (top 2, per-expert output scale)."""
    src = tiny_checkpoint("gemma4_moe")
    runner = MlxModelRunner.load(convert_f32(src, tmp_path / "moe.gguf"))
    assert all(b.experts is not None for b in runner.model.blocks)
    tokens = random_tokens(PROMPT + DECODE, seed=7)
    assert _max_error(runner, tokens, _reference(src, tokens)) < TOL_F32
    _batched_equals_single(runner)
    g = open_gguf(runner.gguf.path)
    from hf2q.engine.models.gemma4 import build

    g.tensors = _Reads(g.tensors)
    build(g, mx.float32)
    assert g.tensors.read == set(g.tensors)


@pytest.mark.slow
def test_f16_conversion_logits(gemma4, tmp_path, cli):
    src, _, tokens, ref = gemma4
    out = tmp_path / "f16.gguf"
    assert cli("convert", src, "-q", "f16", "-o", out, "--no-integrity").code == 0
    f16 = MlxModelRunner.load(out)
    assert f16.model.blocks[0].attn.q.weight.dtype == mx.float32  # compute dtype on the CPU
    assert _max_error(f16, tokens, ref) < TOL_F16


@pytest.mark.slow
def test_chunked_prefill_equals_one_shot(runner, gemma4):
    _assert_chunking_invariant(runner, gemma4[2])


@pytest.mark.slow
def test_batched_decode_equals_single_decodes(runner):
    _batched_equals_single(runner)


def _batched_equals_single(runner, steps: int = 8):
    """Three sequences (inside and beyond the window) decoded greedily as one batch, then each alone on
    the batch's tokens: the same logits at every step."""
    prompts = [random_tokens(n, seed=n) for n in (5, 37, 12)]
    batch, first = prefill_each(runner, prompts)
    fed, batched = [first], []
    for _ in range(steps):
        batched.append(runner.decode(batch, fed[-1]))
        fed.append([int(t) for t in np.argmax(batched[-1], -1)])
    assert [s.length for s in batch] == [len(p) + steps for p in prompts]
    for row, prompt in enumerate(prompts):
        seq = runner.new_sequence()
        runner.prefill(seq, prompt)
        alone = np.stack([runner.decode([seq], [fed[j][row]])[0] for j in range(steps)])
        np.testing.assert_allclose(alone, np.stack([b[row] for b in batched]), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_prefix_trim_continues_like_a_cold_sequence(runner):
    tokens = random_tokens(60, seed=9)
    seq = runner.new_sequence()
    runner.prefill(seq, tokens)
    seq.trim(25)
    np.testing.assert_allclose(runner.prefill(seq, tokens[25:]), runner.prefill(runner.new_sequence(), tokens),
                               atol=1e-4, rtol=0)


@pytest.mark.slow
def test_check_passes_exactly_the_tensors_the_engine_reads(gemma4):
    g = open_gguf(gemma4[1])
    check_servable(g)
    from hf2q.engine.models.gemma4 import build

    g.tensors = _Reads(g.tensors)
    build(g, mx.float32)
    assert g.tensors.read == set(g.tensors)  # nothing in the file is ignored, nothing outside it is read
    for name in ("blk.2.attn_q_norm.weight", "rope_freqs.weight", "blk.0.attn_k.weight"):
        g2 = open_gguf(gemma4[1])
        del g2.tensors[name]
        with pytest.raises(InputError, match=f"missing tensor '{name}'"):
            check_servable(g2)


class _Reads(dict):
    """A tensor table that records the names looked up in it."""

    def __init__(self, *a):
        super().__init__(*a)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


@pytest.mark.slow
@pytest.mark.parametrize("template,value,why", [
    (Keys.LLM.EXPERT_COUNT, 4, "missing GGUF metadata key 'gemma4.expert_used_count'"),
    (Keys.Attention.SHARED_KV_LAYERS, 1, "no earlier layer of its kind"),  # the global layer 2 shared: from what?
    (Keys.LLM.EMBD_LENGTH_PER_LAYER_INP, 8, "missing tensor 'per_layer_token_embd"),
    (Keys.LLM.FEED_FORWARD_LENGTH, [128, 256], "one feed-forward size per layer"),
    (Keys.Attention.HEAD_COUNT_KV, [2, 3, 1], "KV head count per layer"),
    (Keys.Attention.SLIDING_WINDOW_PATTERN, [True, False], "one sliding flag per layer"),
])
def test_unserved_shapes_and_bad_metadata_are_refused(gemma4, template, value, why):
    g = open_gguf(gemma4[1])
    g.metadata[g.hparams.key(template)] = value
    with pytest.raises(InputError, match=why):
        check_servable(g)


@pytest.mark.slow
def test_info_ready_and_generate(gemma4, cli):
    r = cli("info", gemma4[1])
    assert r.code == 0 and "Serve support: ready" in r.out
    prompt = "The capital of France is"
    r = cli("generate", "--model", gemma4[1], "--prompt", prompt, "--max-tokens", "6", "--temperature", "0", "--raw")
    assert r.code == 0, r.err
    from hf2q.text.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(gemma4[1])
    runner = MlxModelRunner.load(gemma4[1])
    seq, ids = runner.new_sequence(), []
    logits = runner.prefill(seq, tok.encode(prompt))
    for _ in range(6):
        ids.append(int(np.argmax(logits)))
        logits = runner.decode([seq], [ids[-1]])[0]
    assert r.out.strip() == tok.decode(ids, skip_special=True).strip() != ""


@settings(max_examples=40, deadline=None)
@given(n_kv=st.integers(1, 3), pieces=st.integers(1, 3), extra=st.integers(0, 2), T=st.integers(1, 5))
def test_cache_layout_round_trip(n_kv, pieces, extra, T):
    """A layer's K/V survive the shared cache layout (heads split into pieces, padded) unchanged."""
    from hf2q.engine.models.gemma4 import Gemma4Attention, Gemma4Config, LayerShape

    piece = 4
    cfg = Gemma4Config(1, 8, 2, 10, 64, 1e-6, None, cache_heads=n_kv * pieces + extra, cache_dim=piece)
    attn = object.__new__(Gemma4Attention)
    attn.cfg, attn.pieces = cfg, pieces
    attn.shape = LayerShape(False, n_kv, piece * pieces, piece * pieces, 1e4, None, None, kv_source=0)
    x = mx.array(np.random.default_rng(T).standard_normal((2, n_kv, T, piece * pieces)).astype(np.float32))
    packed = attn._to_cache(x)
    assert packed.shape == (2, cfg.cache_heads, T, piece)
    np.testing.assert_array_equal(np.array(attn._from_cache(packed)), np.array(x))


@pytest.mark.slow
def test_q8_0_moe_equals_its_dequantized_weights(tiny_checkpoint, tmp_path, cli):
    """q8_0 (quantized experts through ``gather_qmm``, quantized attention and MLP) gives the logits of
    the same weights dequantized by gguf-py, so the quantized kernels are exact; against transformers it
    stays within the rounding this random model amplifies (measured max 0.69)."""
    from tests.test_engine_qwen35 import _dequantized_runner

    src = tiny_checkpoint("gemma4_moe")
    out = tmp_path / "moe-q8_0.gguf"
    assert cli("convert", src, "-q", "q8_0", "-o", out, "--no-integrity").code == 0
    q8 = MlxModelRunner.load(out)
    assert q8.model.blocks[0].experts.gate_up_exps.quantized and q8.model.blocks[0].attn.q.quantized
    tokens = random_tokens(40, seed=3)
    ends, got = _forward(q8, tokens, n_prompt=32)
    _, want = _forward(_dequantized_runner(out), tokens, n_prompt=32)
    np.testing.assert_allclose(got, want, atol=TOL_F32, rtol=0)
    assert np.abs(got - _reference(src, tokens)[ends]).max() < 2.0
