"""The CUDA attention over the 8-bit KV cache (``hf2q.kernels.cuda_q8_attention``): which steps it takes,
and — on a machine with an NVIDIA GPU — that it agrees with the numpy twin (``kv_quant_ref.attention``)
over cache-like planes (the live prefix of a larger buffer), many warps' partials, masks and widths."""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from hf2q.engine import kv_quant_ref as ref
from hf2q.engine.kv_quant import make_codec
from hf2q.kernels import cuda_q8_attention, cuda_qmv


def test_which_steps_it_takes():
    assert cuda_q8_attention.takes(1, 128, 128) and cuda_q8_attention.takes(16, 128, 128)
    assert cuda_q8_attention.takes(4, 512, 512)  # 4 rows × 512 queries fit shared memory
    assert not cuda_q8_attention.takes(17, 128, 128)  # a prefill chunk: the dequantized path
    assert not cuda_q8_attention.takes(16, 1024, 1024)
    assert not cuda_q8_attention.takes(2, 80, 80)  # widths the 8-bit cache does not store


def test_units_split_long_caches_across_more_warps():
    assert cuda_q8_attention.units(32, 8) == 1 and cuda_q8_attention.units(33, 8) == 2
    assert cuda_q8_attention.units(4096, 8) == 128  # one chunk of 32 a warp
    # past 32768 (positions × heads) a warp takes several chunks: the warp count stays near 1024
    assert cuda_q8_attention.units(16384, 8) == 16384 // (32 * 4)


@pytest.mark.skipif(not cuda_qmv.available(), reason="needs MLX on an NVIDIA GPU (mlx-cuda)")
@pytest.mark.parametrize("kind", ["q8", "q8-rotated"])
@pytest.mark.parametrize("width,rep,L,T,dtype", [
    (128, 4, 1, 1500, "float16"),   # a decode step, grouped-query heads, 47 warps' partials
    (64, 2, 3, 200, "float32"),     # a three-token verify step, causal mask
    (256, 1, 1, 9000, "float16"),   # several chunks per warp
])
def test_kernel_agrees_with_the_numpy_twin(kind, width, rep, L, T, dtype):
    rng = np.random.default_rng(width + T)
    B, kvh = 2, 2
    np_dtype = np.dtype(dtype)
    q = rng.normal(size=(B, kvh * rep, L, width)).astype(np_dtype)
    k = rng.normal(size=(B, kvh, T, width)).astype(np_dtype)
    k[..., 3] *= 20.0  # an outlier channel
    v = rng.normal(size=(B, kvh, T, width)).astype(np_dtype)
    mask = np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None]
    mask = np.broadcast_to(mask, (B, 1, L, T)).copy()
    mask[1, :, :, T - 7:] = False  # the second sequence is shorter (padding)
    codec = make_codec(kind, width, getattr(mx, dtype), "llama")
    # the cache's buffers hold room beyond the live prefix: the kernel reads a slice, not a copy
    room = T + 37

    def planes(x):
        codes, scales = codec.encode(mx.array(x))
        buf_c = mx.zeros((B, kvh, room, codes.shape[-1]), dtype=codes.dtype)
        buf_s = mx.zeros((B, kvh, room, scales.shape[-1]), dtype=scales.dtype)
        buf_c[:, :, :T] = codes
        buf_s[:, :, :T] = scales
        return buf_c[:, :, :T], buf_s[:, :, :T]

    got = codec.attend(mx.array(q).astype(getattr(mx, dtype)), planes(k), planes(v), width ** -0.5,
                       mx.array(mask))
    want = ref.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), width ** -0.5, mask,
                         rotated=kind == "q8-rotated", scale_dtype=np.float16 if dtype == "float16" else np.float32)
    tol = 2e-5 if dtype == "float32" else 2e-3  # the output's own rounding
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=tol * np.abs(want).max(), rtol=0)
