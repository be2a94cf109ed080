"""Q4_1 / Q5_1 blocks as the affine triple DWQ trains: scale ``d``, min ``m`` and integer codes ``q``.

A Q4_1 (Q5_1) block stores 32 weights as ``x ≈ d·q + m`` with ``d`` and ``m`` in float16 and ``q`` in
0..15 (0..31): exactly mlx-lm's affine form at group size 32, which is why the distillation that fits
mlx's scales and biases carries over to these two GGML types and to no other (the K-quants keep their
per-32 scales as 6-bit codes under a shared float16, too coarse for sub-percent moves; docs/QUALITY.md,
"DWQ"). This module converts between the block bytes and that triple, and re-rounds the codes of
source weights against fitted ``d``/``m`` so the written block is the best one for the fitted pair.
"""

from __future__ import annotations

import attrs
import gguf
import numpy as np

from hf2q.ggml.common import fp16_bits, half_to_f32, u16_bytes
from hf2q.ggml.legacy import QK, _nibbles, _qh_bits, high_bits, pack_nibbles

T = gguf.GGMLQuantizationType
BITS = {T.Q4_1: 4, T.Q5_1: 5}


@attrs.frozen
class AffineBlocks:
    """One tensor's blocks, row-major: ``d``/``m`` float16 ``[rows, cols/32]``, ``q`` uint8 ``[rows, cols]``."""

    d: np.ndarray
    m: np.ndarray
    q: np.ndarray

    def weights(self) -> np.ndarray:
        """float32 ``d·q + m``: what llama.cpp decodes the blocks to."""
        rows, cols = self.q.shape
        g = self.q.reshape(rows, cols // QK, QK).astype(np.float32)
        d, m = self.d.astype(np.float32)[..., None], self.m.astype(np.float32)[..., None]
        return (g * d + m).reshape(rows, cols)

    def take_rows(self, order: np.ndarray) -> AffineBlocks:
        return AffineBlocks(self.d[order], self.m[order], self.q[order])


def _bits(qtype) -> int:
    try:
        return BITS[T(qtype)]
    except (KeyError, ValueError):
        raise ValueError(f"affine blocks are Q4_1 or Q5_1, not {T(qtype).name}") from None


def unpack(raw: np.ndarray, qtype, shape: tuple[int, int]) -> AffineBlocks:
    """GGML bytes of a ``[rows, cols]`` Q4_1/Q5_1 tensor → its (d, m, q)."""
    bits = _bits(qtype)
    rows, cols = shape
    b = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(rows * cols // QK, -1)
    d = half_to_f32(b[:, 0:2]).astype(np.float16)
    m = half_to_f32(b[:, 2:4]).astype(np.float16)
    qs = b[:, 4:20] if bits == 4 else b[:, 8:24]
    q = _nibbles(qs) | (_qh_bits(b[:, 4:8]) if bits == 5 else 0)  # the codes, as the GGML codec reads them
    per_row = cols // QK
    return AffineBlocks(d.reshape(rows, per_row), m.reshape(rows, per_row), q.astype(np.uint8).reshape(rows, cols))


def pack(blocks: AffineBlocks, qtype) -> np.ndarray:
    """(d, m, q) → the GGML bytes, ``[rows, row_bytes]`` uint8."""
    bits = _bits(qtype)
    rows, cols = blocks.q.shape
    q = blocks.q.reshape(-1, QK)
    d = u16_bytes(fp16_bits(blocks.d.astype(np.float32).reshape(-1)))
    m = u16_bytes(fp16_bits(blocks.m.astype(np.float32).reshape(-1)))
    parts = [d, m] + ([high_bits(q)] if bits == 5 else []) + [pack_nibbles(q)]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def reround(x: np.ndarray, d: np.ndarray, m: np.ndarray, qtype) -> AffineBlocks:
    """The codes of ``x`` (float32 ``[rows, cols]``) nearest to ``d·q + m`` for the given float16 d/m.

    Rounding to nearest of ``(x − m)/d`` clamped to the code range is the exact minimiser per weight, so
    after a fit has moved ``d``/``m`` this is the block that best reproduces the source under them. A
    zero scale (a constant block) keeps code 0.
    """
    levels = (1 << _bits(qtype)) - 1
    rows, cols = x.shape
    df = d.astype(np.float32).reshape(rows, cols // QK, 1)
    mf = m.astype(np.float32).reshape(rows, cols // QK, 1)
    g = x.astype(np.float32).reshape(rows, cols // QK, QK)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(df != 0, (g - mf) / df, 0.0)
    q = np.clip(np.floor(t + 0.5), 0, levels).astype(np.uint8)
    return AffineBlocks(d.astype(np.float16), m.astype(np.float16), q.reshape(rows, cols))
