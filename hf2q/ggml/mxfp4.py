"""MXFP4 (``block_mxfp4``): 32 E2M1 codes sharing one E8M0 exponent, and the packing checkpoints use.

A ggml block is 17 bytes: the exponent byte, then 16 bytes where byte ``j`` holds code ``j`` in
its low nibble and code ``j + 16`` in its high one. A code is sign (bit 3) and a magnitude index
into 0, 0.5, 1, 1.5, 2, 3, 4, 6; ggml stores those magnitudes doubled (0…12 as int8) and halves
the exponent instead, which gives the same value: ``magnitude × 2^(e − 127)``.

DeepSeek-V4 (like compressed-tensors' "mxfp4-pack-quantized") packs the same codes by row in
pairs — value ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high one — with the
exponents in a separate ``[rows, cols / 32]`` tensor. Moving between the two layouts only moves
nibbles, so a converted checkpoint keeps its experts bit for bit.
"""

from __future__ import annotations

import numpy as np

from hf2q.errors import InputError

BLOCK = 32
BLOCK_BYTES = 17
#: E2M1 magnitudes by code (bit 3 is the sign)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
CODE_VALUES = np.concatenate([E2M1, -E2M1]).astype(np.float32)


def _exponent_scale(e: np.ndarray) -> np.ndarray:
    return np.exp2(e.astype(np.float64) - 127.0).astype(np.float32)


def check_packed(name: str, packed_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, cols)`` of a row-packed tensor, after checking that its exponents cover it."""
    if len(packed_shape) != 2:
        raise InputError(f"{name}: an MXFP4-packed weight must be 2-D, got shape {list(packed_shape)}")
    rows, cols = packed_shape[0], 2 * packed_shape[1]
    if cols % BLOCK:
        raise InputError(f"{name}: MXFP4 rows of {cols} values are not a multiple of {BLOCK}")
    if tuple(scale_shape) != (rows, cols // BLOCK):
        raise InputError(f"{name}: exponent shape {list(scale_shape)} does not match {[rows, cols // BLOCK]} "
                         f"(one per {BLOCK} values)")
    return rows, cols


def repack_rows(packed: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """Row-packed codes uint8 [rows, cols/2] + exponents uint8 [rows, cols/32] → ggml bytes [rows, cols/32 · 17]."""
    packed = np.ascontiguousarray(packed).view(np.uint8)
    rows = packed.shape[0]
    n_blocks = packed.shape[1] * 2 // BLOCK
    pairs = packed.reshape(rows, n_blocks, BLOCK // 2)
    codes = np.stack((pairs & 0x0F, pairs >> 4), axis=-1).reshape(rows, n_blocks, BLOCK)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate((np.ascontiguousarray(exponents).view(np.uint8)[..., None], qs), axis=-1)
    return out.reshape(rows, n_blocks * BLOCK_BYTES)


def decode_packed(packed: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """Row-packed codes + exponents → float32 [rows, cols] (the checkpoint's values)."""
    packed = np.ascontiguousarray(packed).view(np.uint8)
    codes = np.stack((packed & 0x0F, packed >> 4), axis=-1).reshape(packed.shape[0], -1)
    scale = np.repeat(_exponent_scale(np.ascontiguousarray(exponents).view(np.uint8)), BLOCK, axis=1)
    return CODE_VALUES[codes] * scale


def dequantize(raw: np.ndarray, n_per_row: int) -> np.ndarray:
    """ggml ``block_mxfp4`` bytes of whole rows → float32 [rows, n_per_row] (reference decoder)."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, BLOCK_BYTES)
    qs = blocks[:, 1:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=1)
    values = CODE_VALUES[codes] * _exponent_scale(blocks[:, :1])
    return values.reshape(-1, n_per_row)
