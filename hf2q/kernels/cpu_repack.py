"""The load's repack of GGUF blocks into MLX affine groups as one C pass per band of rows.

Loading a quantized model is mostly this repack (``hf2q.engine.quant_repack``): numpy's version takes some
twenty array passes per band, holding the GIL between them, and moved 0.08–0.26 GB/s of Q6_K/Q4_K blocks on two
cores, so a 5 GB file spent tens of seconds in it. The C pass (``csrc/cpu_repack.c``) reads each block once and
writes the codes, scales and biases straight into the destination band, releasing the GIL for the whole band,
so the load's bands run on every core of the shared pool. ``quant_repack``'s numpy path stays the reference
(the tests hold the two equal bit for bit) and the fallback for the other types and when there is no compiler.
"""

from __future__ import annotations

import ctypes

import numpy as np
from gguf import GGMLQuantizationType as T

from hf2q.kernels.cpu_build import BAD_DIMS, KernelDimsError, KernelLibrary, switched_off

#: the GGUF types the C pass repacks (the rest stay on numpy)
TYPES = frozenset({T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K})

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.repack_rows
    fn.argtypes, fn.restype = [_I, _P, _L, _I, _I, _P, _L, _P, _P, _L, _I], _I


LIBRARY = KernelLibrary("cpu_repack", declare=_declare, off=switched_off)


def repack_band(raw: np.ndarray, qtype: T, n: int, packed: np.ndarray, scales: np.ndarray,
                biases: np.ndarray, wide: bool = False) -> bool:
    """Repack the GGUF rows ``raw`` (uint8 ``[rows, bytes]``, contiguous rows) of ``n`` weights into the
    row-contiguous destinations ``packed`` (uint32 ``[rows, n·bits/32]``), ``scales`` and ``biases`` (float32
    ``[rows, n/32]``), 5-bit codes one a byte when ``wide``; False (nothing written) when the type is not one of :data:`TYPES` or the library is
    not built here."""
    lib = LIBRARY.load() if qtype in TYPES else None
    if lib is None:
        return False
    rows = raw.shape[0]
    for a in (raw, packed, scales, biases):
        if a.shape[0] != rows or a.strides[-1] != a.itemsize:
            raise KernelDimsError(f"repack_band: rows {rows} against an array of shape {a.shape}, strides {a.strides}")
    if scales.strides[0] != biases.strides[0]:
        raise KernelDimsError("repack_band: scales and biases with different row strides")
    status = lib.repack_rows(int(qtype), raw.ctypes.data, raw.strides[0], rows, n, packed.ctypes.data,
                             packed.strides[0], scales.ctypes.data, biases.ctypes.data, scales.strides[0] // 4,
                             int(wide))
    if status == BAD_DIMS:
        raise KernelDimsError(f"repack_rows: impossible dimensions (type {qtype.name}, {rows} rows of {n})")
    return True
