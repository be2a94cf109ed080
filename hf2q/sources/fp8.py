"""8-bit float formats of safetensors checkpoints, and the block scaling DeepSeek stores them with.

``F8_E4M3`` (the "fn" variant: no infinities, one NaN pattern per sign) and ``F8_E5M2`` hold
weights; ``F8_E8M0`` is a bare biased exponent (2^(b-127), 0xFF = NaN) used as the scale of a
block. Each format has 256 codes, so decoding is one table lookup, exact in float32.

DeepSeek's FP8 matrices carry a ``.scale`` tensor with one factor per 128×128 block (the last
row/column blocks may be partial); the factor is an E8M0 exponent or, in older releases, a
float32. The float value of a weight is ``fp8 × scale of its block``.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from hf2q.errors import InputError

BLOCK = 128  # rows and columns covered by one scale


def _minifloat(exp_bits: int, man_bits: int, bias: int, *, ieee_specials: bool) -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes >> 7, -1.0, 1.0)
    e = (codes >> man_bits) & ((1 << exp_bits) - 1)
    m = codes & ((1 << man_bits) - 1)
    frac = m / float(1 << man_bits)
    val = np.where(e == 0, frac * 2.0 ** (1 - bias), (1.0 + frac) * 2.0 ** (e.astype(np.float64) - bias))
    out = sign * val
    top = (1 << exp_bits) - 1
    if ieee_specials:  # E5M2: exponent all ones is inf / NaN
        out = np.where((e == top) & (m == 0), sign * np.inf, out)
        out = np.where((e == top) & (m != 0), np.nan, out)
    else:  # E4M3fn: only S.1111.111 is NaN
        out = np.where((e == top) & (m == (1 << man_bits) - 1), np.nan, out)
    return out.astype(np.float32)


@cache
def e4m3_table() -> np.ndarray:
    return _minifloat(4, 3, 7, ieee_specials=False)


@cache
def e5m2_table() -> np.ndarray:
    return _minifloat(5, 2, 15, ieee_specials=True)


@cache
def e8m0_table() -> np.ndarray:
    out = np.exp2(np.arange(256, dtype=np.float64) - 127.0)
    out[255] = np.nan
    return out.astype(np.float32)


#: safetensors dtype → its 256-entry float32 table
TABLES = {"F8_E4M3": e4m3_table, "F8_E5M2": e5m2_table, "F8_E8M0": e8m0_table}
#: the dtypes a block scale may have
SCALE_DTYPES = ("F8_E8M0", "F32", "BF16", "F16")


def block_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows, cols = shape
    return -(-rows // BLOCK), -(-cols // BLOCK)


def check_block_scale(name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    if len(weight_shape) != 2:
        raise InputError(f"{name}: an FP8 block-scaled weight must be 2-D, got shape {list(weight_shape)}")
    if tuple(scale_shape) != block_scale_shape(weight_shape):
        raise InputError(f"{name}: scale shape {list(scale_shape)} does not cover {list(weight_shape)} in "
                         f"{BLOCK}×{BLOCK} blocks (expected {list(block_scale_shape(weight_shape))})")


def dequantize_rows(values: np.ndarray, scales: np.ndarray, first_row: int) -> np.ndarray:
    """float32 weight rows ``[first_row, first_row + len(values))`` times their blocks' float32 scales."""
    n, cols = values.shape
    rows = np.arange(first_row, first_row + n) // BLOCK
    per_row = scales[rows]  # [n, column blocks]
    return values * np.repeat(per_row, BLOCK, axis=1)[:, :cols]
