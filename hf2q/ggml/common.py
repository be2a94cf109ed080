"""Bit-exact float32 building blocks shared by the vectorised GGML codecs.

llama.cpp's reference quantizers are C compiled without fast-math and (for ggml-base)
without FMA: every ``a*b + c`` is a rounded float32 product followed by a rounded add, and
loops accumulate strictly left to right.  These helpers reproduce exactly that on numpy
float32 arrays, so that the vectorised code and the C agree bit for bit:

* ``nearest_int`` is llama.cpp's magic-number rounding (add 1.5·2**23, read the mantissa),
  which is round-half-even inside ±2**22 and a deterministic wrap outside it;
* ``seq_sum`` accumulates along axis 0 in index order (``np.sum`` on a contiguous axis is
  pairwise and would round differently);
* ``fp16_bits`` / ``bf16_bits`` are ggml's float → half / bfloat16 rounding rules.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
MAGIC = F32(12582912.0)  # 1.5 * 2**23
GROUP_MAX_EPS = F32(1e-15)


def nearest_int(f: np.ndarray) -> np.ndarray:
    """llama.cpp ``nearest_int`` on a float32 array → int32 array (exact, including its overflow wrap)."""
    bits = (np.asarray(f, dtype=F32) + MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum along axis 0 strictly in index order (float32), like a C ``for`` loop accumulator."""
    a = np.ascontiguousarray(a)
    if a.ndim == 1 or a[0].size == 1:
        # a lone column would be reduced pairwise (8-way unrolled); a running sum is strictly in order
        return np.cumsum(a, axis=0, dtype=a.dtype)[-1]
    # numpy reduces the outer axis of a C-contiguous array row by row: out += a[i] for i in order.
    return np.add.reduce(a, axis=0, dtype=a.dtype)


def take(a: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    """``a`` at one index per lane along ``axis`` (the axis is dropped)."""
    return np.take_along_axis(a, np.expand_dims(idx, axis), axis=axis).squeeze(axis)


def fp16_bits(x: np.ndarray) -> np.ndarray:
    """ggml's float32 → float16 (round to nearest even; NaN → 0x7E00 with the sign kept) as uint16."""
    x = np.asarray(x, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore"):
        h = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        sign = (x.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
        h = np.where(nan, sign | np.uint16(0x7E00), h)
    return h


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """ggml's float32 → bfloat16: round to nearest even on the bit pattern; NaN made quiet."""
    u = np.asarray(x, dtype=F32).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded = np.where(nan, ((u >> 16) | np.uint32(64)).astype(np.uint16), rounded)
    return rounded


def half_to_f32(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes (last axis of length 2) → float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(F32)


def u16_bytes(h: np.ndarray) -> np.ndarray:
    """uint16 array [...] → its little-endian bytes [..., 2]."""
    return np.ascontiguousarray(h.astype("<u2")).view(np.uint8).reshape(*h.shape, 2)
