"""The small per-layer ops of a CPU decode step (RMS norm, RoPE, attention over the KV
cache, gated activations) as one compiled C library.

Once the quantized matvecs (:mod:`hf2q.kernels.cpu_qmatvec`) became fast, a SmolLM2 decode
step spent more time in the ~40 numpy calls per layer around them (1–3 µs of dispatch each,
plus temporaries) than in the matvecs. Each op here is one ctypes call over caller-owned
float32 buffers passed as raw addresses, so the host decoder (``hf2q.engine.cpu_decode``)
makes about ten calls per layer. :mod:`hf2q.kernels.cpu_decode_ops_ref` states each op in
numpy; the tests hold the two together and the whole step against the MLX graph. The C is
``csrc/cpu_decode_ops.c``.

Conventions: every buffer is float32 and C-contiguous along its last axis; strides are in
elements. The KV cache buffers are ``[kv_heads, capacity, head_dim]`` (``SequenceCache``); an 8-bit
cache's (``attend_q8``, ``engine/kv_quant.py``) are its codes as bytes ``[kv_heads, capacity, head_dim]``
and float32 scales ``[kv_heads, capacity, head_dim / group]``.
Every entry point first checks that its dims are possible (positive counts, a stride that holds
the row, a position inside its cache) and refuses with :class:`KernelDimsError` otherwise.
"""

from __future__ import annotations

import ctypes

from hf2q.kernels import cpu_pool
from hf2q.kernels.cpu_build import BAD_DIMS, KernelDimsError, KernelLibrary
from hf2q.kernels.cpu_qmatvec import kernel

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def _checked(result: int, func, args) -> int:
    """ctypes ``errcheck``: every entry point's status becomes an exception, so no caller can
    ignore a refusal (BAD_DIMS) or an allocation failure (-1)."""
    if result == BAD_DIMS:
        raise KernelDimsError(f"{func.__name__}: impossible dimensions {args[-6:]}")
    if result:
        raise MemoryError(f"{func.__name__}: out of memory")
    return result


def _declare(lib: ctypes.CDLL) -> None:
    signatures = {
        "rms_norm": [_P, _L, _P, _P, _L, _I, _I, _I, _F],
        "rope": [_P, _L, _P, _I, _I, _I, _I, _I],
        "attend_layer": [_P, _L, _P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F],
        "attend_q8": [_P, _L, _P, _P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F],
        "glu": [_P, _P, _I, _I, _I],
        "add_rms": [_P, _P, _L, _P, _P, _I, _I, _F],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype, fn.errcheck = argtypes, _I, _checked


LIBRARY = KernelLibrary("cpu_decode_ops", declare=_declare, start=cpu_pool.attach,
                        off=lambda: None if kernel() is not None else "the cpu_qmatvec kernel is unavailable")


def library() -> ctypes.CDLL | None:
    """The compiled ops (None when the matvec kernel is off, or there is no compiler or the build failed)."""
    return LIBRARY.load()
