"""Quantized matrix × a few rows on NVIDIA GPUs: every weight read once for all rows.

MLX's CUDA ``quantized_matmul`` runs 1–7 rows through its matrix-vector kernel once per row,
re-reading the whole weight matrix each time, and switches to a tiled kernel from 8 rows (H200,
12288×4096 8-bit: 32 µs for one row, 95 µs for four, 141 µs for six, 68 µs for eight). A batched
decode step of 2–7 sequences is exactly that shape, so it paid up to 4× the weight traffic of a
single sequence. This kernel gives each output row one warp: the lanes stream the row's packed
words in 16-byte chunks (each chunk lies inside one quantization group), dequantize them once
(``q·scale + bias``, MLX's affine layout, read in place) and accumulate them against every
input row, then reduce across the warp. It is memory bound at any row count it takes.

Math: :mod:`hf2q.kernels.cpu_qmatvec_ref` (the numpy reference both this kernel and the CPU
one are tested against). Used by :class:`hf2q.engine.layers.Linear` for 4- and 8-bit weights
on a CUDA device when a call has 2–``MAX_ROWS`` rows; Metal and the CPU keep their own paths.
"""

from __future__ import annotations

import math

import mlx.core as mx

#: the most input rows one call takes (from 8 rows MLX's tiled kernel reads the weights once too)
MAX_ROWS = 7
#: the smallest matrix (out × in elements) it takes: below that MLX's kernel fills the GPU better
#: (H200, 1024×4096: 14 µs MLX vs 27 µs here at 4 rows; 12288×4096: 97 vs 53)
MIN_ELEMENTS = 4096 * 4096

SOURCE = r"""
    /* runtime sizes: one compiled kernel per dtype, width and group size serves every matrix and row count */
    const int M = x_shape[0];
    const int K = x_shape[1];
    const long long N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const long long n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  /* one warp per output row */
    if (n >= N) return;
    constexpr int PER_WORD = 32 / BITS_;
    constexpr int VPC = 4 * PER_WORD;          /* values per 16-byte chunk: 16 (8-bit), 32 (4-bit) */
    constexpr int PER_LOAD = 16 / sizeof(T_);  /* inputs per 16-byte load */
    constexpr unsigned int MASK = (1u << BITS_) - 1u;
    const int chunks = K / VPC;
    const int G = K / GS_;
    const uint4* wrow = reinterpret_cast<const uint4*>(w) + n * chunks;
    const S_* srow = scales + n * G;
    const S_* brow = biases + n * G;
    float acc[MAX_M_];
#pragma unroll
    for (int m = 0; m < MAX_M_; ++m) acc[m] = 0.f;
    for (int c = lane; c < chunks; c += 32) {
        const uint4 q = wrow[c];
        const int k0 = c * VPC;
        const float s = static_cast<float>(srow[k0 / GS_]);
        const float b = static_cast<float>(brow[k0 / GS_]);
        const unsigned int words[4] = {q.x, q.y, q.z, q.w};
        float wv[VPC];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < PER_WORD; ++j)
                wv[i * PER_WORD + j] = fmaf(static_cast<float>((words[i] >> (BITS_ * j)) & MASK), s, b);
        }
#pragma unroll
        for (int m = 0; m < MAX_M_; ++m) {  /* x in 16-byte loads: a lane's VPC inputs are contiguous */
            if (m < M) {
                const uint4* xr = reinterpret_cast<const uint4*>(x + (long long)m * K + k0);
                float a = 0.f;
#pragma unroll
                for (int l = 0; l < VPC / PER_LOAD; ++l) {
                    const uint4 raw = xr[l];
                    const T_* xv = reinterpret_cast<const T_*>(&raw);
#pragma unroll
                    for (int j = 0; j < PER_LOAD; ++j) a = fmaf(wv[l * PER_LOAD + j], static_cast<float>(xv[j]), a);
                }
                acc[m] += a;
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MAX_M_; ++m) {
        if (m < M) {
            float v = acc[m];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0) y[(long long)m * N + n] = static_cast<T_>(v);
        }
    }
"""

_KERNEL = None
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
    if not 2 <= rows <= MAX_ROWS or bits not in (4, 8) or group_size not in (32, 64, 128):
        return False
    # whole groups make whole 16-byte chunks (16 or 32 values), and no chunk straddles two groups
    return out_features * in_features >= MIN_ELEMENTS and in_features % group_size == 0


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.cuda_kernel(name="hf2q_qmv_rows", input_names=["x", "w", "scales", "biases"],
                                      output_names=["y"], source=SOURCE)
    return _KERNEL


def qmv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """``x [..., K]`` (2–``MAX_ROWS`` rows) through MLX-packed ``w [N, K·bits/32]`` → ``[..., N]`` in x's dtype."""
    K = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    N = w.shape[0]
    warps_per_block = 4
    (y,) = _kernel()(
        inputs=[x.reshape(rows, K), w, scales, biases],
        template=[("T_", x.dtype), ("S_", scales.dtype), ("MAX_M_", MAX_ROWS), ("BITS_", bits), ("GS_", group_size)],
        grid=(((N + warps_per_block - 1) // warps_per_block) * 32 * warps_per_block, 1, 1),
        threadgroup=(32 * warps_per_block, 1, 1),
        output_shapes=[(rows, N)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], N)
