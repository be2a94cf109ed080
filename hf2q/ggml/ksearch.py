"""Vectorised scale searches of llama.cpp's k-quants (``make_qkx2/3_quants``, ``make_qx_quants``,
``make_q3_quants``), run for every sub-block of a chunk at once.

Sub-blocks are columns (``[values_per_subblock, n_subblocks]``) so that element-wise float32
work is contiguous and every C accumulator becomes an in-order ``seq_sum`` over axis 0.
Per-sub-block branches ("keep this candidate if its error is lower") become ``np.where``
masks.  Iterative searches that stop early in C when a pass changes nothing run all passes
here: an unchanged state yields an unchanged pass, so the result is the same.
"""

from __future__ import annotations

import numpy as np

from .common import F32, GROUP_MAX_EPS, nearest_int, seq_sum, take


def first_extreme(x: np.ndarray, axis: int, kind: str) -> np.ndarray:
    idx = np.argmin(x, axis=axis) if kind == "min" else np.argmax(x, axis=axis)
    return take(x, idx, axis)


def positive_max(a: np.ndarray) -> np.ndarray:
    """``m = 0; for v: if (v > m) m = v`` along the last axis (a NaN never wins a C comparison)."""
    m = np.fmax.reduce(a, axis=-1)
    return np.where(m > 0, m, F32(0.0)).astype(F32)


def signed_absmax(a: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(largest |v|, the first v achieving it) — +0 / +0 when everything is zero, like the C scan."""
    ab = np.abs(a)
    if np.isnan(ab).any():  # only derived values (overflowed scales) can be NaN; C's `>` skips them
        ab = np.where(np.isnan(ab), F32(-1.0), ab)
    idx = np.argmax(ab, axis=axis)
    amax = take(ab, idx, axis)
    return amax, np.where(amax > 0, take(a, idx, axis), F32(0.0)).astype(F32)


def round_levels(v: np.ndarray, lo: int, hi: int, exact_needed: bool) -> np.ndarray:
    """``clamp(nearest_int(v), lo, hi)`` as float32, in place on ``v`` when no value can exceed ±2**22.

    Inside ±2**22 ``nearest_int`` is exactly round-half-even (``np.rint``); outside it wraps,
    so the caller says (from a per-column bound) whether the slow exact path is needed.
    """
    if exact_needed:
        return np.clip(nearest_int(v), lo, hi).astype(F32)
    np.rint(v, out=v)
    return np.clip(v, F32(lo), F32(hi), out=v)


def make_qkx2(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """Affine (scale, -min) search of ``make_qkx2_quants`` for every column of ``x``.

    Returns (scale[n_sub], the_min[n_sub], L[n, n_sub] float32 levels 0..nmax).
    """
    xmin = first_extreme(x, 0, "min")
    mx = first_extreme(x, 0, "max")
    sum_w = seq_sum(w)
    sum_x = seq_sum(w * x)
    mn = np.where(xmin > 0, F32(0.0), xmin).astype(F32)
    flat = mx == mn
    fmax = F32(nmax)
    buf, tmp, tmp2 = np.empty_like(x), np.empty_like(x), np.empty_like(x)

    def levels(iscale, mn, out):
        # |iscale·(x - mn)| is bounded per column by the extremes of x; flat columns are discarded later.
        bound = np.abs(iscale) * np.maximum(np.abs(mx - mn), np.abs(xmin - mn))
        exact = bool(np.any(~flat & ~(bound < F32(4e6))))
        np.subtract(x, mn, out=out)
        out *= iscale
        return round_levels(out, 0, nmax, exact)

    def error(scale, mn, lv):
        d = np.multiply(lv, scale, out=tmp)
        d += mn
        d -= x
        if use_mad:
            np.abs(d, out=d)
        else:
            d *= d
        d *= w
        return seq_sum(d)

    iscale = fmax / (mx - mn)
    scale = F32(1.0) / iscale
    L = levels(iscale, mn, np.empty_like(x)).copy()
    best = error(scale, mn, L)
    for step in range(nstep + 1):
        iscale = ((F32(rmin) + F32(rdelta) * F32(step)) + fmax) / (mx - mn)
        la = levels(iscale, mn, buf)
        np.multiply(w, la, out=tmp)
        sum_l = seq_sum(tmp)
        sum_xl = seq_sum(np.multiply(tmp, x, out=tmp2))
        tmp *= la
        sum_l2 = seq_sum(tmp)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos_min = this_min > 0
        this_min = np.where(pos_min, F32(0.0), this_min).astype(F32)
        this_scale = np.where(pos_min, sum_xl / sum_l2, this_scale).astype(F32)
        cur = error(this_scale, this_min, la)
        better = (D > 0) & (cur < best)
        if better.any():
            best = np.where(better, cur, best)
            np.copyto(L, la, where=better[None, :])
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    L[:, flat] = 0
    scale = np.where(flat, F32(0.0), scale).astype(F32)
    return scale, (-mn).astype(F32), L


def make_qx(x, nmax: int, w=None):
    """Symmetric scale search of ``make_qx_quants`` (rmse_type 1) per column.

    ``w`` are the per-value weights (``x²`` when omitted, as in the no-imatrix path).
    Returns (scale[n_sub], L[n, n_sub] float32 levels 0..2*nmax-1).
    """
    amax, mx = signed_absmax(x, 0)
    zero = amax < GROUP_MAX_EPS
    w = x * x if w is None else w
    wx = w * x

    def levels(iscale):
        # |iscale·x| <= nmax + 1 because mx is the largest magnitude; all-zero columns are masked below.
        return round_levels(iscale * x, -nmax, nmax - 1, exact_needed=False)

    l = levels(F32(-nmax) / mx)
    L = l + F32(nmax)
    sumlx, suml2 = seq_sum(wx * l), seq_sum((w * l) * l)
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0.0)).astype(F32)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        l = levels(-(F32(nmax) + F32(0.1) * F32(step)) / mx)
        sumlx, suml2 = seq_sum(wx * l), seq_sum((w * l) * l)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        if better.any():
            L = np.where(better, l + F32(nmax), L)
            new_scale = sumlx / suml2
            scale = np.where(better, new_scale, scale).astype(F32)
            best = np.where(better, new_scale * sumlx, best).astype(F32)
    return np.where(zero, F32(0.0), scale).astype(F32), np.where(zero, F32(0.0), L)


def make_q3(x, nmax: int = 4):
    """``make_q3_quants`` with do_rmse: greedy per-value refinement (5 passes) per column.

    Returns (scale[n_sub], L[n, n_sub] float32 levels 0..2*nmax-1).
    """
    amax, mx = signed_absmax(x, 0)
    zero = amax < GROUP_MAX_EPS
    L = np.clip(nearest_int((F32(-nmax) / mx) * x), -nmax, nmax - 1).astype(F32)
    w = x * x
    wx = w * x
    sumlx, suml2 = seq_sum(wx * L), seq_sum((w * L) * L)
    for _ in range(5):
        for i in range(x.shape[0]):
            li = L[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - (w[i] * li) * li
            new_l = np.clip(nearest_int((x[i] * sl2) / slx), -nmax, nmax - 1).astype(F32)
            slx_new = slx + wx[i] * new_l
            sl2_new = sl2 + (w[i] * new_l) * new_l
            accept = ((slx > 0) & (new_l != li) & (sl2_new > 0)
                      & ((slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new))
            L[i] = np.where(accept, new_l, li)
            sumlx = np.where(accept, slx_new, sumlx).astype(F32)
            suml2 = np.where(accept, sl2_new, suml2).astype(F32)
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0.0)).astype(F32)
    return np.where(zero, F32(0.0), scale).astype(F32), np.where(zero, F32(0.0), L + F32(nmax))


