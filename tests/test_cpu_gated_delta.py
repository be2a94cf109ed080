"""The CPU gated-delta kernel (``hf2q.kernels.cpu_gated_delta``) against the float64 numpy reference and MLX's
``mx.fast.gated_delta_update``: tiled value heads, a state row count that is not a whole block, a carried-in
state, and a chunk cut in two equal to it whole."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from hf2q.kernels import cpu_gated_delta
from hf2q.kernels.gated_delta_ref import gated_delta as reference

pytestmark = pytest.mark.skipif(not cpu_gated_delta.available(), reason="the CPU kernel (a C compiler, the CPU)")


def _inputs(B=2, T=37, Hk=2, H=6, Dk=32, Dv=20, seed=0):
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k = r.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((B, T, H, Dv)).astype(np.float32)
    gamma = r.uniform(0.6, 1.0, (B, T, H)).astype(np.float32)
    beta = r.uniform(0.0, 1.0, (B, T, H)).astype(np.float32)
    state = (r.standard_normal((B, H, Dv, Dk)) * 0.3).astype(np.float32)
    return q, k, v, gamma, beta, state


def test_the_kernel_equals_the_reference_and_mlx():
    q, k, v, g, b, s = _inputs()
    y, st = cpu_gated_delta.gated_delta(*(mx.array(a) for a in (q, k, v, g, b, s)))
    want_y, want_s = reference(q, k, v, g, b, s)
    np.testing.assert_allclose(np.array(y), want_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(st), want_s, rtol=1e-4, atol=1e-4)
    reps = (1, 1, 3, 1)  # MLX's op wants the key heads tiled to the value heads
    my, ms = mx.fast.gated_delta_update(mx.tile(mx.array(q), reps), mx.tile(mx.array(k), reps),
                                        *(mx.array(a) for a in (v, g, b, s)))
    np.testing.assert_allclose(np.array(y), np.array(my), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(st), np.array(ms), rtol=1e-4, atol=1e-4)


def test_a_chunk_in_two_calls_is_the_whole_chunk_exactly():
    q, k, v, g, b, s = (mx.array(a) for a in _inputs(B=1, T=40, Hk=4, H=8, Dk=64, Dv=64, seed=1))
    whole_y, whole_s = cpu_gated_delta.gated_delta(q, k, v, g, b, s)
    y1, s1 = cpu_gated_delta.gated_delta(q[:, :17], k[:, :17], v[:, :17], g[:, :17], b[:, :17], s)
    y2, s2 = cpu_gated_delta.gated_delta(q[:, 17:], k[:, 17:], v[:, 17:], g[:, 17:], b[:, 17:], s1)
    assert np.array_equal(np.array(mx.concatenate([y1, y2], axis=1)), np.array(whole_y))
    assert np.array_equal(np.array(s2), np.array(whole_s))


def test_impossible_shapes_are_refused():
    q, k, v, g, b, s = (mx.array(a) for a in _inputs())
    with pytest.raises(ValueError):
        cpu_gated_delta.gated_delta(q, k, v[:, :, :5], g, b, s)
