"""One banding of a quantized load: ``Linear``'s repack cuts each tensor into the bands of
``quant_repack._bands`` once (a few per pool worker, each at most ``REPACK_CHUNK`` weights) and writes each
straight into the MLX buffers, bit for bit the tensor repacked in one piece."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hf2q.engine import quant_repack
from hf2q.engine.layers import Linear, load_products, on_cpu
from hf2q.formats.gguf_file import GGUFTensor
from hf2q.ggml import codec
from hf2q.kernels import cpu_blas, cpu_repack

N = 256


def _tensor(name: str, rows: int, qtype, seed: int) -> GGUFTensor:
    w = (np.random.default_rng(seed).standard_normal((rows, N)) * 0.05).astype(np.float32)
    data = codec.quantize(w, qtype)
    return GGUFTensor(name, qtype, (rows, N), data, data.nbytes)


@pytest.fixture
def small_bands(monkeypatch):
    """A pool of 4 and bands of at most 16 rows, so a small tensor is cut as a big one is; the calls that
    repack rows recorded (their row counts)."""
    monkeypatch.setattr(quant_repack, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(quant_repack, "REPACK_CHUNK", 16 * N)
    monkeypatch.setenv("HF2Q_BLAS_THREADS", "4")
    monkeypatch.setattr(cpu_blas, "_POOL", [])  # a pool of 4 for this test, the shared one back after it
    calls: list[int] = []
    real, real_c = quant_repack._to_affine_rows, cpu_repack.repack_band

    def counted(raw, qtype, rows, n, wide=False):
        if rows > 1:  # not the one-row probe that sizes the destination (no band here is one row)
            calls.append(rows)
        return real(raw, qtype, rows, n, wide)

    def counted_c(raw, *args, **kw):  # a band the C pass takes (the numpy path repacks the others)
        done = real_c(raw, *args, **kw)
        calls.extend([raw.shape[0]] if done else [])
        return done

    monkeypatch.setattr(quant_repack, "_to_affine_rows", counted)
    monkeypatch.setattr(cpu_repack, "repack_band", counted_c)
    return calls, real


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_a_load_bands_each_tensor_once(qtype, small_bands):
    calls, whole = small_bands
    t = _tensor("w", 100, qtype, 1)
    lin = Linear(t, mx.float32)
    bands = quant_repack._bands(100, N)
    assert len(bands) == 16  # four per worker: the memory cap (7 bands of 16 rows) asks for fewer
    assert sorted(calls) == sorted(b - a for a, b in bands)  # once each (in any order): no banding inside a band
    ref = whole(np.asarray(t.data).reshape(100, -1), qtype, 100, N, on_cpu())  # a CPU load stores 5-bit codes as bytes
    for got, want in ((lin.weight, ref.packed), (lin.scales, ref.scales), (lin.biases, ref.biases)):
        assert np.array_equal(np.array(got), want)
    assert (lin.bits, lin.exact) == (ref.bits, ref.exact)


def test_the_memory_cap_sets_the_band_count_of_a_big_tensor(small_bands):
    calls, _ = small_bands
    Linear(_tensor("w", 400, T.Q8_0, 2), mx.float32)
    assert len(calls) == 25 and max(calls) <= 16  # 400 rows in bands of at most 16: more than 4 per worker


def test_a_stack_of_tensors_bands_each_part_and_joins_them(small_bands):
    calls, whole = small_bands
    tensors = [_tensor(f"p{i}", rows, T.Q4_K, 10 + i) for i, rows in enumerate((40, 7, 33))]
    parts, products = load_products(tensors, mx.float32)
    assert len(products) == 1
    assert sorted(calls) == sorted(b - a for t in tensors for a, b in quant_repack._bands(t.shape[0], N))
    for p, t in zip(parts, tensors):
        ref = whole(np.asarray(t.data).reshape(t.shape[0], -1), t.qtype, t.shape[0], N, on_cpu())
        assert np.array_equal(np.array(p.weight), ref.packed) and np.array_equal(np.array(p.scales), ref.scales)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_a_repack_holds_a_few_bands_beside_its_output(qtype, monkeypatch):
    """The transient host memory of a repack is the bands in flight, not a second copy of the tensor (bands
    written and kept until the end, or joined at the end, would double it)."""
    import tracemalloc

    monkeypatch.setattr(quant_repack, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(quant_repack, "REPACK_CHUNK", 16 * 1024)  # 128 bands of 16 rows
    monkeypatch.setenv("HF2Q_BLAS_THREADS", "4")
    monkeypatch.setattr(cpu_blas, "_POOL", [])
    w = (np.random.default_rng(3).standard_normal((2048, 1024)) * 0.05).astype(np.float32)
    raw = codec.quantize(w, qtype)
    quant_repack.to_affine(raw[:64], qtype, (64, 1024))  # the pool started outside the measurement
    tracemalloc.start()
    try:
        aff = quant_repack.to_affine(raw, qtype, (2048, 1024))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    out = aff.packed.nbytes + aff.scales.nbytes + aff.biases.nbytes
    assert peak - out < 0.5 * out, (peak, out)
