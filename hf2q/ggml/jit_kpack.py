"""Compiled back halves of the k-quants: super-block scales → fp16 → re-quantize → bytes.

After the per-sub-block scale search (``jit_lanes`` / ``jit_ksearch``), llama.cpp
stores the super-block scale(s) as fp16, re-quantizes every value against the scale that
was actually stored, and packs levels and 4/6-bit sub-block scales into the block layout
of ggml-common.h.  These loops do that for one super-block ``x`` (256 float32) into
``out`` (its bytes); ``kquants_ref.finish_*`` are the readable twins.
"""

# ruff: noqa: FURB136  (explicit comparisons keep C's NaN behaviour, which min()/max() would not)

from __future__ import annotations

import numpy as np

from .jit_common import GROUP_MAX_EPS, kernel, nearest_int, store_half

QK_K = 256


@kernel("void(int64[::1], uint8[::1], int64)")
def pack_2bit(L, out, off):
    """256 two-bit levels → 64 bytes: byte l of each 128-half holds values l, l+32, l+64, l+96."""
    for half in range(2):
        j = 128 * half
        for l in range(32):
            out[off + 32 * half + l] = (L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4)
                                        | (L[j + l + 96] << 6)) & 0xFF


@kernel("void(float32[::1], int64[::1], int64[::1], float32, float32, uint8[::1])")
def finish_q2_k(x, L, sc, d, dmin, out):
    for j in range(16):
        out[j] = sc[j]
    d_all = store_half(out, 80, d)
    dmin_all = store_half(out, 82, dmin)
    for j in range(16):
        dd = np.float32(d_all * np.float32(sc[j] & 0xF))
        if dd == 0:
            continue
        dm = np.float32(dmin_all * np.float32(sc[j] >> 4))
        for i in range(16):
            lv = nearest_int(np.float32(np.float32(x[16 * j + i] + dm) / dd))
            L[16 * j + i] = 0 if lv < 0 else (3 if lv > 3 else lv)
    pack_2bit(L, out, 16)


@kernel("UniTuple(int64, 2)(int64, int64[::1])")
def _scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


@kernel("void(float32[::1], int64[::1], int64[::1], int64[::1], float32, float32, int64, int64[::1], uint8[::1])")
def finish_q45(x, L, ls, lm, d, dmin, nmax, packed, out):
    """Pack 6-bit scales/mins (12 bytes), store d/dmin, re-quantize, pack levels (Q4_K or Q5_K)."""
    for j in range(12):
        packed[j] = 0
    for j in range(8):
        if j < 4:
            packed[j] = ls[j] & 0xFF
            packed[j + 4] = lm[j] & 0xFF
        else:
            packed[j + 4] = ((ls[j] & 0xF) | ((lm[j] & 0xF) << 4)) & 0xFF
            packed[j - 4] = (packed[j - 4] | ((ls[j] >> 4) << 6)) & 0xFF
            packed[j] = (packed[j] | ((lm[j] >> 4) << 6)) & 0xFF
    d_all = store_half(out, 0, d)
    dmin_all = store_half(out, 2, dmin)
    for j in range(12):
        out[4 + j] = packed[j]
    for j in range(8):
        sc, m = _scale_min_k4(j, packed)
        dd = np.float32(d_all * np.float32(sc))
        if dd == 0:
            continue
        dm = np.float32(dmin_all * np.float32(m))
        for i in range(32):
            lv = nearest_int(np.float32(np.float32(x[32 * j + i] + dm) / dd))
            L[32 * j + i] = 0 if lv < 0 else (nmax if lv > nmax else lv)
    if nmax == 15:
        for n in range(0, QK_K, 64):
            for l in range(32):
                out[16 + n // 2 + l] = L[n + l] | (L[n + l + 32] << 4)
        return
    for j in range(32):
        out[16 + j] = 0
    for n in range(0, QK_K, 64):
        m1 = 1 << (n // 32)
        m2 = 2 << (n // 32)
        for j in range(32):
            l1 = L[n + j]
            l2 = L[n + j + 32]
            if l1 > 15:
                l1 -= 16
                out[16 + j] |= m1
            if l2 > 15:
                l2 -= 16
                out[16 + j] |= m2
            out[48 + n // 2 + j] = l1 | (l2 << 4)


@kernel("void(float32[::1], int64[::1], int64[::1], float32, int64[::1], uint8[::1])")
def finish_q3_k(x, L, levels6, d, packed, out):
    """Pack sixteen 6-bit scales, store d, re-quantize to -4..3, pack hmask and the low 2 bits."""
    for j in range(12):
        packed[j] = 0
    for j in range(16):
        l = levels6[j]
        if j < 8:
            packed[j] = l & 0xF
        else:
            packed[j - 8] |= (l & 0xF) << 4
        packed[j % 4 + 8] |= (l >> 4) << (2 * (j // 4))
    for j in range(12):
        packed[j] &= 0xFF
    d_all = store_half(out, 108, d)
    for j in range(16):
        sc = packed[j] & 0xF if j < 8 else packed[j - 8] >> 4
        sc = (sc | (((packed[8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        dd = np.float32(d_all * np.float32(sc))
        if dd == 0:
            continue
        for i in range(16):
            lv = nearest_int(np.float32(x[16 * j + i] / dd))
            L[16 * j + i] = (-4 if lv < -4 else (3 if lv > 3 else lv)) + 4
    for j in range(32):
        out[j] = 0
    for j in range(QK_K):
        if L[j] > 3:
            out[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    pack_2bit(L, out, 32)
    for j in range(12):
        out[96 + j] = packed[j]




@kernel("void(float32[::1], int64[::1], float32[::1], uint8[::1])")
def finish_q6_k(x, L, scales, out):
    """Q6_K: one fp16 scale for the sixteen int8 sub-block scales, levels -32..31 in 4+2 bits."""
    max_abs = np.float32(0.0)
    max_scale = np.float32(0.0)
    for j in range(16):
        if abs(scales[j]) > max_abs:
            max_abs = abs(scales[j])
            max_scale = scales[j]
    if max_abs < GROUP_MAX_EPS:
        for i in range(210):
            out[i] = 0
        return
    iscale = np.float32(np.float32(-128) / max_scale)
    d_all = store_half(out, 208, np.float32(np.float32(1.0) / iscale))
    for j in range(16):
        sc = nearest_int(np.float32(iscale * scales[j]))
        sc = 127 if sc > 127 else sc
        out[192 + j] = sc & 0xFF
        dd = np.float32(d_all * np.float32(sc))
        if dd == 0:
            continue
        for i in range(16):
            lv = nearest_int(np.float32(x[16 * j + i] / dd))
            L[16 * j + i] = (-32 if lv < -32 else (31 if lv > 31 else lv)) + 32
    for h in range(2):
        base = 128 * h
        for l in range(32):
            q1 = L[base + l]
            q2 = L[base + l + 32]
            q3 = L[base + l + 64]
            q4 = L[base + l + 96]
            out[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            out[64 * h + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            out[128 + 32 * h + l] = ((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)) & 0xFF
