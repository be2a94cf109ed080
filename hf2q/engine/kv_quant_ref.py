"""The numpy twin of ``kv_quant``: the same codes, scales, rotation and attention in float64, written
from the definitions rather than from MLX's kernels, so a test can hold the MLX path to it."""

from __future__ import annotations

import numpy as np

from hf2q.engine.kv_layout import hadamard
from hf2q.engine.kv_quant import LEVELS, OFFSET, group_size


def encode(x: np.ndarray, scale_dtype=np.float32, rotated: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``x [..., d]`` → ``(codes uint8 [..., d] in [1, 255], scales [..., d/group])``."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    if rotated:
        x = x @ hadamard(d)
    g = group_size(d)
    groups = x.reshape(*x.shape[:-1], d // g, g)
    scale = (np.abs(groups).max(axis=-1) / LEVELS).astype(scale_dtype)
    safe = np.where(scale == 0, 1, scale).astype(np.float64)[..., None]
    codes = np.clip(np.rint(groups / safe), -LEVELS, LEVELS) + OFFSET
    return codes.reshape(x.shape).astype(np.uint8), scale


def decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    d = codes.shape[-1]
    g = group_size(d)
    q = codes.astype(np.float64).reshape(*codes.shape[:-1], d // g, g) - OFFSET
    return (q * scales.astype(np.float64)[..., None]).reshape(codes.shape)


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, mask: np.ndarray | None,
              rotated: bool = False, scale_dtype=np.float32) -> np.ndarray:
    """Softmax attention of ``q [B, heads, L, d]`` over ``keys``/``values [B, kv_heads, T, d]`` as the
    8-bit cache holds them (encoded here), grouped-query heads sharing a KV head."""
    d = q.shape[-1]
    k = decode(*encode(keys, scale_dtype, rotated))
    v = decode(*encode(values, scale_dtype, rotated))
    q = np.asarray(q, dtype=np.float64) * scale
    if rotated:
        q = q @ hadamard(d)
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ np.swapaxes(k, -1, -2)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v
    return out @ hadamard(d) if rotated else out
