"""Scalar float32 helpers for the plain reference codecs (``*_ref.py``).

The references are deliberately simple: one block at a time, one value at a time, every
intermediate an ``np.float32`` scalar so that the arithmetic is float32 like the C code.
They are slow and only used to cross-check the vectorised codecs.
"""

from __future__ import annotations

import struct

import numpy as np

f32 = np.float32
GROUP_MAX_EPS = f32(1e-15)


def nearest_int(v) -> int:
    """Round by adding 1.5·2**23 in float32 and reading the low mantissa bits (llama.cpp's trick)."""
    with np.errstate(over="ignore", invalid="ignore"):
        s = f32(f32(v) + f32(12582912.0))
    bits = struct.unpack("<i", struct.pack("<f", s))[0]
    return (bits & 0x007FFFFF) - 0x00400000


def to_half(v) -> int:
    """float32 → IEEE half bits, round to nearest even."""
    with np.errstate(over="ignore"):
        return int(np.float16(f32(v)).view(np.uint16))


def from_half(bits: int) -> np.float32:
    return f32(np.uint16(bits).view(np.float16))


def put_half(buf: bytearray, offset: int, v) -> None:
    buf[offset:offset + 2] = struct.pack("<H", to_half(v))


def get_half(buf, offset: int) -> np.float32:
    return from_half(struct.unpack_from("<H", bytes(buf[offset:offset + 2]))[0])


def div(a, b):
    """float32 a / b without numpy's divide-by-zero warnings (callers guard the zero cases)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return f32(f32(a) / f32(b))


def to_blocks(fn, x: np.ndarray, nbytes: int) -> np.ndarray:
    """Apply a one-block quantizer (list of floats → bytes) to every row of ``x`` [nblocks, block]."""
    out = np.zeros((x.shape[0], nbytes), dtype=np.uint8)
    with np.errstate(all="ignore"):  # float32 overflow to inf is part of the C behaviour we copy
        for i, block in enumerate(np.asarray(x, dtype=f32)):
            out[i] = np.frombuffer(bytes(fn(block)), dtype=np.uint8)
    return out


def from_blocks(fn, raw: np.ndarray, n: int) -> np.ndarray:
    """Apply a one-block dequantizer (bytes → n floats) to every row of ``raw`` [nblocks, nbytes]."""
    out = np.zeros((raw.shape[0], n), dtype=f32)
    for i, block in enumerate(np.asarray(raw, dtype=np.uint8)):
        out[i] = fn(bytes(block))
    return out
