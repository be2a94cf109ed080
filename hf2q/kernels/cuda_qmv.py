"""Quantized matrix × a few rows on NVIDIA GPUs: every weight read once for all rows.

MLX's CUDA ``quantized_matmul`` runs 1–7 rows through its matrix-vector kernel once per row,
re-reading the whole weight matrix each time, and switches to a tiled kernel from 8 rows (H200,
12288×4096 8-bit: 32 µs for one row, 95 µs for four, 141 µs for six, 68 µs for eight). A batched
decode step of 2–7 sequences is exactly that shape, so it paid up to 4× the weight traffic of a
single sequence. This kernel gives each output row one warp: the lanes stream the row's packed
words in 16-byte chunks (each chunk lies inside one quantization group), dequantize them once
(``q·scale + bias``, MLX's affine layout, read in place) and accumulate them against every
input row, then reduce across the warp. It is memory bound at any row count it takes.

The kernel body is ``csrc/cuda_qmv.cu``. Math: :mod:`hf2q.kernels.cpu_qmatvec_ref` (the numpy
reference both this kernel and the CPU one are tested against). Used by :class:`hf2q.engine.layers.Linear` for 4- and 8-bit weights
on a CUDA device when a call has 1–``MAX_ROWS`` rows; Metal and the CPU keep their own paths.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx
import numpy as np

from hf2q.kernels.cuda_source import CudaKernel

#: the most input rows one call takes (from 8 rows MLX's tiled kernel reads the weights once too)
MAX_ROWS = 7
#: the fewest: one row too, so a plain decode step and a speculative verify's rows run the same per-row
#: arithmetic (MLX's matrix-vector kernel rounds differently) and T=0 drafting changes no token;
#: ``HF2Q_QMV_MIN_ROWS=2`` hands single rows back to MLX (for side-by-side timing)
MIN_ROWS = max(1, int(os.environ.get("HF2Q_QMV_MIN_ROWS", "1")))
#: the smallest matrix (out × in elements) it takes: below that MLX's kernel fills the GPU better
#: (H200, 1024×4096: 14 µs MLX vs 27 µs here at 4 rows; 12288×4096: 97 vs 53)
MIN_ELEMENTS = 4096 * 4096


#: the kernel, its body compiled by ``mx.fast.cuda_kernel`` on first use (shipped as package data)
KERNEL = CudaKernel("hf2q_qmv_rows", "cuda_qmv.cu", ["x", "w", "scales", "biases"], ["y"])
_CUDA: bool | None = None


def available() -> bool:
    """True when MLX runs on a CUDA device here (custom kernels compile at run time)."""
    global _CUDA
    if _CUDA is None:
        try:
            _CUDA = bool(mx.cuda.is_available())
        except AttributeError:  # an MLX without the CUDA module
            _CUDA = False
    return _CUDA and mx.default_device().type == mx.DeviceType.gpu


def takes(rows: int, out_features: int, in_features: int, bits: int, group_size: int) -> bool:
    """Whether a call of ``rows`` input rows through a ``bits``/``group_size`` matrix
    ``[out_features, in_features]`` is one this kernel serves (callers also check :func:`available`)."""
    if not MIN_ROWS <= rows <= MAX_ROWS or bits not in (4, 8) or group_size not in (32, 64, 128):
        return False
    # whole groups make whole 16-byte chunks (16 or 32 values), and no chunk straddles two groups
    return out_features * in_features >= MIN_ELEMENTS and in_features % group_size == 0


def qmv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """``x [..., K]`` (1–``MAX_ROWS`` rows) through MLX-packed ``w [N, K·bits/32]`` → ``[..., N]`` in x's dtype."""
    K = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    N = w.shape[0]
    groups = K // group_size if group_size else 0
    # the kernel indexes w/scales/biases from (N, K) alone: shapes that disagree would read past them
    if (not 1 <= rows <= MAX_ROWS or bits not in (4, 8) or group_size not in (32, 64, 128) or K % group_size
            or w.ndim != 2 or tuple(w.shape) != (N, K * bits // 32) or w.dtype != mx.uint32
            or tuple(scales.shape) != (N, groups) or tuple(biases.shape) != (N, groups)):
        raise ValueError(f"cuda qmv: x {tuple(x.shape)}, w {tuple(w.shape)} {w.dtype}, scales {tuple(scales.shape)}, "
                         f"biases {tuple(biases.shape)} do not fit bits {bits} group size {group_size}")
    warps_per_block = 4
    (y,) = KERNEL(
        inputs=[x.reshape(rows, K), w, scales, biases],
        template=[("T_", x.dtype), ("S_", scales.dtype), ("MAX_M_", MAX_ROWS), ("BITS_", bits), ("GS_", group_size)],
        grid=(((N + warps_per_block - 1) // warps_per_block) * 32 * warps_per_block, 1, 1),
        threadgroup=(32 * warps_per_block, 1, 1),
        output_shapes=[(rows, N)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], N)


def status() -> tuple[str, str]:
    """``(status, detail)`` for ``hf2q doctor``: ``not applicable`` off CUDA; else one small call
    (MLX compiles the kernel on its first run) checked against the numpy reference: ``ok`` or ``failed``."""
    if not available():
        return "not applicable", "no CUDA device"
    from hf2q.kernels.cpu_qmatvec_ref import qmatvec as reference

    try:
        rng = np.random.default_rng(0)
        n, k = 64, 512
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        x = mx.array(rng.standard_normal((2, k)).astype(np.float32))
        y = qmv(x, wq, scales, biases, 4, 64)
        mx.eval(y)
        want = reference(np.array(wq).view(np.uint8), np.array(scales), np.array(biases), np.array(x), 4, 64)
        error = float(np.abs(np.array(y) - want).max() / np.abs(want).max())
        if not error < 1e-4:
            return "failed", f"runs, but is {error:.2g} (relative) off the numpy reference"
    except Exception as e:  # noqa: BLE001 — a compile error surfaces as whatever MLX raises
        return "failed", f"{type(e).__name__}: {e}".strip()[:500]
    return "ok", ""
