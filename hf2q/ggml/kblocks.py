"""Block layouts of the k-quants (Q2_K … Q6_K): bit packing and the vectorised dequantizers.

Field order and bit positions follow ggml-common.h; dequantization repeats the C's float32
operations (``d * scale * q - d_min * min``) in the same order, so results are bit-identical
to llama.cpp's ``dequantize_row_q*_K``.
"""

from __future__ import annotations

import numpy as np

from .common import F32, half_to_f32

QK_K = 256
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def as_columns(x: np.ndarray, n: int) -> np.ndarray:
    """[nsb, 256] super-blocks → [n, nsb*256/n] sub-blocks as contiguous columns."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def from_columns(a: np.ndarray, nsb: int) -> np.ndarray:
    """Inverse of ``as_columns``: [n, n_sub] → [nsb, 256]."""
    return np.ascontiguousarray(a.T).reshape(nsb, QK_K)


def pack_2bit(L: np.ndarray) -> np.ndarray:
    """[nsb, 256] levels 0..3 → [nsb, 64]: byte 32h+l holds values 128h+l+32k at bits 2k."""
    q = L.astype(np.uint8).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def unpack_2bit(qs: np.ndarray) -> np.ndarray:
    q = qs.reshape(-1, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((q >> shifts) & 3).reshape(-1, QK_K)


def pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins → the 12-byte ``scales`` field of Q4_K / Q5_K."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    lo = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    mid = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    hi = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return np.concatenate([lo, mid, hi], axis=1)


def unpack_scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = s.astype(np.uint8)
    ls = np.concatenate([s[:, :4] & 63, (s[:, 8:] & 0xF) | ((s[:, :4] >> 6) << 4)], axis=1)
    lm = np.concatenate([s[:, 4:8] & 63, (s[:, 8:] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return ls, lm


def pack_q3_scales(l: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit values → Q3_K's 12-byte scales (low nibbles, then 2-bit high parts)."""
    l = l.astype(np.uint8)
    low = (l[:, :8] & 0xF) | ((l[:, 8:] & 0xF) << 4)
    hi = (l >> 4).reshape(-1, 4, 4)  # [nsb, j//4, j%4]
    high = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return np.concatenate([low, high], axis=1)


def unpack_q3_scales(s: np.ndarray) -> np.ndarray:
    low = np.concatenate([s[:, :8] & 0xF, s[:, :8] >> 4], axis=1)
    hi = (s[:, 8:12][:, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3  # [nsb, j//4, j%4]
    return (low | (hi.reshape(-1, 16) << 4)).astype(np.int32) - 32


# ------------------------------------------------------------------ dequantize


def dequantize_q2_k(b: np.ndarray) -> np.ndarray:
    sc = b[:, :16]
    q = unpack_2bit(b[:, 16:80]).astype(F32).reshape(-1, 16, 16)
    d, dmin = half_to_f32(b[:, 80:82]), half_to_f32(b[:, 82:84])
    dl = d[:, None] * (sc & 0xF).astype(F32)
    ml = dmin[:, None] * (sc >> 4).astype(F32)
    return (dl[..., None] * q - ml[..., None]).reshape(-1, QK_K)


def dequantize_q3_k(b: np.ndarray) -> np.ndarray:
    hmask, qs = b[:, :32], b[:, 32:96]
    sc = unpack_q3_scales(b[:, 96:108]).astype(F32)
    d = half_to_f32(b[:, 108:110])
    high = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [nsb, 8, 32]
    q = unpack_2bit(qs).astype(np.int32) - np.where(high.reshape(-1, QK_K) != 0, 0, 4)
    dl = d[:, None] * sc
    return (dl[..., None] * q.astype(F32).reshape(-1, 16, 16)).reshape(-1, QK_K)


def _dequantize_q45(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    d, dmin = half_to_f32(b[:, 0:2]), half_to_f32(b[:, 2:4])
    ls, lm = unpack_scale_min_k4(b[:, 4:16])
    d1 = d[:, None] * ls.astype(F32)
    m1 = dmin[:, None] * lm.astype(F32)
    return (d1[..., None] * q.astype(F32).reshape(-1, 8, 32) - m1[..., None]).reshape(-1, QK_K)


def dequantize_q4_k(b: np.ndarray) -> np.ndarray:
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF
    return _dequantize_q45(b, q)


def dequantize_q5_k(b: np.ndarray) -> np.ndarray:
    qh, qs = b[:, 16:48], b[:, 48:176].reshape(-1, 4, 1, 32)
    low = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # bit k ↔ sub-block k
    q = low.reshape(-1, 8, 32).astype(np.int32) + 16 * high.astype(np.int32)
    return _dequantize_q45(b, q)


def dequantize_q6_k(b: np.ndarray) -> np.ndarray:
    ql = b[:, :128].reshape(-1, 2, 2, 32)  # [nsb, half, k%2, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(F32)
    d = half_to_f32(b[:, 208:210])
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2)  # k = 0..3 ↔ (ql[l]&F, ql[l+32]&F, ql[l]>>4, ql[l+32]>>4)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    q = (low.astype(np.int32) | (high.astype(np.int32) << 4)) - 32
    return ((d[:, None] * sc)[..., None] * q.astype(F32).reshape(-1, 16, 16)).reshape(-1, QK_K)


DEQUANTIZE = {"Q2_K": dequantize_q2_k, "Q3_K": dequantize_q3_k, "Q4_K": dequantize_q4_k,
              "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k}
