"""The 8-bit KV cache (``--kv-cache-type q8|q8-rotated``): its codec and attention against the numpy
twin (``kv_quant_ref``), the rotation's invariants, and the engine running on it — stacked and
per-sequence batches, gemma3's sliding window, export/import — against the f16 cache."""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hf2q.engine import kv_quant_ref as ref
from hf2q.engine.kv_quant import make_codec
from hf2q.engine.kv_layout import hadamard
from hf2q.errors import InputError
from tests.engine_support import random_tokens, tiny_runner


def _rows(seed: int, shape, outlier: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32)
    if outlier:
        x[..., 5] *= outlier  # one channel far larger than the others, as real keys have
    return x


@settings(max_examples=25, deadline=None)
@given(heads=st.integers(1, 3), n=st.integers(1, 9), width=st.sampled_from([32, 64, 128, 256]),
       spread=st.floats(1e-3, 1e3), outlier=st.sampled_from([0.0, 30.0]), seed=st.integers(0, 2**16))
def test_codec_matches_numpy_reference(heads, n, width, spread, outlier, seed):
    x = _rows(seed, (heads, n, width), outlier) * np.float32(spread)
    x[0, 0] = 0  # an all-zero row: scale 0, decoded as zeros
    codes, scales = make_codec("q8", width, mx.float32, "llama").encode(mx.array(x))
    want_codes, want_scales = ref.encode(x)
    got_codes = np.array(mx.view(codes, mx.uint8)).astype(int)
    np.testing.assert_allclose(np.array(scales), want_scales, rtol=1e-6)
    assert np.abs(got_codes - want_codes.astype(int)).max() <= 1  # a rounding tie may fall either way
    assert (got_codes != want_codes).mean() < 0.01
    back = ref.decode(got_codes.astype(np.uint8), np.array(scales))
    step = np.repeat(want_scales, min(64, width), axis=-1)
    assert np.all(np.abs(back - x) <= step * 0.5 * (1 + 1e-5) + 1e-30)
    # MLX's own affine 8-bit reader sees the same values (the layout quantized_matmul multiplies by)
    mlx_view = mx.dequantize(codes, scales, scales * -128, group_size=min(64, width), bits=8)
    assert np.all(np.abs(np.array(mlx_view) - back) <= step * 1e-4)  # (q − 128)·s, rounded as q·s − 128·s


@pytest.mark.parametrize("kind", ["q8", "q8-rotated"])
@pytest.mark.parametrize("width,dtype", [(64, "float32"), (256, "float32"), (64, "float16")])
def test_attention_over_q8_equals_attention_over_the_dequantized_cache(kind, width, dtype, monkeypatch):
    """Grouped-query heads (6 over 2), a causal chunk of 4 after 7 cached positions (in query blocks
    of 3 and 1), a batch of 2; a 16-bit engine's rows and scales are 16-bit, its scores and softmax
    float32 as in the twin."""
    from hf2q.engine import kv_quant

    monkeypatch.setattr(kv_quant, "QUERY_BLOCK", 3)
    np_dtype = np.dtype(dtype)
    q, k, v = (a.astype(np_dtype) for a in (_rows(1, (2, 6, 4, width)), _rows(2, (2, 2, 11, width), 20.0),
                                           _rows(3, (2, 2, 11, width))))
    mask = np.arange(11)[None, :] <= (7 + np.arange(4))[:, None]
    mask = np.broadcast_to(mask, (2, 1, 4, 11)).copy()
    mask[1, :, :, 9:] = False  # the second row is shorter (padding)
    codec = make_codec(kind, width, getattr(mx, dtype), "llama")
    got = codec.attend(mx.array(q), codec.encode(mx.array(k)), codec.encode(mx.array(v)), width ** -0.5,
                       mx.array(mask))
    assert got.dtype == getattr(mx, dtype)
    want = ref.attention(q, k, v, width ** -0.5, mask, rotated=kind == "q8-rotated", scale_dtype=np_dtype)
    tol = 2e-5 if dtype == "float32" else 2e-3  # the output's own rounding
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=tol * np.abs(want).max(), rtol=0)


def test_rotation_keeps_scores_and_spreads_outliers():
    h = hadamard(128)
    np.testing.assert_allclose(h @ h, np.eye(128), atol=1e-12)  # orthonormal and its own inverse
    q, k = _rows(4, (5, 128)).astype(np.float64), _rows(5, (7, 128), 50.0).astype(np.float64)
    np.testing.assert_allclose((q @ h) @ (k @ h).T, q @ k.T, rtol=1e-9, atol=1e-9)
    plain = np.abs(ref.decode(*ref.encode(k)) - k).mean()
    rotated = np.abs(ref.decode(*ref.encode(k, rotated=True)) @ h - k).mean()
    assert rotated < plain / 3  # one large channel no longer sets every group's scale


def test_unsupported_caches_are_refused_in_one_line():
    with pytest.raises(InputError, match="power-of-two head size; llama has 96"):
        make_codec("q8-rotated", 96, mx.float32, "llama")
    with pytest.raises(InputError, match="not supported for deepseek4"):
        make_codec("q8", 256, mx.float32, "deepseek4")
    with pytest.raises(InputError, match="must be one of"):
        make_codec("q4", 64, mx.float32, "llama")
    assert make_codec("f16", 64, mx.float32, "llama") is None


def test_bad_kv_cache_type_exits_2(capsys):
    from hf2q.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--kv-cache-type", "q4"])
    assert e.value.code == 2
    assert "invalid choice: 'q4'" in capsys.readouterr().err


def _on_cache(f16, kv_type: str, stack: bool):
    from hf2q.engine.runner import MlxModelRunner

    runner = MlxModelRunner(f16.gguf, f16.model, f16.dtype, None, kv_type)
    runner.stack_decode = stack
    runner.host_decoder = None  # the MLX graph's 8-bit attention (the host step's: test_kv_quant_host.py)
    return runner


@pytest.fixture(scope="module")
def runners(tiny_checkpoint, tmp_path_factory):
    """Per family: the f16 runner, and q8 runners (stacking and not) and a q8-rotated one on its model."""
    made = {}
    for family in ("qwen3", "gemma3"):
        f16 = tiny_runner(tiny_checkpoint, tmp_path_factory, family)
        made[family] = {"f16": f16, "q8": _on_cache(f16, "q8", True), "q8-flat": _on_cache(f16, "q8", False),
                        "q8r": _on_cache(f16, "q8-rotated", True)}
    return made


def _run(runner, prompts, steps):
    seqs = [runner.new_sequence() for _ in prompts]
    logits = [runner.prefill(s, p)[None] for s, p in zip(seqs, prompts)]
    for step in range(steps):  # the same tokens for every cache type: logits comparable row by row
        logits.append(runner.decode(seqs, random_tokens(len(seqs), seed=100 + step)))
    return seqs, np.concatenate(logits)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_engine_on_q8_cache_tracks_f16(family, runners):
    """Three sequences (one crossing a cache growth step) prefilled, then 12 batched decode steps:
    the stacked and per-sequence q8 paths agree, and both stay near the f16 cache's logits."""
    r = runners[family]
    prompts = [random_tokens(n, seed=n) for n in (5, 250, 40)]
    q8_seqs, q8 = _run(r["q8"], prompts, 12)
    assert r["q8"]._stack is not None and r["q8"]._stack.holds(q8_seqs)  # the batch decoded stacked
    _, flat = _run(r["q8-flat"], prompts, 12)
    np.testing.assert_allclose(q8, flat, atol=1e-4, rtol=1e-4)
    f16_seqs, f16 = _run(r["f16"], prompts, 12)
    for name, budget in (("q8", 0.03), ("q8r", 0.03)):
        got = q8 if name == "q8" else _run(r[name], prompts, 12)[1]
        scale = np.abs(f16).max()
        assert np.abs(got - f16).max() < budget * scale, name
        assert (got.argmax(-1) == f16.argmax(-1)).mean() >= 0.9, name
    a, b = q8_seqs[1], f16_seqs[1]
    assert a.position_bytes * 3 < b.position_bytes  # float32 on the CPU: 4 + 4/64 bytes vs 8 per value pair
    assert r["q8"].kv_bytes_per_token == a.bytes_per_token


def test_q8_export_import_restores_the_same_cache(runners):
    """A q8 cache's exported rows, imported into a fresh q8 sequence, continue exactly as the original
    (the rows are stored again as they were); the engine identity keeps them from an f16 store."""
    r = runners["qwen3"]["q8r"]
    prompt = random_tokens(60, seed=3)
    seq = r.new_sequence()
    r.prefill(seq, prompt)
    arrays = r.export_kv(seq, 0, 60)
    other = r.new_sequence()
    r.import_kv(other, arrays, 60)
    np.testing.assert_array_equal(r.decode([seq], [11]), r.decode([other], [11]))
    for li in range(seq.n_layers):
        for x, y in zip(seq.keys[li], other.keys[li]):
            np.testing.assert_array_equal(np.array(x[:, :61]), np.array(y[:, :61]))
    assert r.kv_identity.endswith("-kv-q8-rotated") and runners["qwen3"]["f16"].kv_identity != r.kv_identity


def test_q8_bytes_are_what_the_cache_allocates(runners):
    """The figure admission reserves per token is the arrays' real size: per layer and KV head, K and V
    rows of 32 one-byte codes plus one float32 scale (the CPU engine); and one prefill's allocation
    (``seq.nbytes``) is the sum of its arrays' bytes. The store fingerprints of the two caches differ."""
    from hf2q.kvstore.blockfile import FORMAT_VERSION
    from hf2q.kvstore.fingerprint import model_fingerprint

    r, f16 = runners["qwen3"]["q8"], runners["qwen3"]["f16"]
    n_layers, kv_heads, head_dim = r.model.kv_shape
    assert head_dim == 32 and r.kv_bytes_per_token == n_layers * kv_heads * 2 * (32 + 4)
    assert f16.kv_bytes_per_token == n_layers * kv_heads * 2 * 32 * 4
    seq = r.new_sequence()
    r.prefill(seq, random_tokens(300, seed=9))
    held = sum(a.nbytes for buf in seq.keys + seq.values for a in buf)
    assert seq.nbytes == held == seq.capacity * r.kv_bytes_per_token
    path = r.gguf.path
    assert model_fingerprint(path, None, None, FORMAT_VERSION, r.kv_identity) != \
        model_fingerprint(path, None, None, FORMAT_VERSION, f16.kv_identity)


def test_hybrid_qwen35_full_attention_layers_on_q8(tiny_checkpoint, tmp_path_factory):
    """qwen35's full-attention blocks attend through the shared path: on a q8-rotated cache its logits
    stay near the f16 cache's through a prefill and batched decode steps (recurrent state untouched)."""
    f16 = tiny_runner(tiny_checkpoint, tmp_path_factory, "qwen35")
    q8 = _on_cache(f16, "q8-rotated", True)
    prompts = [random_tokens(n, seed=n) for n in (30, 70)]
    want, got = _run(f16, prompts, 6)[1], _run(q8, prompts, 6)[1]
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
