"""GGUF quantized blocks → MLX affine groups: exact for every 32-element-group type,
measured for the 16-element sub-block types. The reference is the ``gguf`` package's own
numpy dequantizer (independent of our repacking), and MLX's ``dequantize`` /
``quantized_matmul`` run on our packed arrays."""

from __future__ import annotations

import hf2q.engine  # noqa: F401 — fast BLAS before MLX
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from hf2q.engine.quant_repack import affine_dequantize, pack_bits, to_affine, unpack_bits

EXACT = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K]
SUBBLOCK16 = [T.Q2_K, T.Q3_K, T.Q6_K]


def _weights(rows=8, cols=512, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2.0, (rows, 1)).astype(np.float32)
    return w.astype(np.float16).astype(np.float32)  # llama.cpp quantizes F16-rounded input


def _raw(w, qtype):
    from hf2q.ggml import codec

    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        return quants.quantize(w, qtype)  # gguf-py's own quantizer
    return codec.quantize(w, qtype)  # K-quants: our llama.cpp-identical codec


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_bits_roundtrip_matches_mlx_layout(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 1 << bits, (3, 64)).astype(np.uint8)
    packed = pack_bits(q, bits)
    assert np.array_equal(unpack_bits(packed, bits, 64), q)
    scales = np.full((3, 2), 0.5, np.float32)
    biases = np.full((3, 2), -1.0, np.float32)
    if bits in (2, 3, 4, 5, 6, 8):
        got = np.array(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=32, bits=bits))
        assert np.array_equal(got, q * 0.5 - 1.0)


@pytest.mark.parametrize("qtype", EXACT, ids=lambda t: t.name)
def test_exact_types_dequantize_identically(qtype):
    w = _weights()
    raw = _raw(w, qtype)
    ref = quants.dequantize(raw, qtype).reshape(w.shape)
    a = to_affine(raw, qtype, w.shape)
    assert a.exact and a.group_size == 32
    assert np.array_equal(affine_dequantize(a, w.shape[1]), ref)
    got = mx.dequantize(mx.array(a.packed), mx.array(a.scales), mx.array(a.biases), group_size=32, bits=a.bits)
    assert np.array_equal(np.array(got), ref)
    # the quantized matmul over our packing equals a float matmul over the reference weights
    x = np.random.default_rng(1).standard_normal((3, w.shape[1])).astype(np.float32)
    y = mx.quantized_matmul(mx.array(x), mx.array(a.packed), mx.array(a.scales), mx.array(a.biases),
                            transpose=True, group_size=32, bits=a.bits)
    np.testing.assert_allclose(np.array(y), x @ ref.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("qtype", SUBBLOCK16, ids=lambda t: t.name)
def test_subblock16_types_requantize_to_8bit_with_small_error(qtype):
    w = _weights()
    raw = _raw(w, qtype)
    ref = quants.dequantize(raw, qtype).reshape(w.shape)
    a = to_affine(raw, qtype, w.shape)
    assert not a.exact and a.bits == 8
    got = affine_dequantize(a, w.shape[1])
    # 8-bit min/max groups of 32: error at most half a step of each group's range/255
    g_ref = ref.reshape(8, -1, 32)
    step = (g_ref.max(-1) - g_ref.min(-1)) / 255.0
    err = np.abs(got - ref).reshape(8, -1, 32).max(-1)
    assert np.all(err <= step * 0.5 + 1e-6)
    rel = np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref ** 2))
    assert rel < 5e-3


def test_real_gemma_k_quant_tensors(gemma3_gguf):
    """Q4_K, Q5_0, Q6_K and Q8_0 tensors of the real Gemma-3 file."""
    from hf2q.formats.gguf_file import open_gguf

    g = open_gguf(gemma3_gguf)
    seen = set()
    for t in g.tensors.values():
        if t.qtype in seen or t.qtype in (T.F32,) or t.name == "token_embd.weight":
            continue
        seen.add(t.qtype)
        ref = quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)
        a = to_affine(t.data, t.qtype, t.shape)
        got = affine_dequantize(a, t.shape[-1])
        if a.exact:
            assert np.array_equal(got, ref), t.name
        else:
            assert np.abs(got - ref).max() <= np.abs(ref).max() / 255.0, t.name
    assert {T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0} <= seen


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_banded_repack_equals_one_piece(qtype, monkeypatch):
    """A big tensor is repacked in row bands on the shared CPU pool; the bands must join to the same bytes."""
    import hf2q.engine.quant_repack as repack
    from hf2q.kernels import cpu_blas

    w = _weights(rows=37, cols=512, seed=3)
    raw = _raw(w, qtype)
    whole = repack._to_affine_rows(raw, qtype, 37, 512)
    monkeypatch.setattr(repack, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setenv("HF2Q_BLAS_THREADS", "4")
    monkeypatch.setattr(cpu_blas, "_POOL", [])  # a pool of 4 for this test, the shared one back after it
    assert len(repack._bands(37, 512)) > 1
    banded = to_affine(raw, qtype, w.shape)
    for a, b in ((whole.packed, banded.packed), (whole.scales, banded.scales), (whole.biases, banded.biases)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert (whole.bits, whole.exact) == (banded.bits, banded.exact)
