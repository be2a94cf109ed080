"""Compiled Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 quantizers (32-value blocks), with and without imatrix.

The plain quantizers follow ``quantize_row_q*_ref`` (one scale from the block's extremes);
with an importance matrix they follow ``quantize_row_q*_impl``: weights
``qw·sqrt(σ²_row + x²)``, then the weighted ``make_qx_quants`` (Q4_0/Q5_0) or
``make_qkx3_quants`` (Q4_1/Q5_1) search, run on ``BATCH`` blocks side by side.  Float → int conversions copy x86's truncating
``cvttss2si`` (INT_MIN for NaN), which is what the numpy codec and llama.cpp's build do.
``quantize_legacy_blocks`` is the one entry point.
"""

# ruff: noqa: FURB136  (explicit comparisons keep C's NaN behaviour, which min()/max() would not)

from __future__ import annotations

import numpy as np

from .jit_common import ONE, ZERO, kernel, store_half
from .jit_lanes import make_qkx2_lanes, make_qx_lanes

QK = 32
KIND = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
BATCH = 64  # blocks processed side by side (one SIMD lane each)


@kernel("void(int64[::1], uint8[::1], int64)")
def _pack_nibbles(q, out, off):
    for j in range(16):
        out[off + j] = (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)


@kernel("void(int64[::1], uint8[::1], int64)")
def _pack_high_bits(q, out, off):
    """Bit 4 of each value → a little-endian uint32 at ``out[off:off+4]``."""
    qh = 0
    for j in range(QK):
        qh |= ((q[j] >> 4) & 1) << j
    for k in range(4):
        out[off + k] = (qh >> (8 * k)) & 0xFF


@kernel("void(int64[::1], int64, uint8[::1])")
def _pack_levels(q, kind, out):
    """Level bytes of Q4_0 (at 2) / Q4_1 (at 4) / Q5_0 (qh at 2) / Q5_1 (qh at 4)."""
    if kind == 0:
        _pack_nibbles(q, out, 2)
    elif kind == 1:
        _pack_nibbles(q, out, 4)
    elif kind == 2:
        _pack_high_bits(q, out, 2)
        _pack_nibbles(q, out, 6)
    else:
        _pack_high_bits(q, out, 4)
        _pack_nibbles(q, out, 8)


@kernel("int64(float32)")
def _cvtt(v):
    """C's float → int on x86 (``cvttss2si``): truncation; INT_MIN for NaN and out-of-range values.
    Written as a select so that loops over lanes stay vectorisable."""
    inside = v > -2147483904.0 and v < 2147483648.0  # NaN compares false
    return np.int64(v) if inside else np.int64(-2147483648)


@kernel("void(float32[:, ::1], int64, int64, int64, uint8[:, ::1])")
def _plain_blocks(x, b0, nbb, kind, out):
    """Blocks b0 … b0+nbb-1 without imatrix (``quantize_row_q*_ref``), one block per lane:
    per-block extremes → d (and min) → levels, then each block's bytes."""
    X = np.empty((QK, nbb), np.float32)
    for k in range(nbb):
        for i in range(QK):
            X[i, k] = x[b0 + k, i]
    d = np.empty(nbb, np.float32)
    lo = np.empty(nbb, np.float32)
    idv = np.empty(nbb, np.float32)
    Q = np.empty((QK, nbb), np.int64)
    if kind == 1 or kind == 3:  # Q4_1 / Q5_1: min and max (C starts from ±FLT_MAX)
        hi = np.empty(nbb, np.float32)
        for k in range(nbb):
            lo[k] = np.float32(3.4028234663852886e38)
            hi[k] = -lo[k]
        for i in range(QK):
            for k in range(nbb):
                v = X[i, k]
                lo[k] = v if v < lo[k] else lo[k]
                hi[k] = v if v > hi[k] else hi[k]
        levels = np.float32(15 if kind == 1 else 31)
        for k in range(nbb):
            d[k] = np.float32(np.float32(hi[k] - lo[k]) / levels)
            idv[k] = np.float32(ONE / d[k]) if d[k] != 0 else ZERO
        for i in range(QK):
            for k in range(nbb):
                q = _cvtt(np.float32(np.float32(np.float32(X[i, k] - lo[k]) * idv[k]) + np.float32(0.5)))
                Q[i, k] = min(15, q) if kind == 1 else q & 0xFF  # Q5_1 goes through uint8_t unclamped
    else:  # Q4_0 / Q5_0 / Q8_0: the first value of largest magnitude (Q8_0 needs only the magnitude)
        amax = np.zeros(nbb, np.float32)
        vmax = np.zeros(nbb, np.float32)
        for i in range(QK):
            for k in range(nbb):
                v = X[i, k]
                bigger = abs(v) > amax[k]
                amax[k] = abs(v) if bigger else amax[k]
                vmax[k] = v if bigger else vmax[k]
        if kind == 4:
            for k in range(nbb):
                d[k] = np.float32(amax[k] / np.float32(127))
                idv[k] = np.float32(ONE / d[k]) if d[k] != 0 else ZERO
            for i in range(QK):
                for k in range(nbb):
                    s = np.float32(X[i, k] * idv[k])
                    r = np.floor(np.float64(abs(s)) + 0.5)  # roundf: halves away from zero (exact in float64)
                    r = r if s >= 0 else -r
                    inside = r > -2147483649.0 and r < 2147483648.0
                    Q[i, k] = (np.int64(r) if inside else np.int64(-2147483648)) & 0xFF
        else:
            half = 8 if kind == 0 else 16
            offset = np.float32(np.float32(half) + np.float32(0.5))
            for k in range(nbb):
                d[k] = np.float32(vmax[k] / np.float32(-half))
                idv[k] = np.float32(ONE / d[k]) if d[k] != 0 else ZERO
            for i in range(QK):
                for k in range(nbb):
                    Q[i, k] = min(2 * half - 1, _cvtt(np.float32(np.float32(X[i, k] * idv[k]) + offset)))
    q = np.empty(QK, np.int64)
    for k in range(nbb):
        ob = out[b0 + k]
        store_half(ob, 0, d[k])
        if kind == 4:
            for i in range(QK):
                ob[2 + i] = Q[i, k]
            continue
        if kind == 1 or kind == 3:
            store_half(ob, 2, lo[k])
        for i in range(QK):
            q[i] = Q[i, k]
        _pack_levels(q, kind, ob)


@kernel("void(float32[:, ::1], float32[:, ::1], float32[::1], int64, int64, int64, int64, uint8[:, ::1])")
def _weighted_blocks(x, qw, sigma2, first_block, b0, nbb, kind, out):
    """Blocks b0 … b0+nbb-1 with imatrix: weights qw·sqrt(σ² + x²), the searches run with one
    block per lane (``jit_lanes``), then each block's scale(s) and levels are stored."""
    per_row = qw.shape[0]
    X = np.empty((QK, nbb), np.float32)
    W = np.empty((QK, nbb), np.float32)
    Lx = np.empty((QK, nbb), np.int32)
    d = np.empty(nbb, np.float32)
    the_min = np.empty(nbb, np.float32)
    for k in range(nbb):
        q = qw[(first_block + b0 + k) % per_row]
        s2 = sigma2[b0 + k]
        for i in range(QK):
            v = x[b0 + k, i]
            X[i, k] = v
            W[i, k] = np.float32(q[i] * np.sqrt(np.float32(s2 + np.float32(v * v))))
    if kind == 0 or kind == 2:
        make_qx_lanes(X, W, 8 if kind == 0 else 16, Lx, d)
    elif kind == 1:
        make_qkx2_lanes(X, W, 15, -0.9, 0.05, 36, False, Lx, d, the_min)
    else:
        make_qkx2_lanes(X, W, 31, -0.9, 0.05, 36, False, Lx, d, the_min)
    q = np.empty(QK, np.int64)
    for k in range(nbb):
        ob = out[b0 + k]
        store_half(ob, 0, d[k])
        if kind == 1 or kind == 3:
            store_half(ob, 2, -the_min[k])
        for i in range(QK):
            q[i] = Lx[i, k]
        _pack_levels(q, kind, ob)


@kernel("void(float32[:, ::1], float32[:, ::1], float32[::1], int64, boolean, int64, uint8[:, ::1])")
def quantize_legacy_blocks(x, qw, sigma2, first_block, use_qw, kind, out):
    """Quantize blocks ``x`` [nb, 32] into ``out`` [nb, block_bytes].

    With ``use_qw``: ``qw`` [blocks_per_row, 32] are the imatrix columns of each block
    position in a row, ``sigma2`` [nb] the σ² of the row each block belongs to, and
    ``first_block`` the row position of ``x[0]``.  ``kind``: ``KIND[name]``.
    """
    nb = x.shape[0]
    if use_qw and kind != 4:
        for b0 in range(0, nb, BATCH):
            _weighted_blocks(x, qw, sigma2, first_block, b0, min(BATCH, nb - b0), kind, out)
        return
    for b0 in range(0, nb, BATCH):
        _plain_blocks(x, b0, min(BATCH, nb - b0), kind, out)
