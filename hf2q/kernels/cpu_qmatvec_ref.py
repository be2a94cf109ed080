"""Plain numpy reference for :mod:`hf2q.kernels.cpu_qmatvec` (tests only).

What the C kernel computes, written the obvious way: unpack MLX's little-endian bit stream
to integers, dequantize every 32-group as ``scale·q + bias``, multiply by ``x`` in float64.
It shares none of the kernel's tricks (nibble reordering, row × batch tiles, prefetch,
per-width loops), so the tests can hold the kernel to it for every width and batch size.
"""

from __future__ import annotations

import numpy as np


def unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """``packed`` bytes ``[rows, n*bits/8]`` (MLX's uint32 words viewed as bytes) → uint8 ``[rows, n]``:
    element ``i`` of a row is bits ``[i*bits, (i+1)*bits)`` of the row's little-endian bit stream."""
    raw = np.ascontiguousarray(packed).view(np.uint8)
    rows = raw.shape[0]
    stream = np.unpackbits(raw.reshape(rows, -1), axis=1, bitorder="little")[:, : n * bits]
    weights = (1 << np.arange(bits, dtype=np.uint16))
    return (stream.reshape(rows, n, bits).astype(np.uint16) * weights).sum(axis=2).astype(np.uint8)


def dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
               group_size: int = 32) -> np.ndarray:
    """float64 ``[rows, n]``: ``scale[r, g]·q[r, i] + bias[r, g]`` with ``g = i // group_size``."""
    n = scales.shape[1] * group_size
    q = unpack(packed, bits, n).astype(np.float64).reshape(scales.shape[0], -1, group_size)
    w = q * scales.astype(np.float64)[..., None] + biases.astype(np.float64)[..., None]
    return w.reshape(scales.shape[0], n)


def qmatvec(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, x: np.ndarray, bits: int,
            group_size: int = 32) -> np.ndarray:
    """``x [batch, n]`` → ``[batch, rows]`` float64, the exact value the kernels approximate in float32."""
    return np.asarray(x, dtype=np.float64) @ dequantize(packed, scales, biases, bits, group_size).T
