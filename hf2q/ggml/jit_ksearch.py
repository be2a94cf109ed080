"""Compiled scale searches of llama.cpp's quantizers, one sub-block at a time (numba).

``make_qx`` (``make_qx_quants``, rmse_type 1), ``make_q3`` (``make_q3_quants`` with rmse)
and ``make_qp`` (``make_qp_quants``) written as the plain loops of the C, float32
throughout — for the searches that run once per super-block on its 8 or 16 sub-block
scales, and for ``make_q3``, whose greedy refinement usually stops after a pass or two:
side by side in lanes (``jit_lanes``) every lane would run every pass, which measured
slower.  Each takes 1-D float32 views, writes the chosen integer levels into ``L``
(int64, same length) using ``scratch`` (int64, same length) for candidates, and returns
the scale(s).  ``kquants_ref`` / ``imatrix_ref`` are the readable Python twins.
"""

# ruff: noqa: FURB136  (explicit comparisons keep C's NaN behaviour, which min()/max() would not)

from __future__ import annotations

import numpy as np

from .jit_common import GROUP_MAX_EPS, ONE, ZERO, first_absmax, kernel, nearest_int


@kernel("UniTuple(float32, 2)(float32[::1], float32[::1], boolean, int64, float32, int64[::1])")
def _symmetric_fit(x, w, has_w, nmax, iscale, out):
    """Levels clamp(nearest_int(iscale·x), -nmax, nmax-1) into ``out``; returns (Σw·x·l, Σw·l²)."""
    sumlx = ZERO
    suml2 = ZERO
    for i in range(x.shape[0]):
        lv = nearest_int(np.float32(iscale * x[i]))
        lv = -nmax if lv < -nmax else (nmax - 1 if lv > nmax - 1 else lv)
        out[i] = lv
        wi = w[i] if has_w else np.float32(x[i] * x[i])
        lf = np.float32(lv)
        sumlx = np.float32(sumlx + np.float32(np.float32(wi * x[i]) * lf))
        suml2 = np.float32(suml2 + np.float32(np.float32(wi * lf) * lf))
    return sumlx, suml2


@kernel("float32(float32[::1], int64, float32[::1], boolean, int64[::1], int64[::1])")
def make_qx(x, nmax, w, has_w, L, scratch):
    """Symmetric fit (weights x² unless ``has_w``) trying 19 scales around -nmax/max; L in [0, 2·nmax)."""
    n = x.shape[0]
    amax, vmax = first_absmax(x)
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return ZERO
    fmax = np.float32(nmax)
    sumlx, suml2 = _symmetric_fit(x, w, has_w, nmax, np.float32(-fmax / vmax), L)
    for i in range(n):
        L[i] += nmax
    scale = np.float32(sumlx / suml2) if suml2 != 0 else ZERO
    best = np.float32(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = np.float32(-np.float32(fmax + np.float32(np.float32(0.1) * np.float32(step))) / vmax)
        sumlx, suml2 = _symmetric_fit(x, w, has_w, nmax, iscale, scratch)
        if suml2 > 0 and np.float32(sumlx * sumlx) > np.float32(best * suml2):
            for i in range(n):
                L[i] = scratch[i] + nmax
            scale = np.float32(sumlx / suml2)
            best = np.float32(scale * sumlx)
    return scale


@kernel("float32(float32[::1], int64, int64[::1])")
def make_q3(x, nmax, L):
    """Symmetric fit (weights x²) refined one value at a time, up to 5 passes; L in [0, 2·nmax)."""
    n = x.shape[0]
    amax, vmax = first_absmax(x)
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return ZERO
    iscale = np.float32(-np.float32(nmax) / vmax)
    sumlx = ZERO
    suml2 = ZERO
    for i in range(n):
        lv = nearest_int(np.float32(iscale * x[i]))
        lv = -nmax if lv < -nmax else (nmax - 1 if lv > nmax - 1 else lv)
        L[i] = lv
        w = np.float32(x[i] * x[i])
        lf = np.float32(lv)
        sumlx = np.float32(sumlx + np.float32(np.float32(w * x[i]) * lf))
        suml2 = np.float32(suml2 + np.float32(np.float32(w * lf) * lf))
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = np.float32(x[i] * x[i])
            cur = np.float32(L[i])
            slx = np.float32(sumlx - np.float32(np.float32(w * x[i]) * cur))
            if slx > 0:
                sl2 = np.float32(suml2 - np.float32(np.float32(w * cur) * cur))
                new_l = nearest_int(np.float32(np.float32(x[i] * sl2) / slx))
                new_l = -nmax if new_l < -nmax else (nmax - 1 if new_l > nmax - 1 else new_l)
                if new_l != L[i]:
                    nf = np.float32(new_l)
                    slx = np.float32(slx + np.float32(np.float32(w * x[i]) * nf))
                    sl2 = np.float32(sl2 + np.float32(np.float32(w * nf) * nf))
                    if sl2 > 0 and np.float32(np.float32(slx * slx) * suml2) > np.float32(np.float32(sumlx * sumlx) * sl2):
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return np.float32(sumlx / suml2) if suml2 > 0 else ZERO


@kernel("float32(float32[::1], float32[::1], float32, int64[::1])")
def _qp_error(x, w, scale, L):
    err = ZERO
    for i in range(x.shape[0]):
        diff = np.float32(x[i] - np.float32(scale * np.float32(L[i])))
        err = np.float32(err + np.float32(np.float32(w[i] * diff) * diff))
    return err


@kernel("float32(float32[::1], int64, float32[::1], int64[::1], int64[::1])")
def make_qp(x, nmax, w, L, scratch):
    """Weighted fit of non-negative ``x`` to levels 0..nmax (stored through uint8); returns the scale."""
    n = x.shape[0]
    mx = ZERO
    for i in range(n):
        mx = mx if mx > x[i] else x[i]  # C's MAX(max, x[i]): a NaN wins
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return ZERO
    fmax = np.float32(nmax)
    iscale = np.float32(fmax / mx)
    for i in range(n):
        L[i] = nearest_int(np.float32(iscale * x[i])) & 0xFF
    best = _qp_error(x, w, np.float32(ONE / iscale), L)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = np.float32(np.float32(np.float32(np.float32(0.1) * np.float32(step)) + fmax) / mx)
        for i in range(n):
            lv = nearest_int(np.float32(iscale_is * x[i]))
            scratch[i] = nmax if lv > nmax else lv
        cur = _qp_error(x, w, np.float32(ONE / iscale_is), scratch)
        if cur < best:
            best = cur
            iscale = iscale_is
    sumlx = ZERO
    suml2 = ZERO
    for i in range(n):
        lv = nearest_int(np.float32(iscale * x[i]))
        lv = nmax if lv > nmax else lv
        L[i] = lv & 0xFF
        lf = np.float32(lv)
        sumlx = np.float32(sumlx + np.float32(np.float32(w[i] * x[i]) * lf))
        suml2 = np.float32(suml2 + np.float32(np.float32(w[i] * lf) * lf))
    for _ in range(5):
        changed = 0
        for i in range(n):
            cur_l = np.float32(L[i])
            slx = np.float32(sumlx - np.float32(np.float32(w[i] * x[i]) * cur_l))
            sl2 = np.float32(suml2 - np.float32(np.float32(w[i] * cur_l) * cur_l))
            if slx > 0 and sl2 > 0:
                new_l = nearest_int(np.float32(np.float32(x[i] * sl2) / slx))
                new_l = nmax if new_l > nmax else new_l
                if new_l != L[i]:
                    nf = np.float32(new_l)
                    slx = np.float32(slx + np.float32(np.float32(w[i] * x[i]) * nf))
                    sl2 = np.float32(sl2 + np.float32(np.float32(w[i] * nf) * nf))
                    if np.float32(np.float32(slx * slx) * suml2) > np.float32(np.float32(sumlx * sumlx) * sl2):
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    return np.float32(sumlx / suml2) if suml2 > 0 else ZERO
