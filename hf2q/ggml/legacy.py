"""Vectorised Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 codecs (32-value blocks), bit-exact with llama.cpp.

Every function works on many blocks at once: ``x`` is float32 ``[nblocks, 32]`` and the
quantized form is uint8 ``[nblocks, block_bytes]``.  The arithmetic mirrors the C reference
(``quantize_row_q*_ref``) operation by operation in float32; see ``legacy_ref`` for
the plain per-block transcription it is tested against.
"""

from __future__ import annotations

import numpy as np

from .common import F32, fp16_bits, half_to_f32, take, u16_bytes

QK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The first value of largest magnitude per block, or +0 when all are zero (C keeps its init)."""
    ax = np.abs(x)
    idx = np.argmax(ax, axis=1)
    v = take(x, idx, 1)
    return np.where(take(ax, idx, 1) > 0, v, F32(0.0))


def _min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First minimal / maximal value per block (keeps the sign of a leading ±0 like the C scan)."""
    return take(x, np.argmin(x, axis=1), 1), take(x, np.argmax(x, axis=1), 1)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1.0) / d, F32(0.0)).astype(F32)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[nb, 32] values 0..15 → [nb, 16] bytes: element j in the low nibble, j+16 in the high one."""
    q = q.astype(np.uint8)
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def high_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of the 32 values gathered into a little-endian uint32 → [nb, 4] bytes."""
    bits = ((q.astype(np.uint32) >> 4) & 1) << np.arange(32, dtype=np.uint32)
    qh = np.bitwise_or.reduce(bits, axis=1).astype("<u4")
    return qh.view(np.uint8).reshape(-1, 4)


def _trunc_int(v: np.ndarray) -> np.ndarray:
    """C float → integer conversion (truncation toward zero)."""
    return np.trunc(v).astype(np.int32)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    d = _signed_absmax(x) / F32(-8)
    scaled = x * _inverse(d)[:, None]
    q = np.minimum(15, _trunc_int(scaled + F32(8.5)))
    return np.concatenate([u16_bytes(fp16_bits(d)), pack_nibbles(q)], axis=1)


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    d = _signed_absmax(x) / F32(-16)
    scaled = x * _inverse(d)[:, None]
    q = np.minimum(31, _trunc_int(scaled + F32(16.5)))
    return np.concatenate([u16_bytes(fp16_bits(d)), high_bits(q), pack_nibbles(q)], axis=1)


def _affine(x: np.ndarray, levels: int):
    mn, mx = _min_max(x)
    d = (mx - mn) / F32(levels)
    scaled = (x - mn[:, None]) * _inverse(d)[:, None]
    return d, mn, _trunc_int(scaled + F32(0.5))


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    d, mn, q = _affine(x, 15)
    q = np.minimum(15, q)
    return np.concatenate([u16_bytes(fp16_bits(d)), u16_bytes(fp16_bits(mn)), pack_nibbles(q)], axis=1)


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    d, mn, q = _affine(x, 31)
    q = q & 0xFF  # stored through uint8 in C, no clamp
    return np.concatenate([u16_bytes(fp16_bits(d)), u16_bytes(fp16_bits(mn)), high_bits(q), pack_nibbles(q)],
                          axis=1)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: halves away from zero (np.rint would round them to even)."""
    t = np.trunc(v)
    frac = v - t  # exact in float32
    return t + np.where(np.abs(frac) >= F32(0.5), np.sign(v), F32(0.0)).astype(F32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    amax = np.max(np.abs(x), axis=1)
    d = amax / F32(127)
    q = _roundf(x * _inverse(d)[:, None]).astype(np.int32).astype(np.int8)
    return np.concatenate([u16_bytes(fp16_bits(d)), q.view(np.uint8)], axis=1)


# ---------------------------------------------------------------- dequantize


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)


def _qh_bits(qh4: np.ndarray) -> np.ndarray:
    qh = np.ascontiguousarray(qh4).view("<u4")[:, 0]
    return ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32) << 4


def dequantize_q4_0(b: np.ndarray) -> np.ndarray:
    d = half_to_f32(b[:, 0:2])
    return (_nibbles(b[:, 2:18]) - 8).astype(F32) * d[:, None]


def dequantize_q4_1(b: np.ndarray) -> np.ndarray:
    d, m = half_to_f32(b[:, 0:2]), half_to_f32(b[:, 2:4])
    return _nibbles(b[:, 4:20]).astype(F32) * d[:, None] + m[:, None]


def dequantize_q5_0(b: np.ndarray) -> np.ndarray:
    d = half_to_f32(b[:, 0:2])
    q = (_nibbles(b[:, 6:22]) | _qh_bits(b[:, 2:6])) - 16
    return q.astype(F32) * d[:, None]


def dequantize_q5_1(b: np.ndarray) -> np.ndarray:
    d, m = half_to_f32(b[:, 0:2]), half_to_f32(b[:, 2:4])
    q = _nibbles(b[:, 8:24]) | _qh_bits(b[:, 4:8])
    return q.astype(F32) * d[:, None] + m[:, None]


def dequantize_q8_0(b: np.ndarray) -> np.ndarray:
    d = half_to_f32(b[:, 0:2])
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(F32) * d[:, None]


QUANTIZE = {"Q4_0": quantize_q4_0, "Q4_1": quantize_q4_1, "Q5_0": quantize_q5_0, "Q5_1": quantize_q5_1,
            "Q8_0": quantize_q8_0}
DEQUANTIZE = {"Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1, "Q5_0": dequantize_q5_0,
              "Q5_1": dequantize_q5_1, "Q8_0": dequantize_q8_0}
