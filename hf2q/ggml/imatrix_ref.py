"""Plain per-block reference of the importance-matrix quantizers (cross-checks ``imatrix``).

Transcribes llama.cpp's ``quantize_row_q*_impl`` paths taken when ``quant_weights`` is given:
σ²-scaled importance weights, ``make_qkx3_quants`` (= our ``make_qkx2_quants`` with the
weights passed in), weighted ``make_qx_quants`` and ``make_qp_quants`` for the scales.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from .kquants_ref import (
    QK_K,
    finish_q2_k,
    finish_q3_k,
    finish_q45,
    make_qkx2_quants,
    make_qx_quants,
    quantize_block_q6_k,
)
from .legacy_ref import _nibbles, _qh
from .scalar_ref import GROUP_MAX_EPS, div, f32, nearest_int, put_half


def make_qp_quants(x, nmax, w):
    """Weighted fit of non-negative ``x`` to levels 0..nmax: pick the best of 9 scales, then refine."""
    n = len(x)
    mx = f32(0)
    for v in x:
        mx = max(v, mx)
    if mx < GROUP_MAX_EPS:
        return f32(0), [0] * n
    iscale = div(nmax, mx)
    L = [nearest_int(f32(iscale * v)) & 0xFF for v in x]  # stored in uint8_t

    def mse(scale, levels):
        err = f32(0)
        for v, lv, wi in zip(x, levels, w):
            diff = f32(v - f32(scale * lv))
            err = f32(err + f32(f32(wi * diff) * diff))
        return err

    best = mse(div(1, iscale), L)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_is = div(f32(f32(0.1) * step) + nmax, mx)
        cur = mse(div(1, iscale_is), [min(nmax, nearest_int(f32(iscale_is * v))) for v in x])
        if cur < best:
            best, iscale = cur, iscale_is
    sumlx = suml2 = f32(0)
    for i, v in enumerate(x):
        lv = min(nmax, nearest_int(f32(iscale * v)))
        L[i] = lv & 0xFF
        sumlx = f32(sumlx + f32(f32(w[i] * v) * lv))
        suml2 = f32(suml2 + f32(f32(w[i] * lv) * lv))
    for _ in range(5):
        changed = 0
        for i, v in enumerate(x):
            slx = f32(sumlx - f32(f32(w[i] * v) * L[i]))
            sl2 = f32(suml2 - f32(f32(w[i] * L[i]) * L[i]))
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(div(f32(v * sl2), slx)))
                if new_l != L[i]:
                    slx = f32(slx + f32(f32(w[i] * v) * new_l))
                    sl2 = f32(sl2 + f32(f32(w[i] * new_l) * new_l))
                    if f32(f32(slx * slx) * suml2) > f32(f32(sumlx * sumlx) * sl2):
                        L[i], sumlx, suml2 = new_l & 0xFF, slx, sl2
                        changed += 1
        if not changed:
            break
    return (div(sumlx, suml2) if suml2 > 0 else f32(0)), L


def _importance(x, qw, sigma2):
    return [f32(qw[i] * f32(math.sqrt(f32(sigma2 + f32(v * v))))) for i, v in enumerate(x)]


def _sigma2(x, factor):
    total = f32(0)
    for v in x:
        total = f32(total + f32(v * v))
    return div(f32(factor * total), QK_K) if factor != 1 else div(total, QK_K)


def _sum(values):
    total = f32(0)
    for v in values:
        total = f32(total + v)
    return total


def quantize_block_q2_k(x, qw):
    w = _importance(x, qw, _sigma2(x, 1))
    scales, mins, sw, L = [], [], [], []
    for j in range(16):
        wj = w[16 * j:16 * j + 16]
        sw.append(_sum(wj))
        s, m, lv = make_qkx2_quants(x[16 * j:16 * j + 16], wj, 3, -0.9, 0.05, 36, False)
        scales.append(s), mins.append(m), L.extend(lv)
    dm, Ls = make_qp_quants(scales, 15, sw)
    mm, Lm = make_qp_quants(mins, 15, sw)
    return finish_q2_k(x, L, [(Ls[j] | (Lm[j] << 4)) & 0xFF for j in range(16)], dm, mm)


def quantize_block_q3_k(x, qw):
    w = _importance(x, qw, _sigma2(x, 2))
    scales, sw, L = [], [], []
    for j in range(16):
        wj = w[16 * j:16 * j + 16]
        sw.append(_sum(wj))
        s, lv = make_qx_quants(x[16 * j:16 * j + 16], 4, wj)
        scales.append(s), L.extend(lv)
    d_block, Ls = make_qx_quants(scales, 32, sw)
    return finish_q3_k(x, L, Ls, d_block)


def _quantize_block_q45(x, qw, nmax):
    w = _importance(x, qw, _sigma2(x, 2))
    scales, mins, sw, L = [], [], [], []
    for j in range(8):
        wj = w[32 * j:32 * j + 32]
        sw.append(_sum(wj))
        s, m, lv = make_qkx2_quants(x[32 * j:32 * j + 32], wj, nmax, -0.9, 0.05, 36, False)
        scales.append(s), mins.append(m), L.extend(lv)
    d_block, Ls = make_qp_quants(scales, 63, sw)
    m_block, Lm = make_qp_quants(mins, 63, sw)
    if nmax == 31:  # Q5_K clamps the 6-bit fields; Q4_K does not
        Ls, Lm = [min(63, v) for v in Ls], [min(63, v) for v in Lm]
    return finish_q45(x, L, Ls, Lm, d_block, m_block, nmax)


def row_sigma2(x: np.ndarray) -> np.ndarray:
    """Σx² / n_per_row for every row (the legacy types' σ²)."""
    out = []
    for row in np.asarray(x, dtype=np.float32):
        out.append(div(_sum(f32(v * v) for v in row), len(row)))
    return np.array(out, dtype=np.float32)


def _legacy_block(x, qw, sigma2, kind):
    w = _importance(x, qw, sigma2)
    out = bytearray({"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}[kind])
    if kind in ("Q4_0", "Q5_0"):
        d, L = make_qx_quants(x, 8 if kind == "Q4_0" else 16, w)
        put_half(out, 0, d)
        body = _nibbles(L) if kind == "Q4_0" else _qh(L) + _nibbles(L)
        out[2:] = body
        return out
    d, the_min, L = make_qkx2_quants(x, w, 15 if kind == "Q4_1" else 31, -0.9, 0.05, 36, False)
    put_half(out, 0, d)
    put_half(out, 2, -the_min)
    out[4:] = _nibbles(L) if kind == "Q4_1" else _qh(L) + _nibbles(L)
    return out


def _blocks(fn, nbytes, x, weights, sigma2=None):
    out = np.zeros((x.shape[0], nbytes), dtype=np.uint8)
    with np.errstate(all="ignore"):
        for i in range(x.shape[0]):
            args = (list(np.asarray(x[i], np.float32)), list(np.asarray(weights[i], np.float32)))
            if sigma2 is not None:
                args += (f32(sigma2[i]),)
            out[i] = np.frombuffer(bytes(fn(*args)), dtype=np.uint8)
    return out


K_QUANTIZE = {
    "Q2_K": partial(_blocks, quantize_block_q2_k, 84),
    "Q3_K": partial(_blocks, quantize_block_q3_k, 110),
    "Q4_K": partial(_blocks, lambda x, w: _quantize_block_q45(x, w, 15), 144),
    "Q5_K": partial(_blocks, lambda x, w: _quantize_block_q45(x, w, 31), 176),
    "Q6_K": partial(_blocks, quantize_block_q6_k, 210),
}
LEGACY_QUANTIZE = {name: partial(_blocks, partial(_legacy_block, kind=name), size)
                   for name, size in (("Q4_0", 18), ("Q4_1", 20), ("Q5_0", 22), ("Q5_1", 24))}
