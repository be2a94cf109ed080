"""Vectorised k-quant quantizers (Q2_K … Q6_K, 256-value super-blocks), bit-exact with llama.cpp.

Each quantizer is the C's ``quantize_row_q*_K_ref`` in two halves: a scale search over all
sub-blocks at once (``ksearch``), then ``pack_*``: store the super-block scales as fp16,
re-quantize every value against what was stored, and lay out the bytes (``kblocks``).
The importance-matrix quantizers (``imatrix``) reuse the ``pack_*`` halves.
"""

from __future__ import annotations

import numpy as np

from .common import F32, GROUP_MAX_EPS, fp16_bits, nearest_int, seq_sum, u16_bytes
from .kblocks import (
    BLOCK_BYTES,
    DEQUANTIZE,
    QK_K,
    as_columns,
    from_columns,
    pack_2bit,
    pack_q3_scales,
    pack_scale_min_k4,
    unpack_q3_scales,
    unpack_scale_min_k4,
)
from .ksearch import make_q3, make_qkx2, make_qx, positive_max, signed_absmax

__all__ = ["BLOCK_BYTES", "DEQUANTIZE", "QK_K", "QUANTIZE"]


def _final_levels(xb, d, dm, lo, hi, L_prev):
    """Re-quantize each sub-block against its fp16-rounded scale; sub-blocks with d == 0 keep L_prev."""
    skip = d == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        v = xb + dm[..., None] if dm is not None else xb
        new = np.clip(nearest_int(v / d[..., None]), lo, hi)
    return np.where(skip[..., None], L_prev, new)


def affine_search(x, weights, nmax: int, sub: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """make_qkx2/3 over every ``sub``-value sub-block → (scales, mins [nsb, 256/sub], L [nsb, 256/sub, sub])."""
    nsb = x.shape[0]
    scale, the_min, L = make_qkx2(as_columns(x, sub), as_columns(weights, sub), nmax, rmin, rdelta, nstep, use_mad)
    nsub = QK_K // sub
    return scale.reshape(nsb, nsub), the_min.reshape(nsb, nsub), from_columns(L, nsb).reshape(nsb, nsub, sub)


def pack_q2_k(x, L, sc, d, dmin) -> np.ndarray:
    """Final Q2_K levels against the fp16 scales, then the 84-byte blocks (sc: 4-bit scale | 4-bit min)."""
    nsb = x.shape[0]
    sc = sc.astype(np.uint8)
    with np.errstate(all="ignore"):
        dd = d.view(np.float16).astype(F32)[:, None] * (sc & 0xF).astype(F32)
        dm = dmin.view(np.float16).astype(F32)[:, None] * (sc >> 4).astype(F32)
        L = _final_levels(x.reshape(nsb, 16, 16), dd, dm, 0, 3, L)
    return np.concatenate([sc, pack_2bit(L.reshape(nsb, QK_K)), u16_bytes(d), u16_bytes(dmin)], axis=1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        scales, mins, L = affine_search(x, np.abs(x), 3, 16, -0.5, 0.1, 15, True)
        max_scale, max_min = positive_max(scales), positive_max(mins)
        ps, pm = max_scale > 0, max_min > 0
        ls = np.where(ps[:, None], nearest_int((F32(15.0) / max_scale)[:, None] * scales), 0)
        lm = np.where(pm[:, None], nearest_int((F32(15.0) / max_min)[:, None] * mins), 0)
        d = np.where(ps, fp16_bits(max_scale / F32(15.0)), 0).astype(np.uint16)
        dmin = np.where(pm, fp16_bits(max_min / F32(15.0)), 0).astype(np.uint16)
    return pack_q2_k(x, L, ((ls & 0xFF) | (lm << 4)) & 0xFF, d, dmin)


def pack_q45(x, L, ls, lm, d, dmin, nmax: int) -> np.ndarray:
    """Q4_K (nmax 15) / Q5_K (nmax 31): pack 6-bit scales/mins, re-quantize, pack the levels."""
    nsb = x.shape[0]
    scales = pack_scale_min_k4(ls & 0xFF, lm & 0xFF)
    sc, m = unpack_scale_min_k4(scales)  # what the C reads back (differs from ls/lm only when > 63)
    with np.errstate(all="ignore"):
        dd = d.view(np.float16).astype(F32)[:, None] * sc.astype(F32)
        dm = dmin.view(np.float16).astype(F32)[:, None] * m.astype(F32)
        L = _final_levels(x.reshape(nsb, 8, 32), dd, dm, 0, nmax, L).reshape(nsb, QK_K).astype(np.uint8)
    head = np.concatenate([u16_bytes(d), u16_bytes(dmin), scales], axis=1)
    q = L.reshape(nsb, 4, 2, 32)  # [nsb, 64-value group, half, j]
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(nsb, 128)
    if nmax == 15:
        return np.concatenate([head, qs], axis=1)
    hb = (q >> 4).astype(np.uint8)  # bit 2n+half of qh[j]
    shifts = (2 * np.arange(4, dtype=np.uint8)[:, None] + np.arange(2, dtype=np.uint8)[None, :])[None, :, :, None]
    qh = np.bitwise_or.reduce((hb << shifts).reshape(nsb, 8, 32), axis=1)
    return np.concatenate([head, qh, qs], axis=1)


def _q45_weights(x: np.ndarray) -> np.ndarray:
    """Per 32-value sub-block: sqrt(mean x²) + |x| (sums in C order)."""
    xs = x.reshape(-1, 32)
    av_x = np.sqrt(seq_sum(np.ascontiguousarray((xs * xs).T)) / F32(32))
    return (av_x[:, None] + np.abs(xs)).reshape(x.shape)


def _quantize_q45(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        scales, mins, L = affine_search(x, _q45_weights(x), nmax, 32, rmin, 0.1, nstep, False)
        max_scale, max_min = positive_max(scales), positive_max(mins)
        inv_scale = np.where(max_scale > 0, F32(63.0) / max_scale, F32(0.0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63.0) / max_min, F32(0.0)).astype(F32)
        ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales) & 0xFF)
        lm = np.minimum(63, nearest_int(inv_min[:, None] * mins) & 0xFF)
        d, dmin = fp16_bits(max_scale / F32(63.0)), fp16_bits(max_min / F32(63.0))
    return pack_q45(x, L, ls, lm, d, dmin, nmax)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    return _quantize_q45(x, 15, -1.0, 20)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    return _quantize_q45(x, 31, -0.5, 15)


def pack_q3_k(x, L, sc_bytes, d) -> np.ndarray:
    """Re-quantize against the packed 6-bit scales and fp16 d, then hmask / 2-bit levels."""
    nsb = x.shape[0]
    with np.errstate(all="ignore"):
        dd = d.view(np.float16).astype(F32)[:, None] * (unpack_q3_scales(sc_bytes)).astype(F32)
        L = _final_levels(x.reshape(nsb, 16, 16), dd, None, -4, 3, L - F32(4)) + 4
    L = L.reshape(nsb, QK_K).astype(np.uint8)
    high = (L > 3).reshape(nsb, 8, 32).astype(np.uint8)
    hmask = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([hmask, pack_2bit(L & 3), sc_bytes, u16_bytes(d)], axis=1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    nsb = x.shape[0]
    with np.errstate(all="ignore"):
        scale, L = make_q3(as_columns(x, 16))
        scales = scale.reshape(nsb, 16)
        L = from_columns(L, nsb).reshape(nsb, 16, 16)
        _, max_scale = signed_absmax(scales, 1)
        nz = max_scale != 0
        iscale = F32(-32.0) / max_scale
        l8 = ((nearest_int(iscale[:, None] * scales) + 128) & 0xFF) - 128  # stored via int8_t
        l6 = np.where(nz[:, None], np.clip(l8, -32, 31) + 32, 0)
        sc_bytes = np.where(nz[:, None], pack_q3_scales(l6), 0).astype(np.uint8)
        d = np.where(nz, fp16_bits(F32(1.0) / iscale), 0).astype(np.uint16)
    return pack_q3_k(x, L, sc_bytes, d)


def quantize_q6_k(x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Q6_K; ``weights`` (importance per value) replace the default x² in the scale search."""
    nsb = x.shape[0]
    with np.errstate(all="ignore"):
        scale, L = make_qx(as_columns(x, 16), 32, None if weights is None else as_columns(weights, 16))
        scales = scale.reshape(nsb, 16)
        L = from_columns(L, nsb).reshape(nsb, 16, 16)
        max_abs, max_scale = signed_absmax(scales, 1)
        zero = max_abs < GROUP_MAX_EPS
        iscale = F32(-128.0) / max_scale
        d = fp16_bits(F32(1.0) / iscale)
        sc = np.minimum(127, nearest_int(iscale[:, None] * scales))
        sc = ((sc + 128) & 0xFF) - 128
        dd = d.view(np.float16).astype(F32)[:, None] * sc.astype(F32)
        L = _final_levels(x.reshape(nsb, 16, 16), dd, None, -32, 31, L - F32(32)) + 32
    L = L.reshape(nsb, 2, 4, 32).astype(np.uint8)  # [nsb, half, k, l] = value 128*half + 32k + l
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(nsb, 128)
    h = L >> 4
    qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(nsb, 64)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), u16_bytes(d)], axis=1)
    out[zero] = 0
    return out


QUANTIZE = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k,
            "Q6_K": quantize_q6_k}
