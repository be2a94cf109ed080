"""The gated delta rule (Qwen 3.5's linear-attention recurrence) on the CPU, as one C call per chunk.

MLX's CPU ``mx.fast.gated_delta_update`` took 0.44 s per layer for a 2,048-token chunk at 16 value heads of 64, so
a CPU prefill of a Qwen 3.5 MoE spent two fifths of its time in a recurrence of half a GFLOP per layer. The state
rows are independent (each decays, gives its ``S·k``, takes its own delta and gives its ``S·q``), so the C pass
(``csrc/cpu_gated_delta.c``) keeps a block of rows in cache for every token of the call and shares the blocks
over the pool of :mod:`hf2q.kernels.cpu_pool`; each row's arithmetic is the same whatever thread runs it, so the
result does not depend on the thread count. Math: :mod:`hf2q.kernels.gated_delta_ref`; value head ``h`` reads
key head ``h mod Hk``, as the CUDA kernel (:mod:`hf2q.kernels.cuda_gated_delta`) does.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

from hf2q.kernels import cpu_pool
from hf2q.kernels.cpu_build import BAD_DIMS, KernelDimsError, KernelLibrary, switched_off

_P, _I = ctypes.c_void_p, ctypes.c_int


def _declare(lib: ctypes.CDLL) -> None:
    lib.gated_delta.argtypes = [_P] * 7 + [_I] * 6
    lib.gated_delta.restype = _I


LIBRARY = KernelLibrary("cpu_gated_delta", declare=_declare, start=cpu_pool.attach, off=switched_off)


def available() -> bool:
    return mx.default_device() == mx.cpu and LIBRARY.load() is not None


def _host(a: mx.array) -> np.ndarray:
    a = a.astype(mx.float32)
    mx.eval(a)
    return np.ascontiguousarray(np.asarray(memoryview(a)), dtype=np.float32)


def gated_delta(q: mx.array, k: mx.array, v: mx.array, gamma: mx.array, beta: mx.array,
                state: mx.array) -> tuple[mx.array, mx.array]:
    """``q, k [B, T, Hk, Dk]``, ``v [B, T, H, Dv]``, ``gamma, beta [B, T, H]``, ``state [B, H, Dv, Dk]``
    → ``(y [B, T, H, Dv], final state)`` in float32 (the contract of ``mx.fast.gated_delta_update`` with the key
    heads untiled)."""
    lib = LIBRARY.load()
    if lib is None:
        raise RuntimeError("the CPU gated-delta kernel is not available")
    B, T, H, Dv = v.shape
    Hk, Dk = q.shape[2], q.shape[3]
    if k.shape != q.shape or q.shape[:2] != (B, T) or state.shape != (B, H, Dv, Dk) or H % Hk \
            or gamma.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"gated_delta: shapes q{q.shape} k{k.shape} v{v.shape} gamma{gamma.shape} "
                         f"beta{beta.shape} state{state.shape} do not fit one layer")
    qa, ka, va, ga, ba = (_host(a) for a in (q, k, v, gamma, beta))
    s = np.array(_host(state), copy=True)
    y = np.empty((B, T, H, Dv), np.float32)
    status = lib.gated_delta(*(a.ctypes.data for a in (qa, ka, va, ga, ba, s, y)), B, T, Hk, H, Dk, Dv)
    if status == BAD_DIMS:
        raise KernelDimsError(f"gated_delta refused B={B} T={T} Hk={Hk} H={H} Dk={Dk} Dv={Dv}")
    return mx.array(y), mx.array(s)
