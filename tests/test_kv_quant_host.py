"""The CPU host decode step over an 8-bit KV cache (``kernels/csrc/cpu_decode_ops.c``: ``attend_q8``): the
kernel against the numpy twin (``kv_quant_ref``: the codes it writes and the attention it computes), and the
host step of a q8 / q8-rotated runner against the MLX graph on the same cache, token for token."""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from hf2q.engine import kv_quant_ref as ref
from tests.engine_support import random_tokens, tiny_runner


@pytest.fixture(scope="module")
def ops():
    from hf2q.engine.factory import prepare_mlx
    from hf2q.kernels.cpu_decode_ops import library

    prepare_mlx()
    lib = library()
    if lib is None:
        pytest.skip("the host kernels are not built on this machine")
    return lib


@pytest.mark.parametrize("D,window", [(64, 0), (128, 5), (32, 0)])
def test_attend_q8_writes_the_codes_and_attends_as_the_numpy_twin(ops, D, window):
    """Three rows (two of one cache, as a prefill chunk's positions) of 6 query heads over 2 KV heads: the new
    rows' codes and scales are the twin's (a rounding tie may fall either way), and the output is the twin's
    attention over the stored rows — the earlier positions as the cache held them, the new ones as written."""
    rng = np.random.default_rng(D)
    H, Hkv, cap = 6, 2, 40
    G = min(64, D)
    pos = np.array([17, 18, 9], dtype=np.int32)
    caches = []  # two caches, their earlier positions encoded by the twin (the new ones the kernel writes)
    for _ in range(2):
        rows = rng.normal(size=(Hkv, cap, D)).astype(np.float32) * 3
        rows[:, :, 7] *= 20  # an outlier channel
        codes, scales = ref.encode(rows)
        caches.append([np.ascontiguousarray(codes), np.ascontiguousarray(scales.astype(np.float32)),
                       np.ascontiguousarray(ref.encode(rows[::-1])[0]),
                       np.ascontiguousarray(ref.encode(rows[::-1])[1].astype(np.float32))])
    owner = [0, 0, 1]
    qkv = rng.normal(size=(3, (H + 2 * Hkv) * D)).astype(np.float32)
    before = [[a.copy() for a in c] for c in caches]
    ptrs = [np.array([caches[o][p].ctypes.data for o in owner], dtype=np.uint64) for p in range(4)]
    out = np.zeros((3, H * D), dtype=np.float32)
    capv = np.full(3, cap, dtype=np.int32)
    ops.attend_q8(qkv.ctypes.data, qkv.shape[1], *[p.ctypes.data for p in ptrs], capv.ctypes.data, pos.ctypes.data,
                  window, out.ctypes.data, 3, H, Hkv, D, G, D ** -0.5)
    for b, (o, t) in enumerate(zip(owner, pos)):
        k = qkv[b, H * D:(H + Hkv) * D].reshape(Hkv, D)
        v = qkv[b, (H + Hkv) * D:].reshape(Hkv, D)
        for plane, new in ((0, k), (2, v)):
            codes, scales = ref.encode(new)
            got = caches[o][plane][:, t].astype(int)
            assert np.abs(got - codes.astype(int)).max() <= 1 and (got != codes).mean() < 0.02
            np.testing.assert_allclose(caches[o][plane + 1][:, t], scales, rtol=1e-6)
    for o, c in enumerate(caches):  # nothing else was written
        written = {int(t) for t, w in zip(pos, owner) if w == o}
        for a, was in zip(c, before[o]):
            keep = [p for p in range(cap) if p not in written]
            np.testing.assert_array_equal(a[:, keep], was[:, keep])
    for b, (o, t) in enumerate(zip(owner, pos)):
        keys = ref.decode(caches[o][0], caches[o][1])[:, :t + 1]  # the rows as stored, in float64
        values = ref.decode(caches[o][2], caches[o][3])[:, :t + 1]
        q = qkv[b, :H * D].reshape(H, D).astype(np.float64) * D ** -0.5
        rep = H // Hkv
        s = np.einsum("hd,htd->ht", q, np.repeat(keys, rep, axis=0))
        lo = max(0, t + 1 - window) if window else 0
        s[:, :lo] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = np.einsum("ht,htd->hd", p, np.repeat(values, rep, axis=0))
        np.testing.assert_allclose(out[b].reshape(H, D), want, atol=2e-5 * np.abs(want).max(), rtol=0)


def test_attend_q8_refuses_impossible_dims(ops):
    from hf2q.kernels.cpu_build import KernelDimsError

    buf = np.zeros(4096, dtype=np.float32)
    ptr = np.array([buf.ctypes.data], dtype=np.uint64)
    one = np.array([8], dtype=np.int32)
    zero = np.array([0], dtype=np.int32)
    with pytest.raises(KernelDimsError):  # a group that does not divide the head
        ops.attend_q8(buf.ctypes.data, 3 * 64, *[ptr.ctypes.data] * 4, one.ctypes.data, zero.ctypes.data, 0,
                      buf.ctypes.data, 1, 1, 1, 64, 48, 1.0)
    with pytest.raises(KernelDimsError):  # a position past the cache's capacity
        ops.attend_q8(buf.ctypes.data, 3 * 64, *[ptr.ctypes.data] * 4, one.ctypes.data, one.ctypes.data, 0,
                      buf.ctypes.data, 1, 1, 1, 64, 64, 1.0)


@pytest.mark.parametrize("family,kind", [("qwen3", "q8-rotated"), ("gemma3", "q8")])
def test_host_step_on_q8_equals_the_mlx_graph(tiny_checkpoint, tmp_path_factory, family, kind):
    """Two sequences (5 and 300 tokens) prefilled, then 8 batched greedy steps: the runner's host step over
    the 8-bit planes gives the MLX graph's logits (``quantized_matmul`` over the same cache) to float32
    rounding, and the same tokens."""
    from hf2q.engine.runner import MlxModelRunner

    f16 = tiny_runner(tiny_checkpoint, tmp_path_factory, family)
    runs = []
    for host in (True, False):
        r = MlxModelRunner(f16.gguf, f16.model, f16.dtype, None, kind)
        assert r.host_decoder is not None and r.host_decoder.codec is r.kv_codec
        if not host:
            r.host_decoder = None
        seqs = [r.new_sequence() for _ in range(2)]
        toks = [int(np.argmax(r.prefill(s, random_tokens(n, seed=n)))) for s, n in zip(seqs, (5, 300))]
        rows = []
        for _ in range(8):
            rows.append(r.decode(seqs, toks))
            toks = [int(t) for t in rows[-1].argmax(-1)]
        runs.append(np.stack(rows))
    host, graph = runs
    np.testing.assert_allclose(host, graph, atol=2e-5 * np.abs(graph).max(), rtol=0)
    assert (host.argmax(-1) == graph.argmax(-1)).all()
