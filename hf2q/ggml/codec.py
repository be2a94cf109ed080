"""Public codec API: GGML tensor types ⇄ float32, byte-identical to llama.cpp's reference quantizer.

    quantize(x, qtype, threads=None, imatrix=None)
                                       float32 [rows, n_per_row] → uint8 [rows, row_bytes]
    dequantize(raw, qtype, shape)      bytes of whole rows → float32 [shape]
    row_bytes(qtype, n_per_row)        size of one quantized row
    SUPPORTED                          the GGMLQuantizationType values handled here
    IMATRIX_TYPES                      the types whose quantizer reads an importance matrix

Quantized types expect input that the caller has already rounded to float16 (llama.cpp's
pipeline is HF → F16 GGUF → llama-quantize); with such input the bytes equal
``ggml_quantize_chunk(type, x, …, imatrix)``.  ``imatrix`` is one non-negative weight per
column (llama.cpp's ``quant_weights``, i.e. the imatrix entry of that tensor); Q8_0 and the
float types ignore it, as llama.cpp does.  NaN / infinite inputs to quantized types raise
``InputError`` (llama.cpp would silently write garbage blocks).

Three implementations of every quantizer, all byte-identical:

* compiled (numba, ``jit_*``): the C's per-block loops, ~3-10× the numpy path; used by
  ``quantize`` whenever numba is importable and ``HF2Q_NO_JIT`` is not set
  (``jit_active()``).  Kernels compile on first use and are cached on disk;
* vectorised numpy (``kquants`` / ``legacy`` / ``imatrix``): the fallback,
  also reachable directly as ``numpy_quantize``;
* plain per-block references (``*_ref``): ``reference_quantize``, slow, used to
  cross-check the other two.

Large inputs are cut into chunks of whole blocks and quantized on a thread pool (numpy and
the compiled kernels release the GIL).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ConversionError, InputError
from . import floats, kquants, legacy

T = GGMLQuantizationType

FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
LEGACY_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0})
K_TYPES = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})
SUPPORTED = FLOAT_TYPES | LEGACY_TYPES | K_TYPES
# types whose quantizer reads an importance matrix (llama.cpp's Q8_0 and float types ignore it)
IMATRIX_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}) | K_TYPES

# elements per chunk handed to one worker: big enough to amortise numpy call overhead,
# small enough that a chunk's temporaries stay cache-friendly.
CHUNK_ELEMENTS = 1 << 16

_JIT_BROKEN: str | None = None  # why the compiled kernels could not be loaded, once that happened


def _check_type(qtype) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise InputError(f"unknown GGML type {qtype!r}") from None
    if qtype not in SUPPORTED:
        raise InputError(f"GGML type {qtype.name} is not supported by hf2q's codecs "
                         f"(supported: {', '.join(sorted(t.name for t in SUPPORTED))})")
    return qtype


def row_bytes(qtype, n_per_row: int) -> int:
    """Bytes of one row of ``n_per_row`` values; ``n_per_row`` must be a multiple of the block size."""
    qtype = _check_type(qtype)
    blk, size = GGML_QUANT_SIZES[qtype]
    if n_per_row % blk:
        raise InputError(f"{qtype.name} needs rows whose length is a multiple of {blk}, got {n_per_row}")
    return n_per_row // blk * size


def _as_matrix(x: np.ndarray, qtype) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise InputError(f"quantize expects a [rows, n_per_row] matrix, got shape {x.shape}")
    row_bytes(qtype, x.shape[1])  # validates the row length
    return np.ascontiguousarray(x, dtype=np.float32)


def _block_codec(qtype, fast: bool):
    """(quantize_blocks, dequantize_blocks) working on [nblocks, block] float32 ⇄ [nblocks, bytes] uint8."""
    name = qtype.name
    if qtype in LEGACY_TYPES:
        if fast:
            return legacy.QUANTIZE[name], legacy.DEQUANTIZE[name]
        from . import legacy_ref as ref
        return ref.QUANTIZE[name], ref.DEQUANTIZE[name]
    if fast:
        return kquants.QUANTIZE[name], kquants.DEQUANTIZE[name]
    from . import kquants_ref as ref
    return ref.QUANTIZE[name], ref.DEQUANTIZE[name]


def _imatrix_codec(qtype, fast: bool):
    """Block quantizer taking ``weights`` (and ``sigma2`` for legacy types), or None when the type ignores it."""
    name = qtype.name
    if qtype not in IMATRIX_TYPES:
        return None
    if fast:
        from . import imatrix as mod
    else:
        from . import imatrix_ref as mod
    return mod.K_QUANTIZE[name] if qtype in K_TYPES else mod.LEGACY_QUANTIZE[name]


def _default_threads() -> int:
    env = os.environ.get("HF2Q_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(8, os.cpu_count() or 1))


def _run_blocks(fn, blocks: np.ndarray, out_cols: int, threads: int, per_chunk: int, extra=None) -> np.ndarray:
    """Quantize ``blocks`` chunk by chunk (on a thread pool when threads > 1); ``extra(start, stop)``
    supplies per-chunk keyword arguments (importance weights)."""
    nb = blocks.shape[0]
    out = np.empty((nb, out_cols), dtype=np.uint8)
    starts = range(0, nb, per_chunk)

    def work(s):
        e = min(nb, s + per_chunk)
        with np.errstate(all="ignore"):  # float32 overflow/NaN steps are part of the C behaviour we copy
            out[s:e] = fn(blocks[s:e], **(extra(s, e) if extra else {}))

    if threads <= 1 or nb <= per_chunk:
        for s in starts:
            work(s)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(work, starts))
    return out


def _checked_imatrix(imatrix, n: int) -> np.ndarray:
    imatrix = np.asarray(imatrix, dtype=np.float32).reshape(-1)
    if imatrix.shape[0] != n:
        raise InputError(f"imatrix has {imatrix.shape[0]} weights for rows of {n} values")
    if not np.all(np.isfinite(imatrix)) or np.any(imatrix < 0):
        raise InputError("imatrix weights must be finite and non-negative")
    return imatrix


def _imatrix_args(x: np.ndarray, qtype, imatrix, fast: bool):
    """Per-chunk keyword arguments for the imatrix quantizers: each block's column weights
    (and, for the legacy types, the σ² of the row it belongs to)."""
    n = x.shape[1]
    blk = GGML_QUANT_SIZES[qtype][0]
    imatrix = _checked_imatrix(imatrix, n)
    per_row = n // blk
    column_weights = imatrix.reshape(per_row, blk)
    sigma2 = None
    if qtype in LEGACY_TYPES:
        if fast:
            from .imatrix import row_sigma2
        else:
            from .imatrix_ref import row_sigma2
        with np.errstate(over="ignore"):
            sigma2 = np.repeat(row_sigma2(x), per_row)

    def extra(s, e):
        kw = {"weights": column_weights[np.arange(s, e) % per_row]}
        if sigma2 is not None:
            kw["sigma2"] = sigma2[s:e]
        return kw

    return extra


def _jit_kernels(qtype):
    """(kind, entry point) of the compiled kernels for ``qtype``, or None when they cannot be loaded.

    Importing a kernel module compiles its kernels (first run) or loads them from numba's cache.
    A numba that is installed but unusable (ABI mismatch, unsupported CPU) is reported once
    and the numpy codecs take over.
    """
    global _JIT_BROKEN
    if _JIT_BROKEN is not None:
        return None
    try:
        if qtype in K_TYPES:
            from .jit_kquants import KIND
            from .jit_kquants import quantize_k_blocks as entry
        else:
            from .jit_legacy import KIND
            from .jit_legacy import quantize_legacy_blocks as entry
    except Exception as e:  # noqa: BLE001 — any failure to build the kernels means: use numpy
        _JIT_BROKEN = f"{type(e).__name__}: {e}".splitlines()[0]
        logging.getLogger(__name__).warning("compiled quantizers unavailable (%s); using the numpy codecs",
                                            _JIT_BROKEN)
        return None
    return KIND[qtype.name], entry


def _quantize_jit(x: np.ndarray, qtype, threads: int, imatrix, kernels) -> np.ndarray:
    """The compiled path: each worker runs one numba kernel call over a run of whole blocks."""
    rows, n = x.shape
    blk, size = GGML_QUANT_SIZES[qtype]
    blocks = x.reshape(-1, blk)
    nb = blocks.shape[0]
    out = np.empty((nb, size), dtype=np.uint8)
    use_qw = imatrix is not None and qtype in IMATRIX_TYPES
    qw = (_checked_imatrix(imatrix, n).reshape(n // blk, blk) if use_qw
          else np.zeros((1, blk), dtype=np.float32))
    sigma2 = np.zeros(1, dtype=np.float32)
    if use_qw and qtype in LEGACY_TYPES:
        from .imatrix import row_sigma2
        with np.errstate(over="ignore"):
            sigma2 = np.repeat(row_sigma2(x), n // blk)

    kind, entry = kernels
    if qtype in K_TYPES:
        def run(chunk, s, e):
            entry(chunk, qw, s, use_qw, kind, out[s:e])
    else:
        def run(chunk, s, e):
            entry(chunk, qw, sigma2[s:e] if use_qw else sigma2, s, use_qw, kind, out[s:e])

    def work(s: int, e: int) -> None:
        run(blocks[s:e] if blocks.flags.writeable else blocks[s:e].copy(), s, e)  # kernels take writable arrays

    # a few chunks per thread balance uneven blocks; a chunk never drops below CHUNK_ELEMENTS
    per_chunk = max(CHUNK_ELEMENTS // blk, -(-nb // (threads * 4)))
    if threads <= 1 or nb <= per_chunk:
        work(0, nb)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda s: work(s, min(nb, s + per_chunk)), range(0, nb, per_chunk)))
    return out.reshape(rows, n // blk * size)


def numba_installed() -> bool:
    """Whether numba can be imported (checked without importing it: that costs ~0.5 s)."""
    return importlib.util.find_spec("numba") is not None


def jit_active() -> bool:
    """Whether ``quantize`` runs the compiled kernels: numba installed and ``HF2Q_NO_JIT`` unset (or 0)."""
    flag = os.environ.get("HF2Q_NO_JIT", "").strip().lower()
    return flag in ("", "0", "false", "no") and _JIT_BROKEN is None and numba_installed()


def _quantize(x, qtype, threads, imatrix, fast: bool, jit: bool = False) -> np.ndarray:
    qtype = _check_type(qtype)
    x = _as_matrix(x, qtype)
    rows, n = x.shape
    if qtype in FLOAT_TYPES:
        return floats.quantize(x, qtype.name)
    with np.errstate(over="ignore", invalid="ignore"):  # a cheap sum first; only a non-finite one is checked
        finite = bool(np.isfinite(np.add.reduce(x, axis=None))) or bool(np.isfinite(x).all())
    if not finite:
        raise InputError(f"cannot quantize to {qtype.name}: the input contains NaN or infinite values "
                         "(weights beyond ±65504 overflow float16)")
    threads = _default_threads() if threads is None else max(1, int(threads))
    kernels = _jit_kernels(qtype) if jit else None
    if kernels is not None:
        with np.errstate(all="ignore"):  # row_sigma2 may overflow on raw float32 input, as in C
            return _quantize_jit(x, qtype, threads, imatrix, kernels)
    blk, size = GGML_QUANT_SIZES[qtype]
    qfn, _ = _block_codec(qtype, fast)
    extra = None
    if imatrix is not None and qtype in IMATRIX_TYPES:  # Q8_0 ignores the imatrix, as in llama.cpp
        qfn = _imatrix_codec(qtype, fast)
        extra = _imatrix_args(x, qtype, imatrix, fast)
    blocks = x.reshape(-1, blk)
    # Q3_K's search refines one value at a time (many small numpy calls): bigger chunks amortise them
    chunk = CHUNK_ELEMENTS * (4 if qtype == T.Q3_K else 1)
    per_chunk = max(1, chunk // blk) if fast else blocks.shape[0]
    q = _run_blocks(qfn, blocks, size, threads if fast else 1, per_chunk, extra)
    return q.reshape(rows, n // blk * size)


def quantize(x: np.ndarray, qtype, threads: int | None = None, imatrix: np.ndarray | None = None) -> np.ndarray:
    """float32 ``[rows, n_per_row]`` → uint8 ``[rows, row_bytes]`` in GGML's block layout.

    ``imatrix``: optional importance weights, one per column (llama.cpp's ``quant_weights``).
    Runs the compiled kernels when ``jit_active()``, else the vectorised numpy codecs.
    """
    return _quantize(x, qtype, threads, imatrix, fast=True, jit=jit_active())


def numpy_quantize(x: np.ndarray, qtype, threads: int | None = None, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Same contract as :func:`quantize` through the vectorised numpy codecs (the no-numba fallback)."""
    return _quantize(x, qtype, threads, imatrix, fast=True, jit=False)


def jit_quantize(x: np.ndarray, qtype, threads: int | None = None, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Same contract as :func:`quantize` through the compiled kernels (needs numba, ignores ``HF2Q_NO_JIT``)."""
    if not numba_installed():
        raise InputError("the compiled quantizers need numba (pip install numba)")
    qtype = _check_type(qtype)
    if qtype not in FLOAT_TYPES and _jit_kernels(qtype) is None:
        raise ConversionError(f"the compiled quantizers could not be loaded ({_JIT_BROKEN})")
    return _quantize(x, qtype, threads, imatrix, fast=True, jit=True)


def reference_quantize(x: np.ndarray, qtype, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Same contract as :func:`quantize` through the plain per-block references (slow)."""
    return _quantize(x, qtype, 1, imatrix, fast=False)


def _dequantize(raw, qtype, shape, fast: bool) -> np.ndarray:
    qtype = _check_type(qtype)
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise InputError("dequantize needs a non-empty shape")
    n = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    rb = row_bytes(qtype, n)
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size != rows * rb:
        raise InputError(f"{qtype.name} data of {raw.size} bytes does not match shape {shape} "
                         f"({rows * rb} bytes expected)")
    if qtype in FLOAT_TYPES:
        return floats.dequantize(raw, qtype.name).reshape(shape)
    blk, size = GGML_QUANT_SIZES[qtype]
    _, dfn = _block_codec(qtype, fast)
    blocks = raw.reshape(-1, size)
    out = np.empty((blocks.shape[0], blk), dtype=np.float32)
    step = max(1, CHUNK_ELEMENTS * 4 // blk)
    for s in range(0, blocks.shape[0], step):
        out[s:s + step] = dfn(blocks[s:s + step])
    return out.reshape(shape)


def dequantize(raw: np.ndarray, qtype, shape: tuple) -> np.ndarray:
    """Bytes of whole rows (any shape, C order) → float32 array of ``shape`` (last axis = row)."""
    return _dequantize(raw, qtype, shape, fast=True)


def reference_dequantize(raw: np.ndarray, qtype, shape: tuple) -> np.ndarray:
    return _dequantize(raw, qtype, shape, fast=False)
