"""Plain numpy reference for :mod:`hf2q.kernels.cpu_decode_ops` (tests only), in float64.

Each function states one C op on ordinary arrays (no strides, no in-place buffers, no raw
addresses), so the tests can check the compiled ops one by one.
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Over the last axis: ``x / sqrt(mean(x²) + eps) · w``."""
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, traditional: bool) -> np.ndarray:
    """``x [B, heads, D]`` rotated pairwise by angles with ``cos, sin [B, d/2]``; dims ≥ d unchanged.
    Pairs are ``(2i, 2i+1)`` when ``traditional`` else ``(i, i + d/2)``."""
    half = cos.shape[1]
    out = x.astype(np.float64).copy()
    c, s = cos[:, None, :], sin[:, None, :]
    i1 = np.arange(half) * 2 if traditional else np.arange(half)
    i2 = i1 + 1 if traditional else i1 + half
    x1, x2 = out[..., i1].copy(), out[..., i2].copy()
    out[..., i1] = x1 * c - x2 * s
    out[..., i2] = x1 * s + x2 * c
    return out


def attend(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray], pos: list[int], window: int,
           scale: float) -> np.ndarray:
    """``q [B, H, D]``; ``keys[b], values[b]`` ``[Hkv, ≥ pos[b] + 1, D]`` (the new position already
    stored); query head ``h`` attends over positions ``[lo, pos[b]]`` of KV head ``h // (H / Hkv)``,
    ``lo = max(0, pos - window + 1)`` when ``window > 0``. → ``[B, H, D]``."""
    B, H, D = q.shape
    out = np.zeros((B, H, D))
    for b in range(B):
        rep = H // keys[b].shape[0]
        lo = max(0, pos[b] + 1 - window) if window > 0 else 0
        for h in range(H):
            K = keys[b][h // rep, lo:pos[b] + 1].astype(np.float64)
            V = values[b][h // rep, lo:pos[b] + 1].astype(np.float64)
            s = K @ q[b, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ V
    return out


def glu(gate: np.ndarray, up: np.ndarray, kind: int) -> np.ndarray:
    """``act(gate) · up``; kind 0: SiLU, 1: GELU (tanh approximation)."""
    g = gate.astype(np.float64)
    if kind == 0:
        a = g / (1.0 + np.exp(-g))
    else:
        a = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
    return a * up
