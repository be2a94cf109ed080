"""The gated delta rule: MLX's fused op (as the Qwen 3.5 layer calls it), the step-by-step MLX loop
and the CUDA kernel all agree with the numpy reference."""

from __future__ import annotations

import mlx.core as mx
import pytest

from hf2q.engine.models.qwen35 import gated_delta_reference
from hf2q.kernels import cuda_gated_delta
from tests.gated_delta_check import check

SHAPES = [(1, 1, 2, 4, 32, 16), (2, 9, 2, 4, 64, 32), (1, 70, 4, 4, 128, 128), (1, 33, 16, 32, 128, 128)]


def _tiled(fn):
    """``fn`` over value-head-tiled queries and keys (value head h reads key head h mod Hk)."""
    def run(q, k, v, gamma, beta, state):
        reps = (1, 1, v.shape[2] // q.shape[2], 1)
        return fn(mx.tile(q, reps), mx.tile(k, reps), v, gamma, beta, state)
    return run


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_mlx_loop_matches_numpy(shape):
    dy, ds = check(_tiled(gated_delta_reference), *shape)
    assert dy < 1e-4 and ds < 1e-4


@pytest.mark.parametrize("shape", SHAPES)
def test_mlx_fused_op_matches_numpy(shape):
    dy, ds = check(_tiled(mx.fast.gated_delta_update), *shape)
    assert dy < 1e-4 and ds < 1e-4


def test_kernel_takes_only_whole_warps_of_key_dims():
    assert cuda_gated_delta.takes(128, 16, 32) and cuda_gated_delta.takes(32, 2, 2)
    assert not cuda_gated_delta.takes(48, 2, 4)   # a key dim that is not whole warps
    assert not cuda_gated_delta.takes(128, 3, 4)  # value heads that are not a multiple of key heads
    assert not cuda_gated_delta.takes(512, 2, 4)  # more registers per lane than the kernel keeps


@pytest.mark.skipif(not cuda_gated_delta.available(), reason="needs MLX on an NVIDIA GPU (mlx-cuda)")
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_kernel_matches_numpy(shape):
    dy, ds = check(cuda_gated_delta.gated_delta, *shape)
    assert dy < 1e-4 and ds < 1e-4


def test_fused_layer_preparation_matches_the_plain_ops():
    """The traced (fused) form of the DeltaNet layer's conv/normalise/gates step, used on CUDA, computes
    what the op-by-op form does."""
    import numpy as np

    from hf2q.engine.models import qwen35

    rng = np.random.default_rng(3)
    hk, hv, dk, dv, K = 2, 4, 32, 16, 4
    C = 2 * hk * dk + hv * dv
    arrays = [mx.array(rng.standard_normal(shape).astype(np.float32)) for shape in
              ((2, 5, C), (2, K - 1, C), (K, C), (2, 5, hv), (2, 5, hv), (hv,))]
    a = -mx.exp(mx.array(rng.uniform(-1, 1, hv).astype(np.float32)))
    args = (*arrays, a, hk, dk, hv, dv, 1e-6)
    for plain, fused in zip(qwen35._prepare(*args), qwen35._prepare_compiled(*args)):
        np.testing.assert_allclose(np.array(fused), np.array(plain), rtol=1e-5, atol=1e-6)
