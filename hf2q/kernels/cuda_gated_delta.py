"""The gated delta rule on NVIDIA GPUs: the recurrent state stays in registers for a whole chunk.

``mx.fast.gated_delta_update`` on MLX's CUDA backend launches work per token, so a 512-token
prefill chunk at Qwen3.5-9B head shapes costs tens of milliseconds per linear-attention layer.
The recurrence itself is tiny (a ``Dv × Dk`` state per value head); this kernel gives each state
row one warp that loads the row once, runs every token of the call in registers (decay, ``S·k``
warp reduction, delta update, ``S·q`` reduction) and stores it once. Tokens stay sequential, rows
run in parallel, which keeps an H200 busy from a few heads upwards.

Kernel body: ``csrc/cuda_gated_delta.cu``; math: :mod:`hf2q.kernels.gated_delta_ref` (numpy, the
reference it is tested against). Used by :class:`hf2q.engine.models.qwen35.GatedDeltaNet` on a
CUDA device; the CPU has its own (:mod:`hf2q.kernels.cpu_gated_delta`), Metal keeps ``mx.fast.gated_delta_update``.
"""

from __future__ import annotations


import mlx.core as mx

from hf2q.kernels.cuda_qmv import available
from hf2q.kernels.cuda_source import CudaKernel

__all__ = ["available", "gated_delta", "takes"]

#: state rows (warps) per block
WARPS_PER_BLOCK = 4

#: the kernel, its body compiled by ``mx.fast.cuda_kernel`` on first use (shipped as package data)
KERNEL = CudaKernel("hf2q_gated_delta", "cuda_gated_delta.cu",
                    ["q", "k", "v", "gamma", "beta", "state_in"], ["y", "state_out"])


def takes(k_dim: int, k_heads: int, v_heads: int) -> bool:
    """Whether this kernel serves a layer with these head shapes (callers also check :func:`available`)."""
    return k_dim % 32 == 0 and 32 <= k_dim <= 256 and k_heads > 0 and v_heads % k_heads == 0


def gated_delta(q: mx.array, k: mx.array, v: mx.array, gamma: mx.array, beta: mx.array,
                state: mx.array) -> tuple[mx.array, mx.array]:
    """``q, k [B, T, Hk, Dk]``, ``v [B, T, H, Dv]``, ``gamma, beta [B, T, H]``, ``state [B, H, Dv, Dk]``
    → ``(y [B, T, H, Dv], final state)`` in float32; value head ``h`` reads key head ``h mod Hk``."""
    B, T, H, Dv = v.shape
    Hk, Dk = q.shape[2], q.shape[3]
    if not takes(Dk, Hk, H) or k.shape != q.shape or q.shape[:2] != (B, T) or state.shape != (B, H, Dv, Dk) \
            or gamma.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"gated_delta: shapes q{q.shape} k{k.shape} v{v.shape} gamma{gamma.shape} "
                         f"beta{beta.shape} state{state.shape} do not fit one layer")
    f32 = mx.float32
    rows = B * H * Dv
    y, out = KERNEL(
        inputs=[q.astype(f32), k.astype(f32), v.astype(f32), gamma.astype(f32), beta.astype(f32), state.astype(f32)],
        template=[("DK_", Dk), ("HK_", Hk)],
        grid=(((rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK) * 32 * WARPS_PER_BLOCK, 1, 1),
        threadgroup=(32 * WARPS_PER_BLOCK, 1, 1),
        output_shapes=[(B, T, H, Dv), (B, H, Dv, Dk)],
        output_dtypes=[f32, f32],
    )
    return y, out
