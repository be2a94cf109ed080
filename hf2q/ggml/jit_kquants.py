"""Compiled Q2_K … Q6_K quantizers (256-value super-blocks), with and without an importance matrix.

The C (``quantize_row_q*_K_ref``, ``quantize_row_q*_K_impl``) does, per super-block:
per-value weights → a scale search per sub-block → super-block scales → fp16 →
re-quantize → pack.  Here the searches of ``BATCH`` super-blocks run side by side
(``jit_lanes``: one SIMD lane per sub-block, same arithmetic order as the C), then
each super-block is finished on its own (``jit_kpack``).  Q3_K without imatrix keeps
the scalar ``make_q3_quants``: its greedy refinement usually stops after a pass or two, which
lanes cannot exploit.

``quantize_k_blocks`` is the one entry point: a single compiled function keeps the
first-use compile time down.
"""

from __future__ import annotations

import numpy as np

from .jit_common import ONE, ZERO, first_absmax, kernel, nearest_int, positive_max
from .jit_kpack import finish_q2_k, finish_q3_k, finish_q6_k, finish_q45
from .jit_ksearch import make_q3, make_qp, make_qx
from .jit_lanes import make_qkx2_lanes, make_qx_lanes

QK_K = 256
KIND = {"Q2_K": 0, "Q3_K": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BATCH = 4  # super-blocks searched side by side: 32-64 lanes fill AVX-512 registers a few times over


@kernel("float32(float32[::1], int64)")
def _sigma2(x, factor):
    """σ² of a super-block: Σx² / 256 (times 2 for Q3_K/Q4_K/Q5_K), summed in index order."""
    total = ZERO
    for i in range(QK_K):
        total = np.float32(total + np.float32(x[i] * x[i]))
    if factor != 1:
        return np.float32(np.float32(np.float32(factor) * total) / np.float32(QK_K))
    return np.float32(total / np.float32(QK_K))


@kernel("void(float32[:, ::1], float32[:, ::1], int64, int64, int64, int64, boolean, int64, float32[:, ::1], float32[:, ::1], float32[::1])")
def _lanes_in(x, qw, first_block, b0, nbb, kind, use_qw, sub, X, W, sw):
    """Super-blocks b0 … b0+nbb-1 → columns ``X[i, k·nsub + j]`` = value i of sub-block j of
    super-block k, with the per-value weights of the type's search in ``W`` and (imatrix)
    each sub-block's weight sum in ``sw``."""
    nsub = QK_K // sub
    per_row = qw.shape[0]
    for k in range(nbb):
        xb = x[b0 + k]
        q = qw[(first_block + b0 + k) % per_row]
        sigma2 = _sigma2(xb, 1 if kind == 0 else 2) if use_qw and kind != 4 else ZERO
        for j in range(nsub):
            lane = k * nsub + j
            s = sub * j
            av_x = ZERO
            if kind == 2 or kind == 3:  # Q4_K/Q5_K weights: rms of the sub-block + |x|
                sum_x2 = ZERO
                for i in range(sub):
                    sum_x2 = np.float32(sum_x2 + np.float32(xb[s + i] * xb[s + i]))
                av_x = np.float32(np.sqrt(np.float32(sum_x2 / np.float32(sub))))
            total = ZERO
            for i in range(sub):
                v = xb[s + i]
                X[i, lane] = v
                if use_qw and kind == 4:  # Q6_K takes the imatrix as it is
                    wv = q[s + i]
                elif use_qw:
                    wv = np.float32(q[s + i] * np.sqrt(np.float32(sigma2 + np.float32(v * v))))
                elif kind == 0:
                    wv = abs(v)
                elif kind == 4:
                    wv = np.float32(v * v)
                else:
                    wv = np.float32(av_x + abs(v))
                W[i, lane] = wv
                total = np.float32(total + wv)
            sw[lane] = total


@kernel("void(int32[:, ::1], int64, int64, int64[::1])")
def _levels_out(Lx, k, sub, L):
    """Lane levels of super-block k back into its 256-value order."""
    nsub = QK_K // sub
    for j in range(nsub):
        for i in range(sub):
            L[sub * j + i] = Lx[i, k * nsub + j]


@kernel("void(float32[::1], int64[::1], float32[::1], float32[::1], float32[::1], boolean, int64[::1], int64[::1], int64[::1], uint8[::1])")
def _q2_k(x, L, scales, mins, sw, use_qw, Ls, Lm, aux16, out):
    if use_qw:
        d = make_qp(scales, 15, sw, Ls, aux16)
        dmin = make_qp(mins, 15, sw, Lm, aux16)
        for j in range(16):
            Ls[j] = (Ls[j] | (Lm[j] << 4)) & 0xFF
        finish_q2_k(x, L, Ls, d, dmin, out)
        return
    max_scale = positive_max(scales)
    max_min = positive_max(mins)
    d = ZERO
    dmin = ZERO
    for j in range(16):
        Ls[j] = 0
    if max_scale > 0:
        iscale = np.float32(np.float32(15) / max_scale)
        for j in range(16):
            Ls[j] = nearest_int(np.float32(iscale * scales[j])) & 0xFF
        d = np.float32(max_scale / np.float32(15))
    if max_min > 0:
        iscale = np.float32(np.float32(15) / max_min)
        for j in range(16):
            Ls[j] = (Ls[j] | (nearest_int(np.float32(iscale * mins[j])) << 4)) & 0xFF
        dmin = np.float32(max_min / np.float32(15))
    finish_q2_k(x, L, Ls, d, dmin, out)


@kernel("void(float32[::1], int64[::1], float32[::1], float32[::1], float32[::1], boolean, int64, int64[::1], int64[::1], int64[::1], int64[::1], uint8[::1])")
def _q45_k(x, L, scales, mins, sw, use_qw, nmax, Ls, Lm, aux16, packed, out):
    if use_qw:
        d = make_qp(scales, 63, sw, Ls, aux16)
        dmin = make_qp(mins, 63, sw, Lm, aux16)
        if nmax == 31:  # Q5_K clamps the 6-bit fields, Q4_K stores them as they come
            for j in range(8):
                Ls[j] = min(Ls[j], 63)
                Lm[j] = min(Lm[j], 63)
        finish_q45(x, L, Ls, Lm, d, dmin, nmax, packed, out)
        return
    max_scale = positive_max(scales)
    max_min = positive_max(mins)
    inv_scale = np.float32(np.float32(63) / max_scale) if max_scale > 0 else ZERO
    inv_min = np.float32(np.float32(63) / max_min) if max_min > 0 else ZERO
    for j in range(8):
        Ls[j] = min(nearest_int(np.float32(inv_scale * scales[j])) & 0xFF, 63)
        Lm[j] = min(nearest_int(np.float32(inv_min * mins[j])) & 0xFF, 63)
    finish_q45(x, L, Ls, Lm, np.float32(max_scale / np.float32(63)), np.float32(max_min / np.float32(63)),
               nmax, packed, out)


@kernel("void(float32[::1], int64[::1], float32[::1], int64[::1], int64[::1], uint8[::1])")
def _q3_k_plain(x, L, scales, Ls, packed, out):
    """Q3_K without imatrix: scalar make_q3_quants per sub-block, 6-bit scales from the signed max."""
    for j in range(16):
        s = 16 * j
        scales[j] = make_q3(x[s:s + 16], 4, L[s:s + 16])
    _, max_scale = first_absmax(scales)
    d = ZERO
    for j in range(16):
        Ls[j] = 0
    if max_scale != 0:
        iscale = np.float32(np.float32(-32) / max_scale)
        for j in range(16):
            l = ((nearest_int(np.float32(iscale * scales[j])) + 128) & 0xFF) - 128  # int8_t
            Ls[j] = min(max(l, -32), 31) + 32
        d = np.float32(ONE / iscale)
    finish_q3_k(x, L, Ls, d, packed, out)


@kernel("void(float32[:, ::1], float32[:, ::1], int64, boolean, int64, uint8[:, ::1])")
def quantize_k_blocks(x, qw, first_block, use_qw, kind, out):
    """Quantize super-blocks ``x`` [nb, 256] into ``out`` [nb, block_bytes].

    ``qw`` [blocks_per_row, 256]: the imatrix columns of each super-block position in a row
    (read only when ``use_qw``); ``first_block`` is the row position of ``x[0]`` so that
    chunks taken from the middle of a row find their weights.  ``kind``: ``KIND[name]``.
    """
    nb = x.shape[0]
    L = np.empty(QK_K, np.int64)
    Ls = np.empty(16, np.int64)
    Lm = np.empty(16, np.int64)
    aux16 = np.empty(16, np.int64)
    packed = np.empty(12, np.int64)
    if kind == 1 and not use_qw:  # Q3_K's greedy make_q3_quants stays scalar: it usually stops early
        scales16 = np.empty(16, np.float32)
        for b in range(nb):
            _q3_k_plain(x[b], L, scales16, Ls, packed, out[b])
        return
    sub = 32 if kind == 2 or kind == 3 else 16
    nsub = QK_K // sub
    for b0 in range(0, nb, BATCH):
        nbb = min(BATCH, nb - b0)
        nl = nbb * nsub
        X = np.empty((sub, nl), np.float32)
        W = np.empty((sub, nl), np.float32)
        Lx = np.empty((sub, nl), np.int32)
        sw = np.empty(nl, np.float32)
        sc = np.empty(nl, np.float32)
        mn = np.empty(nl, np.float32)
        _lanes_in(x, qw, first_block, b0, nbb, kind, use_qw, sub, X, W, sw)
        if kind == 1 or kind == 4:
            make_qx_lanes(X, W, 4 if kind == 1 else 32, Lx, sc)
        elif kind == 0 and use_qw:
            make_qkx2_lanes(X, W, 3, -0.9, 0.05, 36, False, Lx, sc, mn)
        elif kind == 0:
            make_qkx2_lanes(X, W, 3, -0.5, 0.1, 15, True, Lx, sc, mn)
        elif use_qw:
            make_qkx2_lanes(X, W, 15 if kind == 2 else 31, -0.9, 0.05, 36, False, Lx, sc, mn)
        elif kind == 2:
            make_qkx2_lanes(X, W, 15, -1.0, 0.1, 20, False, Lx, sc, mn)
        else:
            make_qkx2_lanes(X, W, 31, -0.5, 0.1, 15, False, Lx, sc, mn)
        for k in range(nbb):
            _levels_out(Lx, k, sub, L)
            lanes = slice(k * nsub, (k + 1) * nsub)
            xb = x[b0 + k]
            ob = out[b0 + k]
            if kind == 0:
                _q2_k(xb, L, sc[lanes], mn[lanes], sw[lanes], use_qw, Ls, Lm, aux16, ob)
            elif kind == 1:  # with imatrix: the 16 scales themselves by a weighted make_qx_quants
                d = make_qx(sc[lanes], 32, sw[lanes], True, Ls, aux16)
                finish_q3_k(xb, L, Ls, d, packed, ob)
            elif kind == 4:
                finish_q6_k(xb, L, sc[lanes], ob)
            else:
                _q45_k(xb, L, sc[lanes], mn[lanes], sw[lanes], use_qw, 15 if kind == 2 else 31,
                       Ls, Lm, aux16, packed, ob)
