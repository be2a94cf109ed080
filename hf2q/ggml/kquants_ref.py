"""Plain per-super-block reference for Q2_K … Q6_K (one value at a time, float32 scalars).

A direct reading of llama.cpp's k-quant reference algorithm (``quantize_row_q*_K_ref`` and
the scale searches ``make_qkx2_quants`` / ``make_qx_quants`` / ``make_q3_quants``), kept
as loops so that it is easy to compare line by line with the C.  Slow: tests use it to
check the vectorised ``kquants`` on small inputs.
"""

from __future__ import annotations

import math
import struct
from functools import partial

from .scalar_ref import (
    GROUP_MAX_EPS,
    div,
    f32,
    from_blocks,
    get_half,
    nearest_int,
    put_half,
    to_blocks,
)

QK_K = 256


def make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    """Affine fit x ≈ scale·L + min over integer levels L ∈ [0, nmax]; returns (scale, -min, L)."""
    n = len(x)
    lo, hi = x[0], x[0]
    sum_w = weights[0]
    sum_x = f32(sum_w * x[0])
    for i in range(1, n):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
        sum_w = f32(sum_w + weights[i])
        sum_x = f32(sum_x + f32(weights[i] * x[i]))
    if lo > 0:
        lo = f32(0)
    if hi == lo:
        return f32(0), f32(-lo), [0] * n
    iscale = div(nmax, hi - lo)
    scale = div(1, iscale)
    L = [max(0, min(nmax, nearest_int(f32(iscale * f32(x[i] - lo))))) for i in range(n)]

    def error(sc, mn, levels):
        err = f32(0)
        for i in range(n):
            diff = f32(f32(f32(sc * levels[i]) + mn) - x[i])
            diff = abs(diff) if use_mad else f32(diff * diff)
            err = f32(err + f32(weights[i] * diff))
        return err

    best_error = error(scale, lo, L)
    for step in range(nstep + 1):
        iscale = div(f32(f32(rmin) + f32(f32(rdelta) * step)) + nmax, hi - lo)
        laux = [max(0, min(nmax, nearest_int(f32(iscale * f32(x[i] - lo))))) for i in range(n)]
        sum_l = sum_l2 = sum_xl = f32(0)
        for i in range(n):
            wl = f32(weights[i] * laux[i])
            sum_l = f32(sum_l + wl)
            sum_l2 = f32(sum_l2 + f32(wl * laux[i]))
            sum_xl = f32(sum_xl + f32(wl * x[i]))
        D = f32(f32(sum_w * sum_l2) - f32(sum_l * sum_l))
        if D > 0:
            this_scale = div(f32(sum_w * sum_xl) - f32(sum_x * sum_l), D)
            this_min = div(f32(sum_l2 * sum_x) - f32(sum_l * sum_xl), D)
            if this_min > 0:
                this_min = f32(0)
                this_scale = div(sum_xl, sum_l2)
            cur_error = error(this_scale, this_min, laux)
            if cur_error < best_error:
                L, best_error, scale, lo = laux, cur_error, this_scale, this_min
    return scale, f32(-lo), L


def _first_absmax(x):
    amax, vmax = f32(0), f32(0)
    for v in x:
        if abs(v) > amax:
            amax, vmax = abs(v), v
    return amax, vmax


def make_qx_quants(x, nmax, weights=None):
    """Symmetric fit (rmse_type 1, weights x² unless given): tries 19 scales around -nmax/max."""
    n = len(x)
    amax, vmax = _first_absmax(x)
    if amax < GROUP_MAX_EPS:
        return f32(0), [0] * n

    def fit(iscale):
        levels = [max(-nmax, min(nmax - 1, nearest_int(f32(iscale * v)))) for v in x]
        sumlx = suml2 = f32(0)
        for i, (v, lv) in enumerate(zip(x, levels)):
            w = f32(v * v) if weights is None else weights[i]
            sumlx = f32(sumlx + f32(f32(w * v) * lv))
            suml2 = f32(suml2 + f32(f32(w * lv) * lv))
        return levels, sumlx, suml2

    levels, sumlx, suml2 = fit(div(-nmax, vmax))
    L = [lv + nmax for lv in levels]
    scale = div(sumlx, suml2) if suml2 else f32(0)
    best = f32(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        levels, sumlx, suml2 = fit(div(-f32(nmax + f32(f32(0.1) * step)), vmax))
        if suml2 > 0 and f32(sumlx * sumlx) > f32(best * suml2):
            L = [lv + nmax for lv in levels]
            scale = div(sumlx, suml2)
            best = f32(scale * sumlx)
    return scale, L


def make_q3_quants(x, nmax):
    """Symmetric fit refined one value at a time (weights x², up to 5 passes)."""
    n = len(x)
    amax, vmax = _first_absmax(x)
    if amax < GROUP_MAX_EPS:
        return f32(0), [0] * n
    iscale = div(-nmax, vmax)
    L = []
    sumlx = suml2 = f32(0)
    for v in x:
        lv = max(-nmax, min(nmax - 1, nearest_int(f32(iscale * v))))
        L.append(lv)
        w = f32(v * v)
        sumlx = f32(sumlx + f32(f32(w * v) * lv))
        suml2 = f32(suml2 + f32(f32(w * lv) * lv))
    for _ in range(5):
        changed = 0
        for i, v in enumerate(x):
            w = f32(v * v)
            slx = f32(sumlx - f32(f32(w * v) * L[i]))
            if slx > 0:
                sl2 = f32(suml2 - f32(f32(w * L[i]) * L[i]))
                new_l = max(-nmax, min(nmax - 1, nearest_int(div(f32(v * sl2), slx))))
                if new_l != L[i]:
                    slx = f32(slx + f32(f32(w * v) * new_l))
                    sl2 = f32(sl2 + f32(f32(w * new_l) * new_l))
                    if sl2 > 0 and f32(f32(slx * slx) * suml2) > f32(f32(sumlx * sumlx) * sl2):
                        L[i], sumlx, suml2 = new_l, slx, sl2
                        changed += 1
        if not changed:
            break
    return (div(sumlx, suml2) if suml2 > 0 else f32(0)), [lv + nmax for lv in L]


def _pack_2bit(L):
    return bytes(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)
                 for j in (0, 128) for l in range(32))


def _positive_max(values):
    m = f32(0)
    for v in values:
        m = max(m, v)
    return m


def quantize_block_q2_k(x):
    scales, mins, L = [], [], []
    for j in range(16):
        sub = x[16 * j:16 * j + 16]
        s, m, lv = make_qkx2_quants(sub, [abs(v) for v in sub], 3, -0.5, 0.1, 15, True)
        scales.append(s), mins.append(m), L.extend(lv)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    sc = [0] * 16
    d = dmin = f32(0)
    if max_scale > 0:
        iscale = div(15, max_scale)
        sc = [nearest_int(f32(iscale * s)) & 0xFF for s in scales]
        d = div(max_scale, 15)
    if max_min > 0:
        iscale = div(15, max_min)
        sc = [(sc[j] | (nearest_int(f32(iscale * mins[j])) << 4)) & 0xFF for j in range(16)]
        dmin = div(max_min, 15)
    return finish_q2_k(x, L, sc, d, dmin)


def finish_q2_k(x, L, sc, d, dmin):
    """Store d/dmin as fp16, re-quantize every sub-block against them, pack the 84 bytes."""
    out = bytearray(84)
    put_half(out, 80, d)
    put_half(out, 82, dmin)
    d_all, dmin_all = get_half(out, 80), get_half(out, 82)
    for j in range(16):
        d = f32(d_all * (sc[j] & 0xF))
        if not d:
            continue
        dm = f32(dmin_all * (sc[j] >> 4))
        for i in range(16):
            L[16 * j + i] = max(0, min(3, nearest_int(div(x[16 * j + i] + dm, d))))
    out[0:16] = bytes(sc)
    out[16:80] = _pack_2bit(L)
    return out


def _scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _q45_search(x, nmax, rmin, nstep):
    """Q4_K / Q5_K without imatrix: per-32 affine search, then 6-bit scales/mins from the maxima."""
    scales, mins, L = [], [], []
    for j in range(8):
        sub = x[32 * j:32 * j + 32]
        sum_x2 = f32(0)
        for v in sub:
            sum_x2 = f32(sum_x2 + f32(v * v))
        av_x = f32(math.sqrt(div(sum_x2, 32)))  # sqrt of a float32 is correctly rounded back to float32
        s, m, lv = make_qkx2_quants(sub, [f32(av_x + abs(v)) for v in sub], nmax, rmin, 0.1, nstep, False)
        scales.append(s), mins.append(m), L.extend(lv)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    inv_scale = div(63, max_scale) if max_scale > 0 else f32(0)
    inv_min = div(63, max_min) if max_min > 0 else f32(0)
    ls = [min(63, nearest_int(f32(inv_scale * s)) & 0xFF) for s in scales]
    lm = [min(63, nearest_int(f32(inv_min * m)) & 0xFF) for m in mins]
    return finish_q45(x, L, ls, lm, div(max_scale, 63), div(max_min, 63), nmax)


def finish_q45(x, L, ls, lm, d, dmin, nmax):
    """Pack 6-bit scales/mins, store d/dmin as fp16, re-quantize, pack the levels (Q4_K or Q5_K)."""
    packed = [0] * 12
    for j in range(8):
        if j < 4:
            packed[j], packed[j + 4] = ls[j], lm[j]
        else:
            packed[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            packed[j - 4] = (packed[j - 4] | ((ls[j] >> 4) << 6)) & 0xFF
            packed[j] = (packed[j] | ((lm[j] >> 4) << 6)) & 0xFF
    head = bytearray(4)
    put_half(head, 0, d)
    put_half(head, 2, dmin)
    d_all, dmin_all = get_half(head, 0), get_half(head, 2)
    for j in range(8):
        sc, m = _scale_min_k4(j, packed)
        d = f32(d_all * sc)
        if not d:
            continue
        dm = f32(dmin_all * m)
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, nearest_int(div(x[32 * j + i] + dm, d))))
    head += bytes(packed)
    if nmax == 15:
        return head + bytes(L[j + l] | (L[j + l + 32] << 4) for j in range(0, QK_K, 64) for l in range(32))
    qh, ql = [0] * 32, []
    for n, (m1, m2) in zip(range(0, QK_K, 64), ((1, 2), (4, 8), (16, 32), (64, 128))):
        for j in range(32):
            l1, l2 = L[n + j], L[n + j + 32]
            if l1 > 15:
                l1 -= 16
                qh[j] |= m1
            if l2 > 15:
                l2 -= 16
                qh[j] |= m2
            ql.append(l1 | (l2 << 4))
    return head + bytes(qh) + bytes(ql)


def quantize_block_q4_k(x):
    return _q45_search(x, 15, -1.0, 20)


def quantize_block_q5_k(x):
    return _q45_search(x, 31, -0.5, 15)


def quantize_block_q3_k(x):
    scales, L = [], []
    for j in range(16):
        s, lv = make_q3_quants(x[16 * j:16 * j + 16], 4)
        scales.append(s), L.extend(lv)
    _, max_scale = _first_absmax(scales)
    levels6 = None
    d = f32(0)
    if max_scale:
        iscale = div(-32, max_scale)
        levels6 = []
        for j in range(16):
            l = (nearest_int(f32(iscale * scales[j])) + 128) % 256 - 128  # int8_t
            levels6.append(max(-32, min(31, l)) + 32)
        d = div(1, iscale)
    return finish_q3_k(x, L, levels6, d)


def finish_q3_k(x, L, levels6, d):
    """Pack sixteen 6-bit scales (all-zero bytes when None), store d, re-quantize, pack hmask/qs."""
    packed = [0] * 12
    for j, l in enumerate(levels6 or []):
        if j < 8:
            packed[j] = l & 0xF
        else:
            packed[j - 8] |= (l & 0xF) << 4
        packed[j % 4 + 8] |= (l >> 4) << (2 * (j // 4))
    out = bytearray(110)
    put_half(out, 108, d)
    d_all = get_half(out, 108)
    for j in range(16):
        sc = packed[j] & 0xF if j < 8 else packed[j - 8] >> 4
        sc = (sc | (((packed[8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        d = f32(d_all * sc)
        if not d:
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, nearest_int(div(x[16 * j + i], d)))) + 4
    hmask = [0] * 32
    for j in range(QK_K):
        if L[j] > 3:
            hmask[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    out[0:32] = bytes(hmask)
    out[32:96] = _pack_2bit(L)
    out[96:108] = bytes(packed)
    return out


def quantize_block_q6_k(x, qw=None):
    """Q6_K; ``qw`` (imatrix weights of these 256 values) replace x² in the scale search."""
    scales, L = [], []
    for j in range(16):
        s, lv = make_qx_quants(x[16 * j:16 * j + 16], 32, None if qw is None else qw[16 * j:16 * j + 16])
        scales.append(s), L.extend(lv)
    max_abs, max_scale = _first_absmax(scales)
    out = bytearray(210)
    if max_abs < GROUP_MAX_EPS:
        return out
    iscale = div(-128, max_scale)
    put_half(out, 208, div(1, iscale))
    sc = [min(127, nearest_int(f32(iscale * s))) for s in scales]
    d_all = get_half(out, 208)
    for j in range(16):
        d = f32(d_all * sc[j])
        if not d:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, nearest_int(div(x[16 * j + i], d)))) + 32
    for h in range(2):
        base = 128 * h
        for l in range(32):
            q1, q2, q3, q4 = (L[base + l + 32 * k] for k in range(4))
            out[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            out[64 * h + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            out[128 + 32 * h + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    out[192:208] = struct.pack("<16b", *sc)
    return out


# ------------------------------------------------------------------ dequantize


def _level_2bit(qs, e):
    """Value e's 2-bit level in a Q2_K/Q3_K ``qs`` field."""
    return (qs[32 * (e // 128) + e % 32] >> (2 * ((e % 128) // 32))) & 3


def dequantize_block_q2_k(raw):
    d, dmin = get_half(raw, 80), get_half(raw, 82)
    out = []
    for e in range(QK_K):
        sc = raw[e // 16]
        out.append(f32(f32(f32(d * (sc & 0xF)) * _level_2bit(raw[16:80], e)) - f32(dmin * (sc >> 4))))
    return out


def dequantize_block_q3_k(raw):
    d = get_half(raw, 108)
    packed = raw[96:108]
    out = []
    for e in range(QK_K):
        j = e // 16
        sc = packed[j] & 0xF if j < 8 else packed[j - 8] >> 4
        sc = (sc | (((packed[8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        high = (raw[e % 32] >> (e // 32)) & 1
        q = _level_2bit(raw[32:96], e) - (0 if high else 4)
        out.append(f32(f32(d * sc) * q))
    return out


def _dequantize_q45(raw, level):
    d, dmin = get_half(raw, 0), get_half(raw, 2)
    out = []
    for e in range(QK_K):
        sc, m = _scale_min_k4(e // 32, raw[4:16])
        out.append(f32(f32(f32(d * sc) * level(e)) - f32(dmin * m)))
    return out


def dequantize_block_q4_k(raw):
    return _dequantize_q45(raw, lambda e: (raw[16 + 32 * (e // 64) + e % 32] >> (4 * ((e // 32) % 2))) & 0xF)


def dequantize_block_q5_k(raw):
    def level(e):
        low = (raw[48 + 32 * (e // 64) + e % 32] >> (4 * ((e // 32) % 2))) & 0xF
        return low + (16 if raw[16 + e % 32] & (1 << (e // 32)) else 0)
    return _dequantize_q45(raw, level)


def dequantize_block_q6_k(raw):
    d = get_half(raw, 208)
    sc = struct.unpack_from("<16b", raw, 192)
    out = [f32(0)] * QK_K
    for h in range(2):
        for l in range(32):
            ql0, ql1, qh = raw[64 * h + l], raw[64 * h + l + 32], raw[128 + 32 * h + l]
            qs = ((ql0 & 0xF) | ((qh & 3) << 4), (ql1 & 0xF) | (((qh >> 2) & 3) << 4),
                  (ql0 >> 4) | (((qh >> 4) & 3) << 4), (ql1 >> 4) | (((qh >> 6) & 3) << 4))
            for k in range(4):
                e = 128 * h + 32 * k + l
                out[e] = f32(f32(d * sc[e // 16]) * (qs[k] - 32))
    return out


_SIZES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_Q = {"Q2_K": quantize_block_q2_k, "Q3_K": quantize_block_q3_k, "Q4_K": quantize_block_q4_k,
      "Q5_K": quantize_block_q5_k, "Q6_K": quantize_block_q6_k}
_D = {"Q2_K": dequantize_block_q2_k, "Q3_K": dequantize_block_q3_k, "Q4_K": dequantize_block_q4_k,
      "Q5_K": dequantize_block_q5_k, "Q6_K": dequantize_block_q6_k}


def _quantize_blocks(name, x):
    return to_blocks(lambda b: _Q[name](list(b)), x, _SIZES[name])


def _dequantize_blocks(name, raw):
    return from_blocks(_D[name], raw, QK_K)


QUANTIZE = {name: partial(_quantize_blocks, name) for name in _Q}
DEQUANTIZE = {name: partial(_dequantize_blocks, name) for name in _D}
