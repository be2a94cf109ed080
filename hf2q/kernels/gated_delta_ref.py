"""The gated delta rule in numpy, one token at a time: the reference every implementation of the
recurrence is tested against (MLX's ``mx.fast.gated_delta_update``, the step-by-step MLX loop in
:mod:`hf2q.engine.models.qwen35` and the CUDA kernel :mod:`hf2q.kernels.cuda_gated_delta`).

Per value head and token: ``S ← γ·S``; ``S ← S + β·(v − S k) kᵀ``; ``y = S q`` over the state
``S [Dv, Dk]``. Value head ``h`` reads key head ``h mod Hk`` (the tiled layout of Qwen 3.5 GGUFs).
"""

from __future__ import annotations

import numpy as np


def gated_delta(q: np.ndarray, k: np.ndarray, v: np.ndarray, gamma: np.ndarray, beta: np.ndarray,
                state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``q, k [B, T, Hk, Dk]``, ``v [B, T, H, Dv]``, ``gamma, beta [B, T, H]``, ``state [B, H, Dv, Dk]``
    → ``(y [B, T, H, Dv], final state)``, in float64 for a reference free of rounding order."""
    q, k, v, gamma, beta = (np.asarray(a, dtype=np.float64) for a in (q, k, v, gamma, beta))
    S = np.array(state, dtype=np.float64)
    B, T, H, Dv = v.shape
    Hk = q.shape[2]
    heads = np.arange(H) % Hk
    y = np.empty((B, T, H, Dv))
    for t in range(T):
        kt, qt = k[:, t, heads], q[:, t, heads]  # [B, H, Dk]
        S *= gamma[:, t, :, None, None]
        remembered = np.einsum("bhvk,bhk->bhv", S, kt)
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        S += delta[..., None] * kt[:, :, None, :]
        y[:, t] = np.einsum("bhvk,bhk->bhv", S, qt)
    return y, S
