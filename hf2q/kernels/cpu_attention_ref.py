"""Plain numpy reference for :mod:`hf2q.kernels.cpu_attention` (tests only).

Grouped-query softmax attention written the obvious way — full score matrix, boolean
mask, max-subtracted softmax in float64 — so the fused kernel (tiles, online softmax,
polynomial exp, skipped tiles) has an independent oracle that shares none of its tricks.
"""

from __future__ import annotations

import numpy as np


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: np.ndarray | None) -> np.ndarray:
    """``q [B, H, T, D]``, ``k [B, Hkv, L, D]``, ``v [B, Hkv, L, Dv]``, ``mask`` bool ``[B, 1, T, L]``
    (True = attend) or None → ``[B, H, T, Dv]`` float32. Query head ``h`` reads KV head ``h // (H // Hkv)``."""
    B, H, T, _ = q.shape
    rep = H // k.shape[1]
    kk = np.repeat(k.astype(np.float64), rep, axis=1)
    vv = np.repeat(v.astype(np.float64), rep, axis=1)
    s = np.einsum("bhtd,bhld->bhtl", q.astype(np.float64) * scale, kk)
    if mask is not None:
        s = np.where(np.broadcast_to(mask, s.shape), s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhtl,bhld->bhtd", p, vv).astype(np.float32)
