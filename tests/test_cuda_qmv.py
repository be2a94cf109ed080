"""The CUDA few-row quantized matvec (``hf2q.kernels.cuda_qmv``): which calls it takes, that
``Linear`` routes exactly those to it, and — on a machine with an NVIDIA GPU — that it agrees
with the numpy reference (``cpu_qmatvec_ref``) for 4/8 bits, 32/64 groups, float16/bfloat16."""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from hf2q.kernels import cuda_qmv


@pytest.mark.skipif(not cuda_qmv.available(), reason="needs MLX on an NVIDIA GPU (mlx-cuda)")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("rows", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kernel_agrees_with_the_numpy_reference(bits, group_size, rows, dtype):
    from tests.cuda_qmv_check import check

    # half-precision inputs: the error of rounding the output to the input dtype
    assert check(bits, group_size, rows, dtype=getattr(mx, dtype)) < (2e-3 if dtype == "float16" else 1e-2)


def test_which_calls_it_takes():
    big = (12288, 4096)
    assert cuda_qmv.takes(4, *big, 8, 32)
    assert cuda_qmv.takes(2, *big, 4, 64) and cuda_qmv.takes(cuda_qmv.MAX_ROWS, *big, 4, 128)
    assert cuda_qmv.takes(1, *big, 8, 32)  # one row too: a verify's rows then round as plain decode steps
    assert not cuda_qmv.takes(cuda_qmv.MAX_ROWS + 1, *big, 8, 32)  # MLX's tiled kernel from 8 rows
    assert not cuda_qmv.takes(4, *big, 6, 32)  # widths other than 4 and 8
    assert not cuda_qmv.takes(4, *big, 8, 16)
    assert not cuda_qmv.takes(4, 1024, 4096, 8, 32)  # small matrices: MLX fills the GPU better
    assert not cuda_qmv.takes(4, 4096, 4112, 8, 32)  # a width that is not whole groups


def test_linear_routes_few_rows_on_cuda_to_the_kernel(monkeypatch):
    """Without a GPU: ``Linear`` calls the kernel for 1-7 rows of a big 4/8-bit matrix when
    ``available()``, and MLX's ``quantized_matmul`` otherwise (here a stand-in records the calls)."""
    from hf2q.engine.layers import Linear

    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((4096, 4096)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=32, bits=8)
    lin = Linear.__new__(Linear)
    lin.weight, lin.scales, lin.biases, lin.bits, lin.group_size = wq, s, b, 8, 32
    lin.shape, lin.quantized, lin.bias, lin.dtype, lin._host = (4096, 4096), True, None, mx.float32, None
    monkeypatch.setattr(Linear, "on_host", lambda self, rows: False)
    calls = []

    def fake_qmv(x, *args):
        calls.append(x.shape)
        return mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=8)
    monkeypatch.setattr(cuda_qmv, "qmv", fake_qmv)
    monkeypatch.setattr("hf2q.engine.layers.on_cpu", lambda: False)
    x4 = mx.array(rng.standard_normal((4, 1, 4096)).astype(np.float32))
    for avail in (False, True):
        monkeypatch.setattr(cuda_qmv, "available", lambda: avail)
        lin._ready(host=None)  # where its products run is fixed at load
        calls.clear()
        y = lin(x4)
        lin(x4[:1])  # one row: the same kernel, so it rounds as the rows of a bigger call
        lin(mx.concatenate([x4, x4], axis=0))  # eight rows: MLX's tiled kernel
        assert calls == ([(4, 1, 4096), (1, 1, 4096)] if avail else [])
        want = mx.quantized_matmul(x4, wq, s, b, transpose=True, group_size=32, bits=8)
        np.testing.assert_allclose(np.array(y), np.array(want), rtol=1e-6, atol=1e-6)
