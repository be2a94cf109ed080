"""Importance-matrix (imatrix) quantizers, vectorised and bit-exact with llama.cpp's ``quantize_*_impl``.

With an importance matrix, llama.cpp weights each value by ``qw · sqrt(σ² + x²)`` (σ² a
mean square of the super-block, or of the whole row for the 32-value legacy types), runs
the longer ``make_qkx3_quants`` / weighted ``make_qx_quants`` searches per sub-block, and
picks the super-block scales themselves with the weighted ``make_qp_quants`` search
instead of a plain max.  The back halves (re-quantize against fp16 scales, bit packing)
are shared with the plain codecs in ``kquants``.

Every function takes blocks ``x`` [nblocks, block] and per-value importance ``weights`` of
the same shape (the imatrix column weights of each block's position in its row).
"""

from __future__ import annotations

import numpy as np

from .common import F32, GROUP_MAX_EPS, fp16_bits, nearest_int, seq_sum, u16_bytes
from .kblocks import QK_K, as_columns, from_columns, pack_q3_scales
from .kquants import affine_search, pack_q2_k, pack_q3_k, pack_q45, quantize_q6_k
from .ksearch import make_qkx2, make_qx
from .legacy import high_bits, pack_nibbles


def make_qp(x, w, nmax: int):
    """``make_qp_quants``: weighted fit of non-negative values to levels 0..nmax per column.

    ``x``, ``w``: [n, ncol].  Returns (scale[ncol], L[n, ncol] int32 as stored in uint8).
    """
    mx = np.max(x, axis=0)
    zero = ~(mx >= GROUP_MAX_EPS)
    iscale = F32(nmax) / mx

    def mse(scale, lv):
        diff = x - scale * lv
        return seq_sum((w * diff) * diff)

    best = mse(F32(1.0) / iscale, (nearest_int(iscale * x) & 0xFF).astype(F32))
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        isc = (F32(0.1) * F32(step) + F32(nmax)) / mx
        cur = mse(F32(1.0) / isc, np.minimum(nmax, nearest_int(isc * x)).astype(F32))
        better = cur < best
        best = np.where(better, cur, best)
        iscale = np.where(better, isc, iscale).astype(F32)
    li = np.minimum(nmax, nearest_int(iscale * x))
    lf = li.astype(F32)
    wx = w * x
    sumlx, suml2 = seq_sum(wx * lf), seq_sum((w * lf) * lf)
    L = li & 0xFF
    for _ in range(5):  # a pass that changes nothing leaves the state as is, so no early exit is needed
        for i in range(x.shape[0]):
            cur_l = L[i].astype(F32)
            slx = sumlx - wx[i] * cur_l
            sl2 = suml2 - (w[i] * cur_l) * cur_l
            new_l = np.minimum(nmax, nearest_int((x[i] * sl2) / slx))
            nf = new_l.astype(F32)
            slx_new = slx + wx[i] * nf
            sl2_new = sl2 + (w[i] * nf) * nf
            accept = ((slx > 0) & (sl2 > 0) & (new_l != L[i])
                      & ((slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new))
            L[i] = np.where(accept, new_l & 0xFF, L[i])
            sumlx = np.where(accept, slx_new, sumlx).astype(F32)
            suml2 = np.where(accept, sl2_new, suml2).astype(F32)
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0.0)).astype(F32)
    return np.where(zero, F32(0.0), scale).astype(F32), np.where(zero, 0, L)


def _superblock_sigma2(x: np.ndarray, factor: int) -> np.ndarray:
    """``factor * Σx² / 256`` per super-block, summed in C order."""
    sum_x2 = seq_sum(np.ascontiguousarray((x * x).T))
    return (F32(factor) * sum_x2) / F32(QK_K) if factor != 1 else sum_x2 / F32(QK_K)


def _importance(x, qw, sigma2):
    return qw * np.sqrt(sigma2[:, None] + x * x)


def _sub_sums(w, sub: int) -> np.ndarray:
    """Σ weights per ``sub``-value sub-block → [sub_blocks_per_superblock, nsb] (columns per super-block)."""
    nsb = w.shape[0]
    return seq_sum(as_columns(w, sub)).reshape(nsb, QK_K // sub).T.copy()


def quantize_q2_k(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        w = _importance(x, weights, _superblock_sigma2(x, 1))
        scales, mins, L = affine_search(x, w, 3, 16, -0.9, 0.05, 36, False)
        sw = _sub_sums(w, 16)
        dm, Ls = make_qp(scales.T.copy(), sw, 15)
        mm, Lm = make_qp(mins.T.copy(), sw, 15)
    sc = (Ls.T | (Lm.T << 4)) & 0xFF
    return pack_q2_k(x, L, sc, fp16_bits(dm), fp16_bits(mm))


def quantize_q3_k(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    nsb = x.shape[0]
    with np.errstate(all="ignore"):
        w = _importance(x, weights, _superblock_sigma2(x, 2))
        scale, L = make_qx(as_columns(x, 16), 4, as_columns(w, 16))
        d_block, Ls = make_qx(scale.reshape(nsb, 16).T.copy(), 32, _sub_sums(w, 16))
    L = from_columns(L, nsb).reshape(nsb, 16, 16)
    return pack_q3_k(x, L, pack_q3_scales(Ls.T.astype(np.int32)), fp16_bits(d_block))


def _quantize_q45(x, weights, nmax: int):
    with np.errstate(all="ignore"):
        w = _importance(x, weights, _superblock_sigma2(x, 2))
        scales, mins, L = affine_search(x, w, nmax, 32, -0.9, 0.05, 36, False)
        sw = _sub_sums(w, 32)
        d_block, Ls = make_qp(scales.T.copy(), sw, 63)
        m_block, Lm = make_qp(mins.T.copy(), sw, 63)
    ls, lm = Ls.T, Lm.T
    if nmax == 31:  # Q5_K clamps the 6-bit fields, Q4_K stores them as they come
        ls, lm = np.minimum(63, ls), np.minimum(63, lm)
    return pack_q45(x, L, ls, lm, fp16_bits(d_block), fp16_bits(m_block), nmax)


def quantize_q4_k(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return _quantize_q45(x, weights, 15)


def quantize_q5_k(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return _quantize_q45(x, weights, 31)


def quantize_q6_k_w(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return quantize_q6_k(x, weights)  # Q6_K uses the raw imatrix weights, no σ² term


# ---------------------------------------------------------------- legacy 32-value types


def row_sigma2(x: np.ndarray) -> np.ndarray:
    """Σx² / n_per_row per row of ``x`` [rows, n] (the legacy types' σ², summed in C order)."""
    return seq_sum(np.ascontiguousarray((x * x).T)) / F32(x.shape[1])


def _symmetric(x, weights, sigma2, nmax: int):
    with np.errstate(all="ignore"):
        w = _importance(x, weights, sigma2)
        d, L = make_qx(np.ascontiguousarray(x.T), nmax, np.ascontiguousarray(w.T))
    return fp16_bits(d), L.T.astype(np.int32)


def _affine(x, weights, sigma2, nmax: int):
    with np.errstate(all="ignore"):
        w = _importance(x, weights, sigma2)
        d, the_min, L = make_qkx2(np.ascontiguousarray(x.T), np.ascontiguousarray(w.T), nmax, -0.9, 0.05, 36, False)
    return fp16_bits(d), fp16_bits(-the_min), L.T.astype(np.int32)


def quantize_q4_0(x, weights, sigma2):
    d, L = _symmetric(x, weights, sigma2, 8)
    return np.concatenate([u16_bytes(d), pack_nibbles(L)], axis=1)


def quantize_q5_0(x, weights, sigma2):
    d, L = _symmetric(x, weights, sigma2, 16)
    return np.concatenate([u16_bytes(d), high_bits(L), pack_nibbles(L)], axis=1)


def quantize_q4_1(x, weights, sigma2):
    d, m, L = _affine(x, weights, sigma2, 15)
    return np.concatenate([u16_bytes(d), u16_bytes(m), pack_nibbles(L)], axis=1)


def quantize_q5_1(x, weights, sigma2):
    d, m, L = _affine(x, weights, sigma2, 31)
    return np.concatenate([u16_bytes(d), u16_bytes(m), high_bits(L), pack_nibbles(L)], axis=1)


K_QUANTIZE = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k,
              "Q6_K": quantize_q6_k_w}
LEGACY_QUANTIZE = {"Q4_0": quantize_q4_0, "Q4_1": quantize_q4_1, "Q5_0": quantize_q5_0, "Q5_1": quantize_q5_1}
