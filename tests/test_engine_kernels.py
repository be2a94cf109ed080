"""CPU replacements for slow MLX CPU ops, each against the MLX op it replaces."""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from hf2q.kernels import cpu_ops, cpu_qmatvec


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_qmatvec_matches_mlx_quantized_matmul(bits):
    if cpu_qmatvec.kernel() is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(bits)
    w = mx.array(rng.standard_normal((300, 576)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=32, bits=bits)
    mx.eval(wq, s, b)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    ref = np.array(mx.quantized_matmul(mx.array(x), wq, s, b, transpose=True, group_size=32, bits=bits))
    got = cpu_qmatvec.qmatvec(np.asarray(memoryview(wq)).view(np.uint8).reshape(300, -1),
                              np.asarray(memoryview(s)), np.asarray(memoryview(b)), x, bits)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("T", [64, 600])  # 600: several query blocks, each on its own key range
def test_host_attention_matches_sdpa(T):
    rng = np.random.default_rng(0)
    B, H, Hkv, L, D = 1, 6, 2, T + 64, 32
    q = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, Hkv, L, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hkv, L, D)).astype(np.float32))
    qpos = 64 + np.arange(T)[:, None]
    kpos = np.arange(L)[None, :]
    mask = ((kpos <= qpos) & (kpos > qpos - 24))[None, None]  # causal + sliding window
    assert cpu_ops.attention_on_host(q, L)
    got = np.array(cpu_ops.attention(q, k, v, 0.2, mask))
    ref = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mx.array(mask)))
    np.testing.assert_allclose(got, ref, atol=1e-5)
    got = np.array(cpu_ops.attention(q, k, v, 0.2, None))
    ref = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2))
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_host_activations_match_mlx():
    rng = np.random.default_rng(1)
    g = mx.array(rng.standard_normal((1, 64, 1024)).astype(np.float32) * 3)
    u = mx.array(rng.standard_normal((1, 64, 1024)).astype(np.float32))
    np.testing.assert_allclose(np.array(cpu_ops.silu_mul(g, u)), np.array(g * mx.sigmoid(g) * u), atol=1e-5)
    ref = np.array(mx.multiply(mx.array(0.5) * g * (1 + mx.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))), u))
    np.testing.assert_allclose(np.array(cpu_ops.gelu_tanh_mul(g, u)), ref, atol=1e-5)


def test_fast_blas_is_loaded():
    from hf2q.kernels import cpu_blas

    status = cpu_blas.status()
    assert status.startswith("openblas") or "disabled" in status or "unavailable" in status
