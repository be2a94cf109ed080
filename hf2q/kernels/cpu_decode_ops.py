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
elements. The KV cache buffers are ``[kv_heads, capacity, head_dim]`` (``SequenceCache``).
"""

from __future__ import annotations

import ctypes

from hf2q.kernels import cpu_pool
from hf2q.kernels.cpu_build import KernelLibrary
from hf2q.kernels.cpu_qmatvec import kernel

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> None:
    lib.rms_norm.argtypes = [_P, _L, _P, _P, _L, _I, _I, _I, _F]
    lib.rms_norm.restype = None
    lib.rope.argtypes = [_P, _L, _P, _I, _I, _I, _I, _I]
    lib.rope.restype = None
    lib.attend.argtypes = [_P, _L, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _F]
    lib.attend.restype = _I
    lib.glu.argtypes = [_P, _P, _I, _I, _I]
    lib.glu.restype = None
    lib.add_rms.argtypes = [_P, _P, _L, _P, _P, _I, _I, _F]
    lib.add_rms.restype = None


LIBRARY = KernelLibrary("cpu_decode_ops", declare=_declare, start=cpu_pool.attach,
                        off=lambda: None if kernel() is not None else "the cpu_qmatvec kernel is unavailable")


def library() -> ctypes.CDLL | None:
    """The compiled ops (None when the matvec kernel is off, or there is no compiler or the build failed)."""
    return LIBRARY.load()
