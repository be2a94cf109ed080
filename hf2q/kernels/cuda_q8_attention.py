"""Attention of a decode step over the 8-bit KV cache on NVIDIA GPUs, reading the codes as stored.

On the CPU and Metal, ``KvCodec.attend`` is two ``mx.quantized_matmul`` calls. MLX's CUDA backend has
no kernel for either: ``q·Kᵀ`` is a batch of small products over a cache slice that is not
row-contiguous, and ``p·V`` is an untransposed quantized product. Dequantizing the cache every
step would read and write three times the bytes the codes hold. This split-K ("flash decoding")
kernel gives each warp 32·NC consecutive positions of one (sequence, KV head). Each lane scores
one position against every query row of that KV head (grouped-query heads × tokens of the step),
with the queries in shared memory. The warp then takes an online softmax over its chunk and
accumulates the dequantized values. The partial results (unnormalised sums, running max, sum of
exponentials) are merged here with a few MLX ops.

The kernel body is ``csrc/cuda_q8_attention.cu``. Math: :func:`hf2q.engine.kv_quant_ref.attention` (the
numpy twin the tests hold it to). Used by ``KvCodec.attend`` on a CUDA device for steps of at most
``MAX_ROWS`` query rows per KV head; longer prefill chunks take one dequantized copy per chunk.
"""

from __future__ import annotations

import mlx.core as mx

from hf2q.kernels.cuda_source import CudaKernel

#: most query rows per KV head one call takes (grouped-query heads × tokens in the step)
MAX_ROWS = 16
#: the kernel's queries live in shared memory: rows × key width at most this many floats
MAX_QUERY_FLOATS = 8192
#: positions of one (sequence, KV head) a warp scores per chunk; NC chunks a warp (see the .cu)
CHUNK = 32
WARPS = 4

#: the kernel, its body compiled by ``mx.fast.cuda_kernel`` on first use (shipped as package data)
KERNEL = CudaKernel("hf2q_q8_attention", "cuda_q8_attention.cu", ["q", "kc", "ks", "vc", "vs", "mask"],
                    ["acc", "mmax", "lsum"], ensure_row_contiguous=False)


def takes(rows: int, key_width: int, value_width: int) -> bool:
    """Whether a step of ``rows`` query rows per KV head over rows of these widths is one this kernel serves."""
    pow2 = 1 << max(rows - 1, 0).bit_length()
    return (1 <= rows <= MAX_ROWS and key_width % 32 == 0 and value_width % 32 == 0
            and pow2 * key_width <= MAX_QUERY_FLOATS)


def units(positions: int, heads: int) -> int:
    """Warps (partials) per (sequence, KV head): the same rule the kernel applies."""
    nc = max(1, (positions * heads + 32767) // 32768)
    return -(-positions // (CHUNK * nc))


def attend(q: mx.array, keys: tuple[mx.array, mx.array], values: tuple[mx.array, mx.array],
           mask: mx.array | None, group_k: int, group_v: int) -> mx.array:
    """``q`` float32 ``[B, kv_heads, R, d]`` (scaled, in the stored space; row ``r`` is token ``r % L``)
    over 8-bit ``keys``/``values`` planes ``[B, kv_heads, T, ·]``; ``mask`` bool ``[B, 1, L, T]`` or
    None. Returns float32 ``[B, kv_heads, R, dv]``."""
    B, kvh, R, d = q.shape
    kc, ks = keys
    vc, vs = values
    T, dv = kc.shape[-2], vc.shape[-1] * 4
    if not takes(R, d, dv) or kc.shape[-1] * 4 != d:
        raise ValueError(f"cuda q8 attention: {R} rows of width {d}/{dv} is not a shape it takes")
    # read in place through their strides: the cache's planes are slices along positions of buffers whose
    # last axis is dense (rows are read as 16-byte words), never transposed views
    planes = [kc, ks, vc, vs]
    if mask is None:
        m_in, has_mask = mx.zeros((1, 1, 1), dtype=mx.bool_), False
    else:
        m_in, has_mask = mx.contiguous(mask[:, 0]), True
        if m_in.shape[-1] != T:
            raise ValueError(f"cuda q8 attention: mask over {m_in.shape[-1]} positions, cache holds {T}")
    max_rows = 1 << max(R - 1, 0).bit_length()
    u = units(T, B * kvh)
    groups = -(-u // WARPS)
    acc, mmax, lsum = KERNEL(
        inputs=[mx.contiguous(q.reshape(B * kvh, R, d).astype(mx.float32)), *planes, m_in],
        template=[("S_", ks.dtype), ("D_", d), ("DV_", dv), ("GK_", group_k), ("GV_", group_v),
                  ("MAX_R_", max_rows), ("HAS_MASK_", has_mask)],
        grid=(B * kvh * groups * 32 * WARPS, 1, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(B * kvh, u, R, dv), (B * kvh, u, R), (B * kvh, u, R)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    # merge the warps' partials (a merge kernel of one warp per query row measured slower on the H200)
    top = mx.max(mmax, axis=1, keepdims=True)
    w = mx.exp(mmax - top)  # units that saw no position: max −inf, weight 0
    out = mx.sum(acc * w[..., None], axis=1) / mx.sum(lsum * w, axis=1)[..., None]
    return out.reshape(B, kvh, R, dv)
