"""Fused (flash-style) grouped-query attention for the CPU backend.

The host attention it replaces materialised the whole ``[heads, T, L]`` float32 score
matrix, copied it between MLX and numpy and softmaxed it in several numpy passes — about
ten trips through gigabytes of memory per layer for a long prompt, with the masked causal
triangle computed and thrown away. Here one C routine (``csrc/cpu_attention.c``, compiled once
with the system compiler by :mod:`hf2q.kernels.cpu_build`, cached under the hf2q cache) walks
*tiles*: the queries of one KV head's group (all its query heads stacked, so the key tile
is read once per group) against ``TILE_K`` keys at a time. A tile's scores Q·Kᵀ and its
P·V product come from register-blocked AVX-512 loops (6 query rows × 32 keys, 6 rows × 64
value columns; ~150 and ~120 GFLOP/s on one core here, where OpenBLAS managed ~100 on
these small shapes) or, without AVX-512 or for head sizes not a multiple of 64, from the
loaded OpenBLAS ``cblas_sgemm`` (:mod:`hf2q.kernels.cpu_blas`). Scores stay in cache, are
masked only where a row's allowed key range cuts the tile, and are folded into the output
by an online softmax (running max and sum; vectorised polynomial ``exp``).
Key tiles outside every row's range — the causal upper triangle, keys before a sliding
window — are never computed.

Masks are the ones :class:`~hf2q.engine.kv_cache.ForwardBatch` builds (causal, sliding
window, padding of a batched decode): every query row may attend to one contiguous key
range ``[lo, hi)``. A mask of any other shape, a missing compiler or no fast BLAS make
:func:`attention` return None and the caller keeps its numpy path. Work is split over
query tiles on the workers of :func:`hf2q.kernels.cpu_blas.pool` (``HF2Q_BLAS_THREADS``; ctypes
drops the GIL), each taking the next tile from a shared counter.
"""

from __future__ import annotations

import ctypes
import threading

import mlx.core as mx
import numpy as np

from hf2q.kernels.cpu_build import KernelDimsError, KernelLibrary, switched_off

#: keys per tile; query rows per tile are ``TILE_ROWS`` (all heads of a group stacked)
TILE_K = 128
TILE_ROWS = 384

_LOCAL = threading.local()
_P = ctypes.c_void_p
_I = ctypes.c_int


def _declare(lib: ctypes.CDLL) -> None:
    lib.attend.argtypes = [_P] * 10 + [_I] * 6 + [ctypes.c_float] + [_I] * 2 + [_P, _P]
    lib.attend.restype = _I
    lib.scratch_size.argtypes = [_I, _I, _I, _I]
    lib.scratch_size.restype = ctypes.c_long
    lib.silu_mul.argtypes = [_P, _P, ctypes.c_long]
    lib.silu_mul.restype = None
    lib.gelu_tanh_mul.argtypes = [_P, _P, ctypes.c_long]
    lib.gelu_tanh_mul.restype = None


LIBRARY = KernelLibrary("cpu_attention", declare=_declare, off=switched_off)


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, a failed build, ``HF2Q_NO_CPU_KERNELS``, or no
    fast BLAS loaded: its ``cblas_sgemm`` serves the head sizes the register tiles do not)."""
    from hf2q.kernels import cpu_blas

    lib = LIBRARY.load()
    return lib if lib is not None and cpu_blas.sgemm_address() is not None else None


_INTERVALS: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []


def row_ranges(mask: np.ndarray | None, B: int, T: int, L: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per query row the allowed key range ``[lo, hi)`` as int32 ``[B, T]`` arrays, or None when some
    row's allowed keys are not one contiguous range. Cached per mask object (a forward batch
    builds each mask once and every layer asks again)."""
    if mask is None:
        return np.zeros((B, T), np.int32), np.full((B, T), L, np.int32)
    for m, lo, hi in _INTERVALS:
        if m is mask:
            return lo, hi
    m2 = np.broadcast_to(mask, (B, 1, T, L))[:, 0]
    lo = m2.argmax(axis=-1).astype(np.int32)
    hi = (L - m2[..., ::-1].argmax(axis=-1)).astype(np.int32)
    any_ = m2.any(axis=-1)
    lo[~any_], hi[~any_] = 0, 0
    if not np.array_equal(m2.sum(axis=-1, dtype=np.int64), (hi - lo).astype(np.int64)):
        return None
    _INTERVALS.insert(0, (mask, lo, hi))
    del _INTERVALS[4:]
    return lo, hi


def _view(x: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy float32 view of an evaluated MLX array and its strides in elements (last dim contiguous)."""
    a = np.asarray(memoryview(x))
    if a.strides[-1] != 4:
        a = np.ascontiguousarray(a)
    return a, np.array([s // 4 for s in a.strides[:3]], dtype=np.int64)


def attention(q: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask_np: np.ndarray | None) -> mx.array | None:
    """Same contract as :func:`hf2q.kernels.cpu_ops.attention`: ``q [B, H, T, D]``, ``keys [B, Hkv, L, D]``,
    ``values [B, Hkv, L, Dv]`` float32, ``mask_np`` bool ``[B, 1, T, L]`` or None → ``[B, H, T, Dv]``.
    Returns None where this kernel does not apply (caller falls back)."""
    lib = kernel()
    if lib is None or q.dtype != mx.float32 or keys.dtype != mx.float32 or values.dtype != mx.float32:
        return None
    B, H, T, D = q.shape
    Hkv, L, Dv = keys.shape[1], keys.shape[2], values.shape[3]
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[0] != B or keys.shape[3] != D \
            or tuple(values.shape[:3]) != (B, Hkv, L):
        raise ValueError(f"attention: q {tuple(q.shape)}, keys {tuple(keys.shape)} and values "
                         f"{tuple(values.shape)} are not [B, H, T, D], [B, Hkv, L, D], [B, Hkv, L, Dv]")
    if H % Hkv or min(B, T, D, Dv, L) <= 0:
        return None
    ranges = row_ranges(mask_np, B, T, L)
    if ranges is None:
        return None
    lo, hi = ranges
    if lo.shape != (B, T) or hi.shape != (B, T) or lo.min() < 0 or hi.max() > L or np.any(lo > hi):
        raise ValueError(f"attention: key ranges outside [0, {L}] for mask {getattr(mask_np, 'shape', None)}")
    mx.eval(q, keys, values)
    qa, qs = _view(q)
    ka, ks = _view(keys)
    va, vs = _view(values)
    out = np.empty((B, T, H, Dv), dtype=np.float32)
    rep = H // Hkv
    tq = max(1, min(T, TILE_ROWS // rep))
    rows = rep * tq
    n_tasks = B * Hkv * -(-T // tq)
    from hf2q.kernels import cpu_blas

    sgemm = cpu_blas.sgemm_address()
    args = [sgemm] + [a.ctypes.data for a in (qa, qs, ka, ks, va, vs, out, lo, hi)]
    dims = [B, H, Hkv, T, D, Dv]

    next_task = np.zeros(1, dtype=np.int32)
    refused: list[int] = []

    def work() -> None:
        scratch = _scratch(lib.scratch_size(rows, TILE_K, D, Dv))
        if lib.attend(*args, *dims, scale, tq, TILE_K, next_task.ctypes.data, scratch.ctypes.data):
            refused.append(1)

    with cpu_blas.single_threaded_products():  # each worker's tile products on its own thread
        cpu_blas.run_shared(n_tasks, work)
    if refused:
        raise KernelDimsError(f"attention kernel refused dims B={B} H={H} Hkv={Hkv} T={T} D={D} Dv={Dv}")
    return mx.array(out).transpose(0, 2, 1, 3)


def _scratch(n: int) -> np.ndarray:
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.size < n:
        buf = _LOCAL.buf = np.empty(n, dtype=np.float32)
    return buf


def _gated_inplace(name: str, g: np.ndarray, u: np.ndarray) -> bool:
    """``g ← act(g) * u`` by the kernel's entry ``name``, or False (nothing done) where the kernel is unavailable
    or the arrays are not C-contiguous float32 of one shape."""
    lib = kernel()
    if (lib is None or g.dtype != np.float32 or u.dtype != np.float32 or g.shape != u.shape
            or not g.flags.c_contiguous or not u.flags.c_contiguous or not g.flags.writeable):
        return False
    getattr(lib, name)(g.ctypes.data, u.ctypes.data, g.size)
    return True


def silu_mul_inplace(g: np.ndarray, u: np.ndarray) -> bool:
    """``g ← silu(g) * u`` in one vectorised pass (see :func:`_gated_inplace`)."""
    return _gated_inplace("silu_mul", g, u)


def gelu_tanh_mul_inplace(g: np.ndarray, u: np.ndarray) -> bool:
    """``g ← gelu_tanh(g) * u`` (as ``g·u / (1 + e^-2z)``) in one vectorised pass (see :func:`_gated_inplace`)."""
    return _gated_inplace("gelu_tanh_mul", g, u)
