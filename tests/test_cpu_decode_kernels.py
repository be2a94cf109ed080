"""The CPU decode kernels and the host decode step.

* the quantized matvec (every width, batch 1..9, odd row counts and group counts) against the
  numpy reference of what it computes and against MLX's own ``quantized_matmul``, on every
  vector ISA the machine can build (AVX-512, AVX2, portable C);
* the per-layer decode ops (norms, RoPE, attention over KV buffers, gated activations)
  against their numpy reference;
* the whole host decode step against the MLX graph with MLX's quantized matmuls (no hf2q
  kernel on that side), token for token on tiny quantized models of each family and on SmolLM2;
  batched host decode against single decodes; a short prefill as rows of the host step
  against the MLX graph's prefill (logits, cache, continuation).
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from hf2q.kernels import cpu_decode_ops_ref as ops_ref
from hf2q.kernels import cpu_pool, cpu_qmatvec, cpu_qmatvec_ref
from hf2q.kernels.cpu_build import KernelBuildError
from tests.engine_support import load_runner, random_tokens

pytestmark = pytest.mark.skipif(cpu_qmatvec.kernel() is None, reason="no C compiler")


def _quantized(rows: int, n: int, bits: int, seed: int):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((rows, n)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=32, bits=bits)
    mx.eval(wq, s, b)
    return wq, s, b, np.asarray(memoryview(wq)).view(np.uint8).reshape(rows, -1), np.asarray(memoryview(s)), \
        np.asarray(memoryview(b))


def _mlx_reference(x, wq, s, b, bits):
    return np.array(mx.quantized_matmul(mx.array(x), wq, s, b, transpose=True, group_size=32, bits=bits))


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def isa_kernel(request):
    """The matvec library built for one vector ISA (skipped when this CPU cannot run it)."""
    if request.param == "native":
        yield cpu_qmatvec.kernel()
        return
    mp = pytest.MonkeyPatch()
    mp.setenv("HF2Q_NO_AVX512", "1")
    if request.param == "portable":
        mp.setenv("HF2Q_NO_AVX2", "1")
    try:
        lib = cpu_qmatvec.LIBRARY.build()
        cpu_pool.attach(lib)
    except KernelBuildError:
        lib = None
    mp.undo()
    want = {"avx2": 256, "portable": 0}[request.param]
    if lib is None or lib.simd_width() != want:
        pytest.skip(f"{request.param} build not available here")
    with cpu_qmatvec.LIBRARY.replaced(lib):
        yield lib


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_qmatvec_matches_reference_and_mlx(bits, isa_kernel):
    # rows: below / at / across the 4-row tiles; n: odd group counts (3 groups) and SmolLM2's width
    for rows, n in [(1, 32), (7, 96), (37, 576), (130, 160)]:
        wq, s, b, packed, sc, bi = _quantized(rows, n, bits, seed=rows * 10 + bits)
        for batch in range(1, 10):
            x = np.random.default_rng(batch).standard_normal((batch, n)).astype(np.float32)
            got = cpu_qmatvec.qmatvec(packed, sc, bi, x, bits)
            exact = cpu_qmatvec_ref.qmatvec(packed, sc, bi, x, bits)
            scale = np.abs(exact).max() + 1.0
            assert got.shape == (batch, rows) and got.dtype == np.float32
            np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6 * scale * np.sqrt(n))
            np.testing.assert_allclose(got, _mlx_reference(x, wq, s, b, bits), rtol=1e-4, atol=2e-4)


def test_a_row_does_not_depend_on_its_batch(isa_kernel):
    """A batch row's result is the same bits alone or in any batch (across the 4-row batch tiles and the
    row tiles of every ISA), so greedy output never depends on how many sequences share a step."""
    for bits in (4, 8):
        _, _, _, packed, sc, bi = _quantized(37, 576, bits, seed=bits)
        x = np.random.default_rng(3).standard_normal((13, 576)).astype(np.float32)
        alone = np.concatenate([cpu_qmatvec.qmatvec(packed, sc, bi, x[i:i + 1], bits) for i in range(13)])
        for batch in (2, 4, 5, 6, 11, 13):
            np.testing.assert_array_equal(cpu_qmatvec.qmatvec(packed, sc, bi, x[:batch], bits), alone[:batch])


@pytest.mark.parametrize("bits", [3, 5, 6])
def test_odd_widths_as_unpacked_bytes(bits):
    """Linear hands 3/5/6-bit weights to the kernel as one byte per weight (bits=8)."""
    from hf2q.engine.quant_repack import unpack_bits

    wq, s, b, packed, sc, bi = _quantized(45, 192, bits, seed=bits)
    x = np.random.default_rng(0).standard_normal((5, 192)).astype(np.float32)
    got = cpu_qmatvec.qmatvec(unpack_bits(packed.view(np.uint32), bits, 192), sc, bi, x, 8)
    np.testing.assert_allclose(got, _mlx_reference(x, wq, s, b, bits), rtol=1e-4, atol=2e-4)


def test_reference_unpack_matches_mlx_dequantize():
    for bits in (2, 3, 4, 5, 6, 8):
        wq, s, b, packed, sc, bi = _quantized(9, 64, bits, seed=bits)
        ours = cpu_qmatvec_ref.dequantize(packed, sc, bi, bits)
        theirs = np.array(mx.dequantize(wq, s, b, group_size=32, bits=bits))
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


def test_group_of_matrices_equals_separate_calls():
    mats = [_quantized(r, 96, bits, seed=r)[3:] + (bits,) for r, bits in [(13, 4), (6, 8), (9, 5), (32, 4)]]
    group = cpu_qmatvec.QMatrixGroup(mats)
    for batch in (1, 4, 6):
        x = np.random.default_rng(batch).standard_normal((batch, 96)).astype(np.float32)
        alone = np.concatenate([cpu_qmatvec.qmatvec(*m[:3], x, m[3]) for m in mats], axis=1)
        np.testing.assert_array_equal(group(x), alone)
    with pytest.raises(ValueError):
        group(np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError):
        cpu_qmatvec.QMatrixGroup([mats[0], _quantized(4, 64, 4, 0)[3:] + (4,)])


def test_input_alignment_does_not_change_results():
    """The kernel copies x to a cache-line-aligned buffer when it is not one; every offset gives the
    same bits as the aligned input, for 4-bit (reordered copy) and 8-bit (plain copy) rows alike."""
    mats = [_quantized(40, 576, bits, seed=bits)[3:] + (bits,) for bits in (4, 8)]
    group = cpu_qmatvec.QMatrixGroup(mats)
    batch, n = 3, 576
    x = np.random.default_rng(7).standard_normal((batch, n)).astype(np.float32)
    raw = np.zeros(batch * n + 64, dtype=np.float32)
    base = (-raw.ctypes.data % 64) // 4  # the float offset at which raw is 64-byte aligned
    want = None
    for shift in (0, 1, 3, 8):
        view = raw[base + shift:base + shift + batch * n].reshape(batch, n)
        view[...] = x
        assert (view.ctypes.data % 64 == 0) == (shift == 0)
        y = np.empty((batch, group.rows), dtype=np.float32)
        group.run(view.ctypes.data, y.ctypes.data, batch)
        if want is None:
            want = y
            exact = np.concatenate([cpu_qmatvec_ref.qmatvec(*m[:3], x, m[3]) for m in mats], axis=1)
            np.testing.assert_allclose(y, exact, rtol=0, atol=2e-6 * (np.abs(exact).max() + 1) * np.sqrt(n))
        np.testing.assert_array_equal(y, want)


# ---------------------------------------------------------------------------- per-layer ops

def _ops():
    from hf2q.kernels.cpu_decode_ops import library

    lib = library()
    assert lib is not None
    return lib


def _p(a: np.ndarray) -> int:
    return a.ctypes.data


def test_rms_norm_op_per_row_and_per_head():
    ops, rng = _ops(), np.random.default_rng(0)
    x = rng.standard_normal((3, 5 * 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    out = np.empty_like(x)
    ops.rms_norm(_p(x), 80, _p(w), _p(out), 80, 3, 5, 16, 1e-6)  # 5 heads of 16 per row
    ref = ops_ref.rms_norm(x.reshape(3, 5, 16), w, 1e-6).reshape(3, 80)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    w80 = rng.standard_normal(80).astype(np.float32)
    ref = ops_ref.rms_norm(x, w80, 1e-5)
    ops.rms_norm(_p(x), 80, _p(w80), _p(x), 80, 3, 1, 80, 1e-5)  # in place, one vector per row
    np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("traditional", [True, False])
def test_rope_op(traditional):
    ops, rng = _ops(), np.random.default_rng(1)
    B, heads, D, d, stride = 2, 3, 32, 24, 3 * 32 + 8  # partial rotary dims, padded rows
    buf = rng.standard_normal((B, stride)).astype(np.float32)
    ang = rng.uniform(0, 50, (B, d // 2))
    table = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    x = buf[:, : heads * D].reshape(B, heads, D).copy()
    tail = buf[:, heads * D:].copy()
    ops.rope(_p(buf), stride, _p(table), B, heads, D, d, int(traditional))
    ref = ops_ref.rope(x, table[:, : d // 2], table[:, d // 2:], traditional)
    np.testing.assert_allclose(buf[:, : heads * D].reshape(B, heads, D), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(buf[:, heads * D:], tail)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("D", [24, 16, 64, 128])  # the generic loops, and each vector path
def test_attend_op_writes_kv_and_attends(window, D):
    ops, rng = _ops(), np.random.default_rng(2)
    B, H, Hkv, cap = 3, 6, 2, 40
    pos = [0, 7, 34]
    K = [rng.standard_normal((Hkv, cap, D)).astype(np.float32) for _ in range(B)]
    V = [rng.standard_normal((Hkv, cap, D)).astype(np.float32) for _ in range(B)]
    qkv = rng.standard_normal((B, (H + 2 * Hkv) * D)).astype(np.float32)
    out = np.empty((B, H * D), np.float32)
    kp = (ctypes.c_void_p * B)(*[_p(k) for k in K])
    vp = (ctypes.c_void_p * B)(*[_p(v) for v in V])
    rc = ops.attend_layer(_p(qkv), qkv.shape[1], kp, vp, (ctypes.c_int * B)(*[cap] * B), (ctypes.c_int * B)(*[0] * B),
                          (ctypes.c_int * B)(*pos), window, _p(out), B, H, Hkv, D, 1, 1, 0.3)
    assert rc == 0
    for b in range(B):  # the new k, v landed at pos[b]
        np.testing.assert_array_equal(K[b][:, pos[b]], qkv[b, H * D:(H + Hkv) * D].reshape(Hkv, D))
        np.testing.assert_array_equal(V[b][:, pos[b]], qkv[b, (H + Hkv) * D:].reshape(Hkv, D))
    ref = ops_ref.attend(qkv[:, : H * D].reshape(B, H, D), K, V, pos, window, 0.3)
    np.testing.assert_allclose(out.reshape(B, H, D), ref, rtol=1e-5, atol=1e-5)


def _attend(ops, qkv, K, V, cap, pos, window, H, Hkv, D, scale):
    B = len(pos)
    out = np.empty((B, H * D), np.float32)
    rc = ops.attend_layer(_p(qkv), qkv.shape[1], (ctypes.c_void_p * B)(*[_p(k) for k in K]),
                          (ctypes.c_void_p * B)(*[_p(v) for v in V]), (ctypes.c_int * B)(*[cap] * B),
                          (ctypes.c_int * B)(*[0] * B), (ctypes.c_int * B)(*pos), window, _p(out), B, H, Hkv, D, 1, 1,
                          scale)
    assert rc == 0
    return out


@pytest.mark.parametrize("window", [0, 700])
def test_attend_op_long_sequences_in_chunks(window):
    """Thousands of positions: the attention is cut into chunks whose softmax parts are combined."""
    ops, rng = _ops(), np.random.default_rng(4)
    B, H, Hkv, D, cap = 3, 6, 2, 64, 2600
    pos = [2599, 33, 1300]
    K = [rng.standard_normal((Hkv, cap, D)).astype(np.float32) for _ in range(B)]
    V = [rng.standard_normal((Hkv, cap, D)).astype(np.float32) for _ in range(B)]
    qkv = (rng.standard_normal((B, (H + 2 * Hkv) * D)) * 2).astype(np.float32)
    out = _attend(ops, qkv, K, V, cap, pos, window, H, Hkv, D, 0.125)
    ref = ops_ref.attend(qkv[:, : H * D].reshape(B, H, D), K, V, pos, window, 0.125)
    np.testing.assert_allclose(out.reshape(B, H, D), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [0, 6])
def test_attend_op_rows_of_one_sequence_are_causal(window):
    """Rows sharing one cache at consecutive positions (a prefill chunk): each row sees the K/V
    the earlier rows of the same call wrote, and none of the later ones."""
    ops, rng = _ops(), np.random.default_rng(5)
    T, start, H, Hkv, D, cap = 9, 5, 4, 2, 32, 32
    K, V = rng.standard_normal((Hkv, cap, D)).astype(np.float32), rng.standard_normal((Hkv, cap, D)).astype(np.float32)
    qkv = rng.standard_normal((T, (H + 2 * Hkv) * D)).astype(np.float32)
    pos = [start + i for i in range(T)]
    later = K[:, start + T:].copy()
    out = _attend(ops, qkv, [K] * T, [V] * T, cap, pos, window, H, Hkv, D, 0.2)
    np.testing.assert_array_equal(K[:, start:start + T], qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D).transpose(1, 0, 2))
    np.testing.assert_array_equal(K[:, start + T:], later)
    ref = ops_ref.attend(qkv[:, : H * D].reshape(T, H, D), [K] * T, [V] * T, pos, window, 0.2)
    np.testing.assert_allclose(out.reshape(T, H, D), ref, rtol=1e-5, atol=1e-5)


def _pieces(K: np.ndarray, m: int, heads: int, first: int, cap: int) -> np.ndarray:
    """Logical ``[Hkv, positions, D]`` keys as a Gemma 4 cache buffer: each head cut into ``m`` cache heads of
    ``D / m``, padded to ``heads`` cache heads, rows ``[first, first + cap)`` (garbage where no position is)."""
    Hkv, _, D = K.shape
    buf = np.full((heads, cap, D // m), np.nan, np.float32)
    rows = K[:, first:first + cap]
    buf[:Hkv * m, :rows.shape[1]] = rows.reshape(Hkv, rows.shape[1], m, D // m).transpose(0, 2, 1, 3).reshape(
        Hkv * m, rows.shape[1], D // m)
    return buf


@pytest.mark.parametrize("window,write", [(0, 1), (6, 1), (6, 0), (0, 0)])
@pytest.mark.parametrize("D,m", [(128, 2), (64, 1), (96, 3)])
def test_attend_layer_op_over_pieces_and_window_buffers(window, write, D, m):
    """Gemma 4's cache: each KV head stored as ``m`` cache heads, a window layer's buffer starting at its
    ``base`` position; ``write=0`` (a KV-shared layer) attends over the rows without storing any."""
    ops, rng = _ops(), np.random.default_rng(9)
    B, H, Hkv, heads, total = 3, 4, 2, 7, 60
    pos = [6, 23, 59]
    base = [0, 18, 50] if window else [0, 0, 0]
    cap = [40, 16, 12] if window else [total] * B
    K = [rng.standard_normal((Hkv, total, D)).astype(np.float32) for _ in range(B)]
    V = [rng.standard_normal((Hkv, total, D)).astype(np.float32) for _ in range(B)]
    qkv = rng.standard_normal((B, (H + 2 * Hkv) * D)).astype(np.float32)
    if write:  # the new rows are the call's: the logical keys hold them where the buffers get them
        for b in range(B):
            K[b][:, pos[b]] = qkv[b, H * D:(H + Hkv) * D].reshape(Hkv, D)
            V[b][:, pos[b]] = qkv[b, (H + Hkv) * D:].reshape(Hkv, D)
    kb = [_pieces(np.where(np.arange(total)[None, :, None] == pos[b], 0, K[b]) if write else K[b], m, heads,
                  base[b], cap[b]) for b in range(B)]
    vb = [_pieces(np.where(np.arange(total)[None, :, None] == pos[b], 0, V[b]) if write else V[b], m, heads,
                  base[b], cap[b]) for b in range(B)]
    out = np.empty((B, H * D), np.float32)
    arr = lambda v: (ctypes.c_int * B)(*v)  # noqa: E731
    rc = ops.attend_layer(_p(qkv), qkv.shape[1], (ctypes.c_void_p * B)(*[_p(k) for k in kb]),
                          (ctypes.c_void_p * B)(*[_p(v) for v in vb]), arr(cap), arr(base), arr(pos), window, _p(out),
                          B, H, Hkv, D, m, write, 1.0)
    assert rc == 0
    for b in range(B):  # what the buffer holds now is the logical cache's rows (the new row stored iff write)
        np.testing.assert_array_equal(kb[b][:Hkv * m, pos[b] - base[b]],
                                      _pieces(K[b], m, Hkv * m, base[b], cap[b])[:, pos[b] - base[b]])
    ref = ops_ref.attend(qkv[:, : H * D].reshape(B, H, D), K, V, pos, window, 1.0)
    np.testing.assert_allclose(out.reshape(B, H, D), ref, rtol=1e-5, atol=1e-5)


def test_attend_layer_op_refuses_a_window_the_buffer_no_longer_holds():
    """A position the row's window needs before its buffer's first one: refused, nothing written."""
    from hf2q.kernels.cpu_build import KernelDimsError

    ops, rng = _ops(), np.random.default_rng(1)
    H, Hkv, D, cap = 2, 1, 32, 16
    K, V = np.zeros((Hkv, cap, D), np.float32), np.zeros((Hkv, cap, D), np.float32)
    qkv = rng.standard_normal((1, (H + 2 * Hkv) * D)).astype(np.float32)
    out = np.empty((1, H * D), np.float32)
    one = lambda v: (ctypes.c_int * 1)(v)  # noqa: E731
    for base, pos, window in ((8, 12, 6), (8, 12, 0), (0, 16, 0)):  # window from 7 < 8; the whole past; past cap
        with pytest.raises(KernelDimsError):
            ops.attend_layer(_p(qkv), qkv.shape[1], (ctypes.c_void_p * 1)(_p(K)), (ctypes.c_void_p * 1)(_p(V)),
                             one(cap), one(base), one(pos), window, _p(out), 1, H, Hkv, D, 1, 1, 1.0)
    assert not K.any() and not V.any()


@pytest.mark.parametrize("kind", [0, 1])
def test_glu_op(kind):
    ops, rng = _ops(), np.random.default_rng(3)
    B, F = 3, 100
    gu = (rng.standard_normal((B, 2 * F)) * 4).astype(np.float32)
    out = np.empty((B, F), np.float32)
    ops.glu(_p(gu), _p(out), B, F, kind)
    np.testing.assert_allclose(out, ops_ref.glu(gu[:, :F], gu[:, F:], kind), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- the host decode step

@contextmanager
def _mlx_graph_only(runner):
    """Decode through the MLX graph with MLX's own quantized matmuls (no hf2q kernel)."""
    m = runner.model
    lins = [m.embed, m.lm_head] + [lin for layer in m.layers for lin in (
        layer.attn.q, layer.attn.k, layer.attn.v, layer.attn.o, layer.ffn.gate, layer.ffn.up, layer.ffn.down)]
    saved = [(lin, lin._host) for lin in lins]
    host = runner.host_decoder
    runner.host_decoder = None
    for lin in lins:
        lin._host = None
    try:
        yield
    finally:
        runner.host_decoder = host
        for lin, h in saved:
            lin._host = h


@pytest.fixture(scope="module")
def quantized_runners(tiny_checkpoint, tmp_path_factory):
    from hf2q.cli import main

    out = {}
    for family, quant in [("llama", "q4_0"), ("llama", "q8_0"), ("qwen3", "q5_0"), ("gemma3", "q4_0")]:
        src = tiny_checkpoint(family)
        path = tmp_path_factory.mktemp(f"{family}-{quant}") / "m.gguf"
        assert main(["convert", str(src), "-q", quant, "-o", str(path), "--no-integrity"]) == 0
        out[(family, quant)] = load_runner(path, src)
    return out


def _twin_prefills(r, prompts):
    """Two sets of caches holding the same prompts, and the greedy first tokens."""
    a, b = [r.new_sequence() for _ in prompts], [r.new_sequence() for _ in prompts]
    toks = [int(np.argmax(r.prefill(s, p))) for s, p in zip(a, prompts)]
    for s, p in zip(b, prompts):
        r.prefill(s, p)
    return a, b, toks


@pytest.mark.parametrize("key", [("llama", "q4_0"), ("llama", "q8_0"), ("qwen3", "q5_0"), ("gemma3", "q4_0")])
def test_host_decode_equals_mlx_graph_token_for_token(key, quantized_runners):
    r = quantized_runners[key]
    assert r.host_decoder is not None
    # 21 tokens: beyond gemma3's 16-token window
    host_seqs, mlx_seqs, toks = _twin_prefills(r, [random_tokens(n, seed=200 + n) for n in (4, 21, 9)])
    for _ in range(10):
        host = r.decode(host_seqs, toks)
        with _mlx_graph_only(r):
            ref = r.decode(mlx_seqs, toks)
        np.testing.assert_allclose(host, ref, rtol=0, atol=1e-4 * max(1.0, float(np.abs(ref).max())))
        assert list(np.argmax(host, -1)) == list(np.argmax(ref, -1))
        toks = [int(t) for t in np.argmax(ref, -1)]


def test_host_embedding_rows_match_mlx(quantized_runners):
    from hf2q.engine.cpu_decode import HostEmbedding

    ids = np.array([0, 7, 511, 3, 7])
    for r in quantized_runners.values():
        emb = r.model.embed
        out = np.empty((len(ids), emb.shape[1]), np.float32)
        HostEmbedding(emb)(ids, out)
        ref = np.array(emb.rows(mx.array(ids.astype(np.int32))))
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_batched_host_decode_equals_single_decodes(quantized_runners):
    r = quantized_runners[("gemma3", "q4_0")]
    # 5 rows: a 4-tile and a tail
    batch, alone, toks = _twin_prefills(r, [random_tokens(n, seed=300 + n) for n in (2, 5, 17, 8, 30)])
    for _ in range(6):
        together = r.decode(batch, toks)
        single = np.stack([r.decode([s], [t])[0] for s, t in zip(alone, toks)])
        np.testing.assert_allclose(together, single, rtol=0, atol=1e-5 * max(1.0, float(np.abs(single).max())))
        toks = [int(t) for t in np.argmax(single, -1)]
        assert list(np.argmax(together, -1)) == toks


@pytest.mark.parametrize("key", [("llama", "q4_0"), ("qwen3", "q5_0"), ("gemma3", "q4_0")])
def test_host_prefill_rows_equal_mlx_graph_prefill(key, quantized_runners):
    """A short chunk prefilled as rows of the host step (``HostDecoder.prefill``, what the runner
    uses up to ``HOST_PREFILL_ROWS``) leaves the same cache and logits as the MLX graph: first
    chunk and a continuation, beyond gemma3's 16-token sliding window."""
    r = quantized_runners[key]
    first, more = random_tokens(11, seed=400), random_tokens(19, seed=401)
    host, ref = r.new_sequence(), r.new_sequence()
    for chunk in (first, more):
        got = r.host_decoder.prefill(host, np.asarray(chunk))
        with _mlx_graph_only(r):
            want = r.prefill(ref, chunk)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))
        assert int(np.argmax(got)) == int(np.argmax(want))
    assert host.length == ref.length == len(first) + len(more)
    for li in range(host.n_layers):
        n = host.length
        np.testing.assert_allclose(np.array(host.keys[li][:, :n]), np.array(ref.keys[li][:, :n]), atol=1e-4)
        np.testing.assert_allclose(np.array(host.values[li][:, :n]), np.array(ref.values[li][:, :n]), atol=1e-4)
    toks_h, toks_r = [int(np.argmax(got))], [int(np.argmax(want))]
    for _ in range(8):  # and the greedy continuation matches
        toks_h.append(int(np.argmax(r.decode([host], [toks_h[-1]])[0])))
        with _mlx_graph_only(r):
            toks_r.append(int(np.argmax(r.decode([ref], [toks_r[-1]])[0])))
    assert toks_h == toks_r


def test_host_prefill_rows_across_a_cache_growth(quantized_runners):
    """Rows that carry a cache past its capacity (256 positions: the buffers are replaced) land in
    the new buffers, as the MLX graph's prefill does."""
    r = quantized_runners[("qwen3", "q5_0")]
    prompt, more = random_tokens(250, seed=402), random_tokens(20, seed=403)
    host, ref = r.new_sequence(), r.new_sequence()
    with _mlx_graph_only(r):
        r.prefill(host, prompt)
        r.prefill(ref, prompt)
        want = r.prefill(ref, more)
    got = r.host_decoder.prefill(host, np.asarray(more))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))
    n = host.length
    for li in range(host.n_layers):
        np.testing.assert_allclose(np.array(host.keys[li][:, :n]), np.array(ref.keys[li][:, :n]), atol=1e-4)


@pytest.mark.parametrize("key", [("llama", "q4_0"), ("gemma3", "q4_0")])
def test_mixed_step_as_one_pass_equals_decode_then_prefill(key, quantized_runners):
    """``decode_with_prefill`` (prefill rows and decode rows in one host pass) leaves the same
    logits and caches as ``decode`` then ``prefill`` apart: bit for bit, since every row's
    matvec tiles, norms and attention are its own. gemma3: past its 16-token window."""
    r = quantized_runners[key]
    prompts = [random_tokens(n, seed=500 + n) for n in (3, 18, 7)]
    fused, apart, toks = _twin_prefills(r, prompts)
    new_f, new_a = r.new_sequence(), r.new_sequence()
    chunks = [random_tokens(n, seed=600 + n) for n in (13, 1, 6)]
    for chunk in chunks:
        dec_f, pre_f = r.decode_with_prefill(fused, toks, new_f, chunk)
        dec_a = r.decode(apart, toks)
        pre_a = r.prefill(new_a, chunk)
        np.testing.assert_array_equal(dec_f, dec_a)
        np.testing.assert_array_equal(pre_f, pre_a)
        toks = [int(t) for t in np.argmax(dec_a, -1)]
    assert new_f.length == new_a.length == sum(map(len, chunks))
    for got, want in zip(fused + [new_f], apart + [new_a]):
        assert got.length == want.length
        for li in range(got.n_layers):
            n = got.length
            np.testing.assert_array_equal(np.array(got.keys[li][:, :n]), np.array(want.keys[li][:, :n]))
            np.testing.assert_array_equal(np.array(got.values[li][:, :n]), np.array(want.values[li][:, :n]))
    with pytest.raises(ValueError):
        r.decode_with_prefill(fused, toks, fused[0], chunks[0])


def test_mixed_step_over_the_host_row_limit_runs_apart(quantized_runners, monkeypatch):
    """A chunk longer than the host rows' limit keeps the MLX graph's prefill beside the decode."""
    from hf2q.engine import runner as runner_mod

    r = quantized_runners[("llama", "q8_0")]
    monkeypatch.setattr(runner_mod, "HOST_PREFILL_ROWS", 8)
    fused_calls = []
    real = r.host_decoder.step_with_prefill
    monkeypatch.setattr(r.host_decoder, "step_with_prefill",
                        lambda *a: fused_calls.append(len(a[3])) or real(*a))
    (d,), _, (tok,) = _twin_prefills(r, [random_tokens(5, seed=7)])
    s = r.new_sequence()
    r.decode_with_prefill([d], [tok], s, random_tokens(8, seed=1))
    r.decode_with_prefill([d], [tok], s, random_tokens(9, seed=2))
    assert fused_calls == [8] and s.length == 17 and d.length == 7


def test_runner_prefill_takes_the_host_rows_up_to_the_limit(quantized_runners, monkeypatch):
    from hf2q.engine import runner as runner_mod

    r = quantized_runners[("llama", "q8_0")]
    calls = []
    real = r.host_decoder.prefill
    monkeypatch.setattr(r.host_decoder, "prefill", lambda seq, toks: calls.append(len(toks)) or real(seq, toks))
    monkeypatch.setattr(runner_mod, "HOST_PREFILL_ROWS", 8)
    s = r.new_sequence()
    r.prefill(s, random_tokens(8, seed=1))
    r.prefill(s, random_tokens(9, seed=2))  # over the limit: the MLX graph
    assert calls == [8] and s.length == 17


@pytest.mark.slow
def test_smollm2_host_decode_equals_mlx_graph(smollm2_gguf):
    from hf2q.engine.runner import MlxModelRunner

    r = MlxModelRunner.load(smollm2_gguf)
    assert r.host_decoder is not None
    prompt = random_tokens(12, low=100, high=20000, seed=7)
    a, b = r.new_sequence(), r.new_sequence()
    host_toks = [int(np.argmax(r.prefill(a, prompt)))]
    mlx_toks = [int(np.argmax(r.prefill(b, prompt)))]
    for _ in range(24):
        host_toks.append(int(np.argmax(r.decode([a], [host_toks[-1]])[0])))
        with _mlx_graph_only(r):
            mlx_toks.append(int(np.argmax(r.decode([b], [mlx_toks[-1]])[0])))
    assert host_toks == mlx_toks
