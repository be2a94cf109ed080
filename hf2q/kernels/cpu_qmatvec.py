"""Quantized matrix × few-vectors on the CPU, straight from MLX's affine packing.

MLX's CPU ``quantized_matmul`` runs at well under 1 GMAC/s; for single-token decode it
made SmolLM2 spend ~0.3 s per token in matvecs. This module compiles (once, with the
system C compiler, cached under the hf2q cache) a small C kernel over the same packed
``uint32`` words, float32 scales and biases that MLX uses, so no second copy of the
weights is made: ``y[b, r] = Σ_g Σ_i (scale[r,g]·q[r,g,i] + bias[r,g])·x[b,g,i]``
(:mod:`hf2q.kernels.cpu_qmatvec_ref` states exactly that in numpy).

Why it is shaped the way it is (decode streams every weight once per step):

* a tile of up to 4 weight rows × up to 4 batch rows: each row's 32-group is converted
  and dequantized (``q·scale + bias``, one FMA per vector) once and reused for every batch
  row, and each ``x`` chunk is loaded once and reused for every weight row, so a batch of 4
  costs little more weight traffic than one sequence; one horizontal sum per output;
* weights are software-prefetched ``PF_BYTES`` ahead (and scales/biases ``PF_ROWS`` rows
  ahead): a single core streaming a 100–170 MB model is bound by memory latency, and the
  prefetch took the SmolLM2 Q8_0 matvecs from ~29 to ~19 ms per token;
* 4-bit rows are split into low/high nibbles (even/odd elements), so ``x`` is reordered
  once per call into that order instead of shuffling every weight row;
* widths other than 4 and 8 (2/3/5/6) unpack a row to bytes, then run the 8-bit loop.

The compiler targets the widest vector ISA /proc/cpuinfo reports (AVX-512F, else
AVX2/FMA); the same tile code runs on portable scalar C as the fallback. Several matrices
sharing one input (q/k/v, gate/up) run in one call (:class:`QMatrixGroup`), so a decode step
makes 4 kernel calls per layer; a mixture-of-experts layer's rows sorted by expert run every chosen
expert over its own run of rows in one call (:class:`ExpertStack`, ``qmv_segments``). A call big enough to share shares its blocks of 16 rows
over the C thread pool of :mod:`hf2q.kernels.cpu_pool` (the same blocks in the same tiles
whichever thread takes them, so the result does not depend on the thread count); ctypes
releases the GIL for the call. The C is ``csrc/cpu_qmatvec.c``. When there is no compiler or the
build fails (logged once at WARNING, shown by ``hf2q doctor``) :func:`kernel` returns None and
callers keep MLX's own path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from hf2q.kernels import cpu_pool
from hf2q.kernels.cpu_build import BAD_DIMS, KernelDimsError, KernelLibrary, switched_off

_P = ctypes.c_void_p
_I = ctypes.c_int


def _declare(lib: ctypes.CDLL) -> None:
    lib.qmv_group.argtypes = [_I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I]
    lib.qmv_group.restype = _I
    lib.qmv_segments.argtypes = [_I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I]
    lib.qmv_segments.restype = _I
    lib.simd_width.restype = _I
    lib.dequant_rows.argtypes = [_P, ctypes.c_int64, _P, _P, ctypes.c_int64, _P, ctypes.c_int64, _I, _I, _I]
    lib.dequant_rows.restype = _I


LIBRARY = KernelLibrary("cpu_qmatvec", declare=_declare, start=cpu_pool.attach, off=switched_off)


def kernel() -> ctypes.CDLL | None:
    """The compiled matvec library, or None (no compiler, a failed build, ``HF2Q_NO_CPU_KERNELS``)."""
    return LIBRARY.load()


class QMatrixGroup:
    """Quantized matrices with the same input width, run as one kernel call whose output
    is their results side by side (``[batch, Σ rows]``). Pointers and argument arrays are
    built once here, so a call costs one ctypes hop; the arrays stay referenced so the
    pointers stay valid."""

    def __init__(self, mats: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, int]]):
        lib = kernel()
        if lib is None:
            raise RuntimeError("the CPU quantized matvec kernel is not available")
        self._qmv_group = lib.qmv_group
        self._keep = []
        rows, bits, cols, ws, ss, bs = [], [], [], [], [], []
        n = None
        col = 0
        for packed, scales, biases, b in mats:
            packed = np.ascontiguousarray(packed).view(np.uint8)
            scales = np.ascontiguousarray(scales, dtype=np.float32)
            biases = np.ascontiguousarray(biases, dtype=np.float32)
            r = packed.shape[0]
            width = scales.shape[-1] * 32
            if n is None:
                n = width
            if packed.ndim != 2 or r == 0 or width != n or packed.shape[-1] * 8 != n * b or scales.shape != (r, n // 32) \
                    or biases.shape != scales.shape or b not in (2, 3, 4, 5, 6, 8):
                raise ValueError(f"inconsistent quantized matrix: packed {packed.shape}, scales {scales.shape}, "
                                 f"biases {biases.shape}, bits {b}, input width {n}")
            self._keep += [packed, scales, biases]
            ws.append(packed.ctypes.data)
            ss.append(scales.ctypes.data)
            bs.append(biases.ctypes.data)
            rows.append(r)
            bits.append(b)
            cols.append(col)
            col += r
        k = len(mats)
        self.n, self.rows = n, col
        self._args = ((_P * k)(*ws), (_P * k)(*ss), (_P * k)(*bs), (_I * k)(*rows), (_I * k)(*bits),
                      (_I * k)(*cols))
        self._count = k

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x [batch, n]`` (float32, C-contiguous preferred) → ``y [batch, Σ rows]`` float32."""
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[-1] != self.n or x.shape[0] == 0:
            raise ValueError(f"input shape {x.shape} is not [rows ≥ 1, matrix width {self.n}]")
        y = np.empty((x.shape[0], self.rows), dtype=np.float32)
        self.run(x.ctypes.data, y.ctypes.data, x.shape[0])
        return y

    def run(self, x_ptr: int, y_ptr: int, batch: int) -> None:
        """The raw call: ``x_ptr`` → float32 ``[batch, n]``, ``y_ptr`` → float32 ``[batch, Σ rows]``
        (callers that keep preallocated buffers skip the numpy bookkeeping)."""
        w, s, b, rows, bits, cols = self._args
        status = self._qmv_group(self._count, w, s, b, rows, bits, cols, x_ptr, y_ptr, self.n, batch, self.rows)
        if status:
            if status == BAD_DIMS:
                raise KernelDimsError(f"qmv_group refused its dims: {self._count} matrices of width {self.n}, "
                                 f"batch {batch}, output width {self.rows}")
            raise MemoryError("qmv_group: out of memory")


class ExpertStack:
    """Expert-stacked quantized weights ``[E, out_i, n]`` sharing one input width (a feed-forward's gate and up
    stacks), for calls whose input rows come sorted by expert: one kernel call runs every expert that has rows
    over its own run of them (``qmv_segments``), each stack's outputs side by side, so every expert matrix is
    read once per call however many rows it takes, and each output is the sum :class:`QMatrixGroup` gives
    that row alone. Zero-copy: the arrays are views of MLX's buffers."""

    def __init__(self, stacks: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, int]]):
        lib = kernel()
        if lib is None:
            raise RuntimeError("the CPU quantized matvec kernel is not available")
        self._segments = lib.qmv_segments
        self._keep, self._mats = [], []  # per stack: (per-expert weight, scale, bias addresses, rows, bits, column)
        col, n, experts = 0, None, None
        for packed, scales, biases, bits in stacks:
            e, r, g = scales.shape
            packed = packed.view(np.uint8).reshape(e, r, -1)
            if not (packed.flags.c_contiguous and scales.flags.c_contiguous and biases.flags.c_contiguous) \
                    or scales.dtype != np.float32 or biases.shape != scales.shape \
                    or packed.shape[-1] * 8 != g * 32 * bits or bits not in (2, 3, 4, 5, 6, 8) \
                    or (n is not None and (g * 32, e) != (n, experts)):
                raise ValueError(f"inconsistent expert stack: packed {packed.shape}, scales {scales.shape} "
                                 f"{scales.dtype}, biases {biases.shape}, bits {bits}")
            n, experts = g * 32, e
            self._keep += [packed, scales, biases]
            self._mats.append(([packed.ctypes.data + i * packed.strides[0] for i in range(e)],
                               [scales.ctypes.data + i * scales.strides[0] for i in range(e)],
                               [biases.ctypes.data + i * biases.strides[0] for i in range(e)], r, bits, col))
            col += r
        self.experts, self.n, self.rows = experts, n, col

    def __call__(self, x: np.ndarray, experts: Sequence[int], starts: Sequence[int], counts: Sequence[int],
                 y: np.ndarray | None = None) -> np.ndarray:
        """``x [rows, n]`` float32 whose rows ``[starts[i], starts[i] + counts[i])`` go through expert
        ``experts[i]`` → ``y [rows, Σ out]`` (into ``y`` when given; rows no run covers are left unwritten)."""
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[-1] != self.n or x.shape[0] == 0:
            raise ValueError(f"input shape {x.shape} is not [rows ≥ 1, matrix width {self.n}]")
        if y is None:
            y = np.empty((x.shape[0], self.rows), dtype=np.float32)
        elif y.shape != (x.shape[0], self.rows) or y.dtype != np.float32 or not y.flags.c_contiguous:
            raise ValueError(f"output {y.shape} {y.dtype} is not a contiguous float32 [{x.shape[0]}, {self.rows}]")
        if not experts:
            return y
        w, s, b, rows, bits, col, xrow, nrow = [], [], [], [], [], [], [], []
        for ws, ss, bs, r, bt, c in self._mats:
            w += [ws[e] for e in experts]
            s += [ss[e] for e in experts]
            b += [bs[e] for e in experts]
            rows += [r] * len(experts)
            bits += [bt] * len(experts)
            col += [c] * len(experts)
            xrow += starts
            nrow += counts
        k = len(w)
        status = self._segments(k, (_P * k)(*w), (_P * k)(*s), (_P * k)(*b), (_I * k)(*rows), (_I * k)(*bits),
                                (_I * k)(*col), (_I * k)(*xrow), (_I * k)(*nrow), x.ctypes.data, y.ctypes.data,
                                self.n, x.shape[0], self.rows)
        if status:
            if status == BAD_DIMS:
                raise KernelDimsError(f"qmv_segments refused its dims: {k} matrices of width {self.n}, "
                                      f"{x.shape[0]} input rows, output width {self.rows}")
            raise MemoryError("qmv_segments: out of memory")
        return y


def qmatvec(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, x: np.ndarray, bits: int) -> np.ndarray:
    """``x [batch, n] float32`` → ``[batch, rows]``; packed is the MLX uint32 layout as bytes ``[rows, n*bits/8]``.

    One-off form of :class:`QMatrixGroup` (builds the argument arrays per call)."""
    return QMatrixGroup([(packed, scales, biases, bits)])(x)


def dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
               out: np.ndarray | None = None) -> np.ndarray | None:
    """The float32 weight ``[rows, n]`` of a 4- or 8-bit matrix as the C decode kernel reads it (``packed`` bytes
    ``[rows, n*bits/8]``, float32 ``scales``/``biases`` ``[rows, n/32]``, rows of any stride), each value
    rounded as ``mx.dequantize`` rounds it, so the two are equal bit for bit; one pass over the pool's
    threads. Written into ``out`` (float32 ``[rows, n]``, rows contiguous) when given. None where the kernel
    is missing or cannot take these arrays (the caller keeps MLX's op)."""
    lib = kernel()
    if lib is None or bits not in (4, 8) or packed.ndim != 2 or scales.ndim != 2 \
            or scales.dtype != np.float32 or biases.dtype != np.float32 or biases.shape != scales.shape \
            or packed.dtype != np.uint8 or packed.strides[1] != 1 or scales.strides[1] != 4 \
            or biases.strides != scales.strides:
        return None
    rows, n = scales.shape[0], scales.shape[1] * 32
    if packed.shape != (rows, n * bits // 8) or rows == 0:
        return None
    if out is None:
        out = np.empty((rows, n), dtype=np.float32)
    elif out.shape != (rows, n) or out.dtype != np.float32 or out.strides[1] != 4 or not out.flags.writeable:
        raise ValueError(f"dequantize: output {out.shape} {out.dtype} is not a writable float32 [{rows}, {n}]")
    status = lib.dequant_rows(packed.ctypes.data, packed.strides[0], scales.ctypes.data, biases.ctypes.data,
                              scales.strides[0] // 4, out.ctypes.data, out.strides[0] // 4, rows, n, bits)
    if status:
        raise KernelDimsError(f"dequant_rows refused its dims: {rows} rows of {n}, {bits} bits")
    return out
