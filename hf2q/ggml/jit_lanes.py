"""Compiled scale searches run on many sub-blocks side by side ("lanes"), for SIMD.

llama.cpp's ``make_qkx2_quants`` and ``make_qx_quants`` spend their time in short float32
accumulations (Σw·l, Σw·l², Σw·x·l, the error) whose every step waits for the previous
add: one sub-block at a time the CPU idles on add latency, and the sums may not be
reordered (that would change the bytes).  Here the sub-blocks of several super-blocks are
laid out as columns ``X[i, lane]`` and every loop runs over lanes innermost: each lane
still adds its values in index order — bit-identical to the C — but independent lanes
fill the vector registers.  Per-lane branches ("keep this candidate if it is better",
"this sub-block is flat / all zero") become per-lane selects.

``L`` outputs are int32 ``[n, lanes]``; scales are float32 ``[lanes]``.
"""

# ruff: noqa: FURB136, PLR1730  (explicit comparisons keep C's NaN behaviour, which min()/max() would not)

from __future__ import annotations

import numpy as np

from .jit_common import GROUP_MAX_EPS, MAGIC, ONE, ZERO, f32_bits, kernel


@kernel("int64(float32, int64, int64)")
def _round_clamped(v, lo, hi):
    """clamp(nearest_int(v), lo, hi) for a float32 ``v`` (llama.cpp's rounding, including its wrap)."""
    r = (np.int32(f32_bits(np.float32(v + MAGIC))) & 0x007FFFFF) - 0x00400000
    return lo if r < lo else (hi if r > hi else r)


@kernel("void(float32[:, ::1], float32[::1], float32[::1], int64, int32[:, ::1])")
def _affine_levels(X, lo, iscale, nmax, out):
    n, nl = X.shape
    for i in range(n):
        for j in range(nl):
            out[i, j] = _round_clamped(np.float32(iscale[j] * np.float32(X[i, j] - lo[j])), 0, nmax)


@kernel("void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], int32[:, ::1], boolean, float32[::1])")
def _affine_error(X, W, scale, mn, L, use_mad, err):
    n, nl = X.shape
    for j in range(nl):
        err[j] = ZERO
    if use_mad:
        for i in range(n):
            for j in range(nl):
                diff = np.float32(np.float32(np.float32(scale[j] * np.float32(L[i, j])) + mn[j]) - X[i, j])
                err[j] = np.float32(err[j] + np.float32(W[i, j] * abs(diff)))
    else:
        for i in range(n):
            for j in range(nl):
                diff = np.float32(np.float32(np.float32(scale[j] * np.float32(L[i, j])) + mn[j]) - X[i, j])
                err[j] = np.float32(err[j] + np.float32(W[i, j] * np.float32(diff * diff)))


@kernel("void(float32[:, ::1], float32[:, ::1], int64, float64, float64, int64, boolean, int32[:, ::1], float32[::1], float32[::1])")
def make_qkx2_lanes(X, W, nmax, rmin, rdelta, nstep, use_mad, L, scale, the_min):
    """``make_qkx2_quants`` / ``make_qkx3_quants`` for every column of ``X`` [n, lanes] (weights ``W``).

    Writes levels 0..nmax into ``L``, the scale and ``-min`` of each lane into ``scale`` / ``the_min``.
    """
    n, nl = X.shape
    f32 = np.float32
    lo = np.empty(nl, f32)
    hi = np.empty(nl, f32)
    sum_w = np.empty(nl, f32)
    sum_x = np.empty(nl, f32)
    for j in range(nl):
        lo[j] = X[0, j]
        hi[j] = X[0, j]
        sum_w[j] = W[0, j]
        sum_x[j] = np.float32(W[0, j] * X[0, j])
    for i in range(1, n):
        for j in range(nl):
            x = X[i, j]
            if x < lo[j]:
                lo[j] = x
            if x > hi[j]:
                hi[j] = x
            sum_w[j] = np.float32(sum_w[j] + W[i, j])
            sum_x[j] = np.float32(sum_x[j] + np.float32(W[i, j] * x))
    flat = np.empty(nl, np.bool_)
    first_lo = np.empty(nl, f32)
    iscale = np.empty(nl, f32)
    for j in range(nl):
        if lo[j] > 0:
            lo[j] = ZERO
        flat[j] = hi[j] == lo[j]
        first_lo[j] = lo[j]
        iscale[j] = np.float32(np.float32(nmax) / np.float32(hi[j] - lo[j]))
        scale[j] = np.float32(ONE / iscale[j])
    _affine_levels(X, lo, iscale, nmax, L)
    best = np.empty(nl, f32)
    _affine_error(X, W, scale, lo, L, use_mad, best)

    aux = np.empty((n, nl), np.int32)
    sum_l = np.empty(nl, f32)
    sum_l2 = np.empty(nl, f32)
    sum_xl = np.empty(nl, f32)
    this_scale = np.empty(nl, f32)
    this_min = np.empty(nl, f32)
    cur = np.empty(nl, f32)
    take = np.empty(nl, np.bool_)
    fmax = np.float32(nmax)
    rmin32 = np.float32(rmin)
    rdelta32 = np.float32(rdelta)
    for step in range(nstep + 1):
        factor = np.float32(np.float32(rmin32 + np.float32(rdelta32 * np.float32(step))) + fmax)
        for j in range(nl):
            iscale[j] = np.float32(factor / np.float32(hi[j] - lo[j]))
            sum_l[j] = ZERO
            sum_l2[j] = ZERO
            sum_xl[j] = ZERO
        _affine_levels(X, lo, iscale, nmax, aux)
        for i in range(n):
            for j in range(nl):
                lf = np.float32(aux[i, j])
                wl = np.float32(W[i, j] * lf)
                sum_l[j] = np.float32(sum_l[j] + wl)
                sum_l2[j] = np.float32(sum_l2[j] + np.float32(wl * lf))
                sum_xl[j] = np.float32(sum_xl[j] + np.float32(wl * X[i, j]))
        for j in range(nl):
            D = np.float32(np.float32(sum_w[j] * sum_l2[j]) - np.float32(sum_l[j] * sum_l[j]))
            ts = np.float32(np.float32(np.float32(sum_w[j] * sum_xl[j]) - np.float32(sum_x[j] * sum_l[j])) / D)
            tm = np.float32(np.float32(np.float32(sum_l2[j] * sum_x[j]) - np.float32(sum_l[j] * sum_xl[j])) / D)
            if tm > 0:
                tm = ZERO
                ts = np.float32(sum_xl[j] / sum_l2[j])
            this_scale[j] = ts
            this_min[j] = tm
            take[j] = D > 0
        _affine_error(X, W, this_scale, this_min, aux, use_mad, cur)
        changed = False
        for j in range(nl):
            if take[j] and cur[j] < best[j]:
                best[j] = cur[j]
                scale[j] = this_scale[j]
                lo[j] = this_min[j]
                changed = True
            else:
                take[j] = False
        if changed:
            for i in range(n):
                for j in range(nl):
                    if take[j]:
                        L[i, j] = aux[i, j]
    for j in range(nl):
        if flat[j]:
            scale[j] = ZERO
            the_min[j] = -first_lo[j]
            for i in range(n):
                L[i, j] = 0
        else:
            the_min[j] = -lo[j]


@kernel("void(float32[:, ::1], float32[:, ::1], int64, float32[::1], int32[:, ::1], float32[::1], float32[::1])")
def _symmetric_fit(X, W, nmax, iscale, out, sumlx, suml2):
    n, nl = X.shape
    for j in range(nl):
        sumlx[j] = ZERO
        suml2[j] = ZERO
    for i in range(n):
        for j in range(nl):
            lv = _round_clamped(np.float32(iscale[j] * X[i, j]), -nmax, nmax - 1)
            out[i, j] = lv
            lf = np.float32(lv)
            sumlx[j] = np.float32(sumlx[j] + np.float32(np.float32(W[i, j] * X[i, j]) * lf))
            suml2[j] = np.float32(suml2[j] + np.float32(np.float32(W[i, j] * lf) * lf))


@kernel("void(float32[:, ::1], float32[:, ::1], int64, int32[:, ::1], float32[::1])")
def make_qx_lanes(X, W, nmax, L, scale):
    """``make_qx_quants`` (rmse_type 1, weights ``W`` — pass X² for the no-imatrix case) per column.

    Writes levels 0..2·nmax-1 into ``L`` and each lane's scale into ``scale``.
    """
    n, nl = X.shape
    f32 = np.float32
    amax = np.zeros(nl, f32)
    vmax = np.zeros(nl, f32)
    for i in range(n):
        for j in range(nl):
            ax = abs(X[i, j])
            if ax > amax[j]:
                amax[j] = ax
                vmax[j] = X[i, j]
    fmax = np.float32(nmax)
    iscale = np.empty(nl, f32)
    for j in range(nl):
        iscale[j] = np.float32(-fmax / vmax[j])
    sumlx = np.empty(nl, f32)
    suml2 = np.empty(nl, f32)
    _symmetric_fit(X, W, nmax, iscale, L, sumlx, suml2)
    best = np.empty(nl, f32)
    for j in range(nl):
        scale[j] = np.float32(sumlx[j] / suml2[j]) if suml2[j] != 0 else ZERO
        best[j] = np.float32(scale[j] * sumlx[j])
    aux = np.empty((n, nl), np.int32)
    take = np.empty(nl, np.bool_)
    for step in range(-9, 10):
        if step == 0:
            continue
        factor = -np.float32(fmax + np.float32(np.float32(0.1) * np.float32(step)))
        for j in range(nl):
            iscale[j] = np.float32(factor / vmax[j])
        _symmetric_fit(X, W, nmax, iscale, aux, sumlx, suml2)
        changed = False
        for j in range(nl):
            take[j] = suml2[j] > 0 and np.float32(sumlx[j] * sumlx[j]) > np.float32(best[j] * suml2[j])
            if take[j]:
                scale[j] = np.float32(sumlx[j] / suml2[j])
                best[j] = np.float32(scale[j] * sumlx[j])
                changed = True
        if changed:
            for i in range(n):
                for j in range(nl):
                    if take[j]:
                        L[i, j] = aux[i, j]
    for j in range(nl):
        zero = amax[j] < GROUP_MAX_EPS
        if zero:
            scale[j] = ZERO
        for i in range(n):
            L[i, j] = 0 if zero else L[i, j] + nmax
