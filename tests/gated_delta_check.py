"""Agreement of a gated-delta implementation with the numpy reference (pytest-free, so the GPU
machine's ``bench/gpu_gated_delta.py`` and ``tests/test_gated_delta.py`` share it)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from hf2q.kernels.gated_delta_ref import gated_delta as reference


def random_case(B: int, T: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    """Inputs shaped as a Qwen 3.5 layer makes them: unit-norm keys, decays in (0.3, 1), rates in (0, 1)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, hk, dk)).astype(np.float32) * dk ** -0.5
    k = rng.standard_normal((B, T, hk, dk)).astype(np.float32)
    k /= np.sqrt((k * k).sum(-1, keepdims=True))
    v = rng.standard_normal((B, T, hv, dv)).astype(np.float32)
    gamma = rng.uniform(0.3, 1.0, (B, T, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (B, T, hv)).astype(np.float32)
    state = (rng.standard_normal((B, hv, dv, dk)) * 0.1).astype(np.float32)
    return q, k, v, gamma, beta, state


def check(fn, B: int, T: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0) -> tuple[float, float]:
    """Max |fn − reference| of y and of the final state for one random case; ``fn`` takes and returns
    MLX arrays with the reference's signature (value head h reads key head h mod hk)."""
    case = random_case(B, T, hk, hv, dk, dv, seed)
    y, s = fn(*(mx.array(a) for a in case))
    y_ref, s_ref = reference(*case)
    return float(np.abs(np.array(y) - y_ref).max()), float(np.abs(np.array(s) - s_ref).max())
