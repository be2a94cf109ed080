"""Agreement of the CUDA few-row quantized matvec with the numpy reference (pytest-free, so the GPU
machine's ``bench/gpu_qmv.py`` and ``tests/test_cuda_qmv.py`` share it)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from hf2q.kernels import cuda_qmv
from hf2q.kernels.cpu_qmatvec_ref import qmatvec as reference


def check(bits: int, group_size: int, rows: int, N: int = 300, K: int = 512, dtype=mx.float16) -> float:
    """Max |ours − numpy reference| / max |reference| for one random case."""
    rng = np.random.default_rng(bits * 100 + rows)
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    s, b = s.astype(dtype), b.astype(dtype)
    x = mx.array(rng.standard_normal((rows, K)).astype(np.float32)).astype(dtype)
    got = np.array(cuda_qmv.qmv(x, wq, s, b, bits, group_size).astype(mx.float32))
    packed = np.array(wq).view(np.uint8).reshape(N, -1)
    want = reference(packed, np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32)),
                     np.array(x.astype(mx.float32)), bits, group_size)
    return float(np.abs(got - want).max() / np.abs(want).max())
