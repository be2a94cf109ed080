"""Compiled Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 quantizers (32-value blocks), with and without imatrix.

The plain quantizers follow ``quantize_row_q*_ref`` (one scale from the block's extremes);
with an importance matrix they follow ``quantize_row_q*_impl``: weights
``qw·sqrt(σ²_row + x²)``, then the weighted ``make_qx_quants`` (Q4_0/Q5_0) or
``make_qkx3_quants`` (Q4_1/Q5_1) search, run on ``BATCH`` blocks side by side.  Float → int conversions copy x86's truncating
``cvttss2si`` (INT_MIN for NaN), which is what the numpy codec and llama.cpp's build do.
``quantize_legacy_blocks`` is the one entry point.
"""

# ruff: noqa: PLR1730  (explicit comparisons keep C's NaN behaviour, which min()/max() would not)

from __future__ import annotations

import numpy as np

from .ggml_jit_common import ONE, ZERO, first_absmax, kernel, store_half, trunc_int
from .ggml_jit_lanes import make_qkx2_lanes, make_qx_lanes

QK = 32
KIND = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
BATCH = 64  # imatrix blocks searched side by side (one SIMD lane each)


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


@kernel("float32(float32)")
def _inverse(d):
    return np.float32(ONE / d) if d != 0 else ZERO


@kernel("float32(float32[::1], int64, int64[::1])")
def _symmetric(x, half, q):
    """Q4_0 (half 8) / Q5_0 (half 16): d = first-absmax / -half, q = trunc(x/d + half + 0.5) ≤ 2·half-1."""
    _, vmax = first_absmax(x)
    d = np.float32(vmax / np.float32(-half))
    idv = _inverse(d)
    offset = np.float32(np.float32(half) + np.float32(0.5))
    for j in range(QK):
        v = trunc_int(np.float32(np.float32(x[j] * idv) + offset))
        q[j] = min(2 * half - 1, v)
    return d


@kernel("UniTuple(float32, 2)(float32[::1], int64, int64[::1])")
def _affine(x, levels, q):
    """Q4_1 / Q5_1: d = (max - min) / levels, q = trunc((x - min)/d + 0.5)."""
    lo = np.float32(3.4028234663852886e38)
    hi = -lo
    for j in range(QK):
        if x[j] < lo:
            lo = x[j]
        if x[j] > hi:
            hi = x[j]
    d = np.float32(np.float32(hi - lo) / np.float32(levels))
    idv = _inverse(d)
    for j in range(QK):
        q[j] = trunc_int(np.float32(np.float32(np.float32(x[j] - lo) * idv) + np.float32(0.5)))
    return d, lo


@kernel("void(float32[::1], uint8[::1])")
def _q8_0(x, out):
    amax = ZERO
    for j in range(QK):
        a = abs(x[j])
        if a > amax:
            amax = a
    d = np.float32(amax / np.float32(127))
    idv = _inverse(d)
    store_half(out, 0, d)
    for j in range(QK):
        s = np.float32(x[j] * idv)
        r = np.floor(np.float64(abs(s)) + 0.5)  # roundf: halves away from zero (exact in float64)
        out[2 + j] = trunc_int(r if s >= 0 else -r) & 0xFF


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


@kernel("void(float32[::1], int64, int64[::1], uint8[::1])")
def _plain_block(x, kind, q, out):
    if kind == 4:
        _q8_0(x, out)
        return
    if kind == 0 or kind == 2:
        store_half(out, 0, _symmetric(x, 8 if kind == 0 else 16, q))
    else:
        d, lo = _affine(x, 15 if kind == 1 else 31, q)
        store_half(out, 0, d)
        store_half(out, 2, lo)
        for j in range(QK):  # Q4_1 clamps; Q5_1 goes through uint8_t unclamped
            q[j] = min(15, q[j]) if kind == 1 else q[j] & 0xFF
    _pack_levels(q, kind, out)


@kernel("void(float32[:, ::1], float32[:, ::1], float32[::1], int64, int64, int64, int64, uint8[:, ::1])")
def _weighted_blocks(x, qw, sigma2, first_block, b0, nbb, kind, out):
    """Blocks b0 … b0+nbb-1 with imatrix: weights qw·sqrt(σ² + x²), the searches run with one
    block per lane (``ggml_jit_lanes``), then each block's scale(s) and levels are stored."""
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
    q = np.empty(QK, np.int64)
    for b in range(nb):
        _plain_block(x[b], kind, q, out[b])
