"""CPU replacements for slow MLX CPU ops, each against the MLX op it replaces."""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from hf2q.kernels import cpu_ops, cpu_qmatvec


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_qmatvec_matches_mlx_quantized_matmul(bits):
    if cpu_qmatvec.kernel() is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(bits)
    w = mx.array(rng.standard_normal((300, 576)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=32, bits=bits)
    mx.eval(wq, s, b)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    ref = np.array(mx.quantized_matmul(mx.array(x), wq, s, b, transpose=True, group_size=32, bits=bits))
    got = cpu_qmatvec.qmatvec(np.asarray(memoryview(wq)).view(np.uint8).reshape(300, -1),
                              np.asarray(memoryview(s)), np.asarray(memoryview(b)), x, bits)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_equals_mlx_bit_for_bit(bits):
    """The C dequantization a prefill's float32 weight comes from rounds as ``mx.dequantize`` does (product, then
    sum): equal bits, over the whole matrix, a row slice (a fused product's part) and into a given buffer."""
    if cpu_qmatvec.kernel() is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(bits)
    w = mx.array((rng.standard_normal((300, 576)) * rng.uniform(1e-3, 30, (300, 1))).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=32, bits=bits)
    want = np.array(mx.dequantize(wq, s, b, group_size=32, bits=bits))
    packed = np.asarray(memoryview(wq)).view(np.uint8).reshape(300, -1)
    s, b = np.asarray(memoryview(s)), np.asarray(memoryview(b))
    assert np.array_equal(cpu_qmatvec.dequantize(packed, s, b, bits), want)
    assert np.array_equal(cpu_qmatvec.dequantize(packed[17:230], s[17:230], b[17:230], bits), want[17:230])
    out = np.full((300, 576), np.nan, np.float32)
    assert cpu_qmatvec.dequantize(packed, s, b, bits, out) is out and np.array_equal(out, want)


def test_host_prefill_weight_equals_mlx_dequantize(monkeypatch):
    """A weight the dense cache does not keep is dequantized by the C kernel into a reused buffer; its values,
    and so the product, equal MLX's ``dequantize`` bit for bit."""
    if not cpu_blas.has_matmul() or cpu_qmatvec.kernel() is None:
        pytest.skip("no fast BLAS or no C compiler")
    monkeypatch.setenv("HF2Q_DENSE_CACHE_MB", "0")
    rng = np.random.default_rng(7)
    lin, _ = _q8_linear(rng, 96, 64)
    other, _ = _q8_linear(rng, 40, 64)
    want = np.array(lin.dense())
    assert np.array_equal(lin.dense_host(), want) and lin._dense_kept is None
    x = rng.standard_normal((40, 64)).astype(np.float32)
    y = lin.host_matmul(x)
    other.host_matmul(x)  # the same scratch buffer, rewritten
    assert np.array_equal(lin.host_matmul(x), y)
    assert np.array_equal(y, cpu_blas.matmul_t(x, want))


@pytest.mark.parametrize("T", [64, 600])  # 600: several query blocks, each on its own key range
def test_host_attention_matches_sdpa(T):
    rng = np.random.default_rng(0)
    B, H, Hkv, L, D = 1, 6, 2, T + 64, 32
    q = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, Hkv, L, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hkv, L, D)).astype(np.float32))
    qpos = 64 + np.arange(T)[:, None]
    kpos = np.arange(L)[None, :]
    mask = ((kpos <= qpos) & (kpos > qpos - 24))[None, None]  # causal + sliding window
    assert cpu_ops.attention_on_host(q, L)
    got = np.array(cpu_ops.attention(q, k, v, 0.2, mask))
    ref = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mx.array(mask)))
    np.testing.assert_allclose(got, ref, atol=1e-5)
    got = np.array(cpu_ops.attention(q, k, v, 0.2, None))
    ref = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2))
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_host_activations_match_mlx():
    rng = np.random.default_rng(1)
    g = mx.array(rng.standard_normal((1, 64, 1024)).astype(np.float32) * 3)
    u = mx.array(rng.standard_normal((1, 64, 1024)).astype(np.float32))
    np.testing.assert_allclose(np.array(cpu_ops.silu_mul(g, u)), np.array(g * mx.sigmoid(g) * u), atol=1e-5)
    ref = np.array(mx.multiply(mx.array(0.5) * g * (1 + mx.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))), u))
    np.testing.assert_allclose(np.array(cpu_ops.gelu_tanh_mul(g, u)), ref, atol=1e-5)


def test_fast_blas_is_loaded():
    """The pinned wheel's OpenBLAS core runs on this CPU, so it is what MLX multiplies with."""
    import os

    from hf2q.kernels import cpu_blas

    installed = cpu_blas._find("cmeel.prefix/lib/libopenblas.so.0")
    if installed is None or os.environ.get("HF2Q_NO_FAST_BLAS"):
        pytest.skip("cmeel-openblas not installed or disabled")
    assert cpu_blas._core_runs_here(installed) is None
    assert cpu_blas.status().startswith("openblas")


def _fake_openblas(tmp_path, config: str):
    lib = tmp_path / "lib" / "libopenblas.so.0"
    (tmp_path / "include" / "openblas").mkdir(parents=True)
    lib.parent.mkdir()
    (tmp_path / "include" / "openblas" / "openblas_config.h").write_text(config)
    return lib


def test_an_openblas_built_for_a_missing_instruction_set_is_refused(tmp_path):
    from hf2q.kernels import cpu_blas

    lib = _fake_openblas(tmp_path, '#define OPENBLAS_SKYLAKEX\n#define OPENBLAS_CHAR_CORENAME "SKYLAKEX"\n')
    avx2_only = {"sse4_2", "avx", "avx2", "fma", "f16c"}
    why = cpu_blas._core_runs_here(lib, avx2_only)
    assert why is not None and "SKYLAKEX" in why and "avx512f" in why
    assert cpu_blas._core_runs_here(lib, avx2_only | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}) is None
    zen = _fake_openblas(tmp_path / "zen", '#define OPENBLAS_CHAR_CORENAME "ZEN"\n')
    assert cpu_blas._core_runs_here(zen, avx2_only) is None
    assert "avx2" in cpu_blas._core_runs_here(zen, {"sse4_2"})
    dynamic = _fake_openblas(tmp_path / "dyn", '#define OPENBLAS_DYNAMIC_ARCH\n#define OPENBLAS_CHAR_CORENAME "SKYLAKEX"\n')
    assert cpu_blas._core_runs_here(dynamic, avx2_only) is None


def test_a_graph_product_rounds_the_same_whatever_host_product_ran_before():
    """OpenBLAS rounds by its thread count, and MLX's graph products read the global count: no host product
    (one on one thread, the pool's workers starting, a host attention whose workers each multiply on one
    thread) may leave later graph products on another count — whatever ran before in this process."""
    import mlx.core as mx

    from hf2q.kernels import cpu_attention, cpu_blas

    if not cpu_blas.has_matmul() or cpu_blas.threads() < 2 or cpu_attention.kernel() is None:
        pytest.skip("needs the fast BLAS, its attention kernel and two threads")
    assert cpu_blas._openblas_threads_now() in (None, cpu_blas.threads())
    rng = np.random.default_rng(0)
    a = mx.array(rng.standard_normal((24, 1152), dtype=np.float32))
    b = mx.array(rng.standard_normal((1152, 3456), dtype=np.float32))
    first = np.array(a @ b)
    small = rng.standard_normal((4, 64), dtype=np.float32)
    np.testing.assert_allclose(cpu_blas.matmul_t(small, small), small @ small.T, rtol=1e-5, atol=1e-5)
    q, k, v = (mx.array(rng.standard_normal((1, 4, n, 64), dtype=np.float32)) for n in (300, 300, 300))
    assert cpu_attention.attention(q, k, v, 0.125, None) is not None
    assert cpu_blas._openblas_threads_now() in (None, cpu_blas.threads())
    assert np.array_equal(np.array(a @ b), first)


# --- fused CPU attention (hf2q/kernels/cpu_attention.py) -------------------------------------------------

from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from hf2q.kernels import cpu_attention, cpu_attention_ref, cpu_blas  # noqa: E402


def _needs_fused_kernel():
    if cpu_attention.kernel() is None:
        pytest.skip("no C compiler or no fast BLAS")


@pytest.fixture(params=[1, 2], ids=["1-worker", "2-workers"])
def blas_workers(request, monkeypatch):
    """Run a test with the shared BLAS pool at 1 and at 2 workers (tiles/slices taken from a shared counter)."""
    if request.param == 1:
        monkeypatch.setattr(cpu_blas, "_POOL", [None])
        monkeypatch.setenv("HF2Q_BLAS_THREADS", "1")
        yield 1
        return
    pool = ThreadPoolExecutor(2)
    monkeypatch.setattr(cpu_blas, "_POOL", [pool])
    monkeypatch.setenv("HF2Q_BLAS_THREADS", "2")
    yield 2
    pool.shutdown()


def _qkv(rng, B, H, Hkv, T, L, D, Dv=None):
    Dv = Dv or D
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, L, Dv)).astype(np.float32)
    return q, k, v


def _causal(T, offset, L, window=None):
    qpos = offset + np.arange(T)[:, None]
    kpos = np.arange(L)[None, :]
    m = kpos <= qpos
    if window is not None:
        m &= kpos > qpos - window
    return m[None, None]


# (B, H, Hkv, T, offset, D, window): T not a multiple of any tile, offsets > 0, GQA groups of 3 and 1,
# head sizes on the register-blocked path (64, 128) and on the BLAS path (32), T = 1 (one decode row)
ATTENTION_CASES = {
    "causal-gqa3-d64": (1, 9, 3, 300, 0, 64, None),
    "offset-gqa3-d64": (1, 9, 3, 181, 437, 64, None),
    "window-gqa2-d64": (1, 4, 2, 333, 200, 64, 48),
    "mha-d128": (1, 2, 2, 130, 70, 128, None),
    "blas-path-d32": (1, 6, 2, 300, 64, 32, 24),
    "t1-decode-row": (1, 9, 3, 1, 777, 64, None),
    "t1-window": (1, 4, 1, 1, 500, 64, 100),
}


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_fused_attention_matches_reference_and_sdpa(case, blas_workers):
    _needs_fused_kernel()
    B, H, Hkv, T, off, D, window = case
    L = off + T
    rng = np.random.default_rng(T + off + D)
    q, k, v = _qkv(rng, B, H, Hkv, T, L, D)
    mask = _causal(T, off, L, window)
    scale = D ** -0.5
    got = cpu_attention.attention(mx.array(q), mx.array(k), mx.array(v), scale, mask)
    assert got is not None
    got = np.array(got)
    ref = cpu_attention_ref.attention(q, k, v, scale, mask)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)
    sdpa = np.array(mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=scale,
                                                         mask=mx.array(mask)))
    np.testing.assert_allclose(got, sdpa, atol=2e-5, rtol=1e-4)


def test_fused_attention_unmasked_and_sliced_cache(blas_workers):
    """No mask (every key), keys/values as a slice of a larger cache buffer (strided, zero-copy)."""
    _needs_fused_kernel()
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 1, 6, 3, 77, 512, 64)
    kc, vc = mx.array(k), mx.array(v)
    ks, vs = kc[:, :, :200, :], vc[:, :, :200, :]  # like SequenceCache: capacity > length
    got = np.array(cpu_attention.attention(mx.array(q), ks, vs, 0.3, None))
    ref = cpu_attention_ref.attention(q, k[:, :, :200], v[:, :, :200], 0.3, None)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)


def test_fused_attention_batched_decode_padding():
    """A batched decode step: each row attends to its own sequence length (padding beyond it)."""
    _needs_fused_kernel()
    rng = np.random.default_rng(3)
    lengths = [40, 300, 129]
    B, L = len(lengths), max(lengths)
    q, k, v = _qkv(rng, B, 9, 3, 1, L, 64)
    mask = np.zeros((B, 1, 1, L), dtype=bool)
    for b, n in enumerate(lengths):
        mask[b, 0, 0, :n] = True
    got = np.array(cpu_attention.attention(mx.array(q), mx.array(k), mx.array(v), 0.125, mask))
    ref = cpu_attention_ref.attention(q, k, v, 0.125, mask)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)
    sdpa = np.array(mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.125,
                                                         mask=mx.array(mask)))
    np.testing.assert_allclose(got, sdpa, atol=2e-5, rtol=1e-4)


def test_irregular_mask_falls_back_to_numpy_path():
    """A mask whose allowed keys are not one range per row is not the fused kernel's: it declines,
    and cpu_ops.attention still gives the right answer through its numpy path."""
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 1, 4, 2, 64, 128, 64)
    mask = _causal(64, 64, 128).copy()
    mask[..., 10:20] = False  # a hole inside the allowed range
    assert cpu_attention.row_ranges(mask, 1, 64, 128) is None
    assert cpu_attention.attention(mx.array(q), mx.array(k), mx.array(v), 0.125, mask) is None
    got = np.array(cpu_ops.attention(mx.array(q), mx.array(k), mx.array(v), 0.125, mask))
    np.testing.assert_allclose(got, cpu_attention_ref.attention(q, k, v, 0.125, mask), atol=2e-5, rtol=1e-4)


def test_row_ranges_of_window_mask():
    mask = _causal(5, 3, 8, window=3)
    lo, hi = cpu_attention.row_ranges(mask, 1, 5, 8)
    for t in range(5):
        allowed = np.flatnonzero(mask[0, 0, t])
        assert (lo[0, t], hi[0, t]) == (allowed[0], allowed[-1] + 1)


# --- host prefill products (cpu_blas.matmul_t, activations, Linear / GatedMLP host path) -----------------

@pytest.mark.parametrize("pinned", [False, True], ids=["openblas-threads", "row-slices-on-pool"])
def test_matmul_t_matches_numpy(blas_workers, pinned, monkeypatch):
    if not cpu_blas.has_matmul():
        pytest.skip("no fast BLAS")
    monkeypatch.setattr(cpu_blas, "_OPENBLAS_PINNED", pinned)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3 * cpu_blas.SLICE_ROWS + 17, 200)).astype(np.float32)
    w = rng.standard_normal((150, 160)).astype(np.float32)
    xs = x[:, 20:180]  # strided rows: lda != k
    got = cpu_blas.matmul_t(xs, w)
    ref = xs.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)


def test_host_activations_in_place_match_numpy(blas_workers):
    rng = np.random.default_rng(2)
    g = (rng.standard_normal((300, 1000)) * 4).astype(np.float32)
    u = rng.standard_normal((300, 1000)).astype(np.float32)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    silu_ref = g64 / (1 + np.exp(-g64)) * u64
    gelu_ref = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3))) * u64
    np.testing.assert_allclose(cpu_ops.silu_mul_inplace(g.copy(), u), silu_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cpu_ops.gelu_tanh_mul_inplace(g.copy(), u), gelu_ref, rtol=1e-5, atol=1e-5)


def _q8_linear(rng, out_dim, in_dim):
    from gguf import GGMLQuantizationType, quants

    from hf2q.engine.layers import Linear
    from hf2q.formats.gguf_file import GGUFTensor

    w = rng.standard_normal((out_dim, in_dim)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0)
    t = GGUFTensor(name="w", qtype=GGMLQuantizationType.Q8_0, shape=(out_dim, in_dim), data=raw, nbytes=raw.nbytes)
    return Linear(t, mx.float32), quants.dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float64)


@pytest.mark.parametrize("budget_mb", ["0", "512"], ids=["dense-cache-off", "dense-cache-on"])
def test_linear_and_gated_mlp_host_prefill(budget_mb, monkeypatch):
    """The CPU prefill path (host sgemm over the dequantized weight, kept or not) against float64 numpy
    over gguf's own dequantization; a repeated call (cached weight) gives the same result."""
    if not cpu_blas.has_matmul():
        pytest.skip("no fast BLAS")
    from hf2q.engine import layers

    monkeypatch.setenv("HF2Q_DENSE_CACHE_MB", budget_mb)
    rng = np.random.default_rng(4)
    gate, wg = _q8_linear(rng, 96, 64)
    up, wu = _q8_linear(rng, 96, 64)
    down, wd = _q8_linear(rng, 64, 96)
    x = rng.standard_normal((1, 40, 64)).astype(np.float32)
    assert gate.on_host(40)
    ref = x[0].astype(np.float64) @ wg.T
    for _ in range(2):
        np.testing.assert_allclose(np.array(gate(mx.array(x)))[0], ref, rtol=1e-4, atol=1e-4)
    assert (gate._dense_kept is not None) == (budget_mb != "0")
    mlp = layers.GatedMLP(gate, up, down)
    g, u = x[0].astype(np.float64) @ wg.T, x[0].astype(np.float64) @ wu.T
    mlp_ref = (g / (1 + np.exp(-g)) * u) @ wd.T
    # float32 sums of terms ~|mlp_ref|.max(): absolute tolerance on that scale
    np.testing.assert_allclose(np.array(mlp(mx.array(x)))[0], mlp_ref, rtol=1e-4, atol=1e-5 * np.abs(mlp_ref).max())


def test_thread_count_follows_machine_load(monkeypatch):
    """Unset HF2Q_BLAS_THREADS: all usable cores on an idle machine, one when other work fills them."""
    monkeypatch.delenv("HF2Q_BLAS_THREADS", raising=False)
    monkeypatch.setattr(cpu_blas, "threads", lambda: 4)
    monkeypatch.setattr(cpu_blas, "_OTHERS", [0.0])
    monkeypatch.setattr(cpu_blas, "_ACTIVE", [1, float("-inf")])
    monkeypatch.setattr(cpu_blas, "ACTIVE_TTL_S", 60.0)  # within the TTL the load is not read again
    monkeypatch.setattr(cpu_blas, "_other_runnable", lambda: 0)
    assert cpu_blas.active_threads() == 4
    monkeypatch.setattr(cpu_blas, "_other_runnable", lambda: 6)
    assert cpu_blas.active_threads() == 4
    monkeypatch.setattr(cpu_blas, "ACTIVE_TTL_S", 0.0)
    monkeypatch.setattr(cpu_blas, "_other_runnable", lambda: 6)
    counts = [cpu_blas.active_threads() for _ in range(20)]
    assert counts[-1] == 1 and counts == sorted(counts, reverse=True)
    monkeypatch.setenv("HF2Q_BLAS_THREADS", "4")  # an explicit count is kept whatever the load
    assert cpu_blas.active_threads() == 4


def test_openblas_thread_count_is_restored_after_a_worker_lowered_it():
    """Another thread's ``openblas_set_num_threads_local(1)`` lowers OpenBLAS's count for every thread in the
    OpenBLAS we load; ``use_openblas_threads`` must ask OpenBLAS, not remember, or every later prefill
    product runs on one thread (pp2048 490 vs 761 tok/s measured)."""
    import threading

    from hf2q.kernels import cpu_blas

    if cpu_blas._LIB is None or cpu_blas._openblas_threads_now() is None or cpu_blas._OPENBLAS_PINNED:
        pytest.skip("needs the loaded OpenBLAS")
    lower = getattr(cpu_blas._LIB, "openblas_set_num_threads_local", None) or cpu_blas._LIB.openblas_set_num_threads
    try:
        cpu_blas.use_openblas_threads(2)
        t = threading.Thread(target=lower, args=(1,))
        t.start()
        t.join()
        cpu_blas.use_openblas_threads(2)
        assert cpu_blas._openblas_threads_now() == 2
    finally:
        cpu_blas.use_openblas_threads(cpu_blas.threads())  # the count every graph product finds
