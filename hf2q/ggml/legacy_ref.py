"""Plain per-block reference for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (one value at a time).

Written from the block definitions in ggml-common.h and the algorithm of
``quantize_row_q*_ref``; used only to cross-check ``legacy`` (the fast path).
"""

from __future__ import annotations

import math
import struct
from functools import partial

import numpy as np

from .scalar_ref import div, f32, from_blocks, get_half, put_half, to_blocks

QK = 32


def _absmax_signed(block):
    amax, vmax = f32(0), f32(0)
    for v in block:
        if amax < abs(v):
            amax, vmax = abs(v), v
    return vmax


def _min_max(block):
    lo, hi = f32(np.finfo(np.float32).max), f32(-np.finfo(np.float32).max)
    for v in block:
        lo = min(lo, v)
        hi = max(hi, v)
    return lo, hi


def _sym_block(block, levels: int):
    """Q4_0 (levels 16) / Q5_0 (levels 32): d = max / -(levels/2), q = trunc(x/d + levels/2 + .5)."""
    half = levels // 2
    d = div(_absmax_signed(block), -half)
    idv = div(1, d) if d else f32(0)
    q = [min(levels - 1, int(f32(f32(v * idv) + f32(half + 0.5)))) for v in block]
    return d, q


def _affine_block(block, levels: int):
    lo, hi = _min_max(block)
    d = div(hi - lo, levels - 1)
    idv = div(1, d) if d else f32(0)
    q = [int(f32(f32((v - lo) * idv) + f32(0.5))) for v in block]
    return d, lo, q


def _nibbles(q):
    return bytes((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4) for j in range(16))


def _qh(q):
    qh = 0
    for j in range(32):
        qh |= ((q[j] >> 4) & 1) << j
    return struct.pack("<I", qh)


def quantize_block_q4_0(block):
    d, q = _sym_block(block, 16)
    out = bytearray(18)
    put_half(out, 0, d)
    out[2:] = _nibbles(q)
    return out


def quantize_block_q5_0(block):
    d, q = _sym_block(block, 32)
    out = bytearray(22)
    put_half(out, 0, d)
    out[2:6] = _qh(q)
    out[6:] = _nibbles(q)
    return out


def quantize_block_q4_1(block):
    d, lo, q = _affine_block(block, 16)
    out = bytearray(20)
    put_half(out, 0, d)
    put_half(out, 2, lo)
    out[4:] = _nibbles([min(15, v) for v in q])
    return out


def quantize_block_q5_1(block):
    d, lo, q = _affine_block(block, 32)
    q = [v & 0xFF for v in q]
    out = bytearray(24)
    put_half(out, 0, d)
    put_half(out, 2, lo)
    out[4:8] = _qh(q)
    out[8:] = _nibbles(q)
    return out


def quantize_block_q8_0(block):
    amax = f32(0)
    for v in block:
        amax = max(amax, abs(v))
    d = div(amax, 127)
    idv = div(1, d) if d else f32(0)
    out = bytearray(34)
    put_half(out, 0, d)
    for j, v in enumerate(block):
        s = f32(v * idv)
        r = math.floor(abs(s) + 0.5) * (1 if s >= 0 else -1)  # roundf: halves away from zero (exact in float64)
        out[2 + j] = r & 0xFF
    return out


def _unpack(raw, qs_off, qh_off=None):
    q = []
    for j in range(32):
        byte = raw[qs_off + (j % 16)]
        v = byte & 0xF if j < 16 else byte >> 4
        if qh_off is not None:
            qh = struct.unpack_from("<I", raw, qh_off)[0]
            v |= ((qh >> j) & 1) << 4
        q.append(v)
    return q


def dequantize_block_q4_0(raw):
    d = get_half(raw, 0)
    return [f32(f32(v - 8) * d) for v in _unpack(raw, 2)]


def dequantize_block_q4_1(raw):
    d, m = get_half(raw, 0), get_half(raw, 2)
    return [f32(f32(v) * d + m) for v in _unpack(raw, 4)]


def dequantize_block_q5_0(raw):
    d = get_half(raw, 0)
    return [f32(f32(v - 16) * d) for v in _unpack(raw, 6, 2)]


def dequantize_block_q5_1(raw):
    d, m = get_half(raw, 0), get_half(raw, 2)
    return [f32(f32(v) * d + m) for v in _unpack(raw, 8, 4)]


def dequantize_block_q8_0(raw):
    d = get_half(raw, 0)
    return [f32(f32(v) * d) for v in struct.unpack_from("<32b", raw, 2)]


_SIZES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
_Q = {"Q4_0": quantize_block_q4_0, "Q4_1": quantize_block_q4_1, "Q5_0": quantize_block_q5_0,
      "Q5_1": quantize_block_q5_1, "Q8_0": quantize_block_q8_0}
_D = {"Q4_0": dequantize_block_q4_0, "Q4_1": dequantize_block_q4_1, "Q5_0": dequantize_block_q5_0,
      "Q5_1": dequantize_block_q5_1, "Q8_0": dequantize_block_q8_0}


def _quantize_blocks(name, x):
    return to_blocks(_Q[name], x, _SIZES[name])


def _dequantize_blocks(name, raw):
    return from_blocks(_D[name], raw, QK)


QUANTIZE = {name: partial(_quantize_blocks, name) for name in _Q}
DEQUANTIZE = {name: partial(_dequantize_blocks, name) for name in _D}
