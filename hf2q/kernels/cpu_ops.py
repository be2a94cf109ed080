"""CPU replacements for the MLX ops that are slow on MLX's Linux CPU backend.

MLX's CPU ``exp``/``sigmoid``/``tanh`` run ~10x slower than numpy's SIMD loops (measured:
softmax over 512x1536x9 scores 370 ms vs 34 ms), which made attention and the MLP
activations dominate prefill. On the CPU device, for tensors large enough that the
host round trip is noise, these helpers evaluate the input, do the transcendental part
on the host (in place, float32) and hand back an MLX array. Attention goes to the fused
kernel of ``cpu_attention`` when it applies (a numpy path stays for the rest); the
``*_inplace`` activations serve the host prefill MLP of ``hf2q.engine.layers`` directly
(SwiGLU as one vectorised C pass, row slices on the BLAS workers). Small tensors
(decode) stay in MLX.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

HOST_MIN_ELEMENTS = 1 << 15


def _use_host(x: mx.array) -> bool:
    return mx.default_device() == mx.cpu and x.size >= HOST_MIN_ELEMENTS and x.dtype == mx.float32


def _host(x: mx.array) -> np.ndarray:
    mx.eval(x)
    return np.array(x, copy=True)


def silu_mul_inplace(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``g ← silu(g) * u`` on float32 numpy arrays, in place (row slices on the BLAS workers)."""
    from hf2q.kernels import cpu_attention

    def part(gs: np.ndarray, us: np.ndarray) -> None:
        if cpu_attention.silu_mul_inplace(gs, us):
            return
        e = np.negative(gs)
        np.exp(e, out=e)
        e += 1.0
        np.divide(gs, e, out=gs)
        gs *= us

    _by_rows(part, g, u)
    return g


def gelu_tanh_mul_inplace(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``g ← gelu_tanh(g) * u`` on float32 numpy arrays, in place: one C pass (``cpu_attention``, as
    ``g·u / (1 + e^-2z)``) where the kernel takes the arrays, else numpy's tanh form; row slices on the BLAS
    workers."""
    from hf2q.kernels import cpu_attention

    def part(gs: np.ndarray, us: np.ndarray) -> None:
        if cpu_attention.gelu_tanh_mul_inplace(gs, us):
            return
        t = gs * gs
        t *= 0.044715 * gs
        t += gs
        t *= math.sqrt(2.0 / math.pi)
        np.tanh(t, out=t)
        t += 1.0
        t *= 0.5
        gs *= t
        gs *= us

    _by_rows(part, g, u)
    return g


def _by_rows(fn, g: np.ndarray, u: np.ndarray) -> None:
    """``fn`` over row slices of 2-D ``g, u`` on the BLAS workers (numpy drops the GIL in ufuncs)."""
    from hf2q.kernels import cpu_blas

    p = cpu_blas.pool()
    n = cpu_blas.active_threads() if p is not None else 1
    if n == 1 or g.ndim != 2 or g.shape[0] < 2 * 64:
        fn(g, u)
        return
    bounds = [g.shape[0] * i // n for i in range(n + 1)]
    for f in [p.submit(fn, g[a:b], u[a:b]) for a, b in zip(bounds, bounds[1:])]:
        f.result()


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up``."""
    if not _use_host(gate):
        return gate * mx.sigmoid(gate) * up
    return mx.array(silu_mul_inplace(_host(gate), _host(up)))


def gelu_tanh_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``gelu_tanh(gate) * up`` (Gemma's GeGLU)."""
    if not _use_host(gate):
        return 0.5 * gate * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate ** 3))) * up
    return mx.array(gelu_tanh_mul_inplace(_host(gate), _host(up)))


QUERY_BLOCK = 256


def _attention_block(q, keys, values, scale, mask_np):
    B, H, T, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    rep = H // Hkv
    scores = (q * scale).reshape(B, Hkv, rep * T, D) @ keys.transpose(0, 1, 3, 2)
    s = _host(scores).reshape(B, Hkv, rep, T, L)
    if mask_np is not None:
        np.putmask(s, ~np.broadcast_to(mask_np[:, :, None, :, :], s.shape), -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    out = mx.array(s.reshape(B, Hkv, rep * T, L)) @ values
    return out.reshape(B, H, T, values.shape[-1])


def attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask_np: np.ndarray | None) -> mx.array:
    """Grouped-query attention ``[B, H, T, D]`` with the softmax on the host.

    Heads that share a KV head are stacked so each QKᵀ and PV product is one large matmul.
    Long chunks go in blocks of ``QUERY_BLOCK`` queries, each against only the key range
    its mask allows (the causal triangle and sliding window are skipped, and the score
    block stays cache-sized). ``mask_np``: bool ``[B, 1, T, L]`` (True = attend) or None.
    The fused C kernel of :mod:`hf2q.kernels.cpu_attention` serves every case it can; this
    numpy path remains for the rest (no compiler, no fast BLAS, an irregular mask).
    """
    from hf2q.kernels import cpu_attention

    fused = cpu_attention.attention(q, keys, values, scale, mask_np)
    if fused is not None:
        return fused
    T, L = q.shape[2], keys.shape[2]
    if T <= QUERY_BLOCK:
        return _attention_block(q, keys, values, scale, mask_np)
    outs = []
    for t0 in range(0, T, QUERY_BLOCK):
        t1 = min(T, t0 + QUERY_BLOCK)
        k0, k1, m = 0, L, None
        if mask_np is not None:
            m = mask_np[:, :, t0:t1, :]
            cols = np.flatnonzero(m.any(axis=(0, 1, 2)))
            k0, k1 = int(cols[0]), int(cols[-1]) + 1
            m = m[..., k0:k1]
            if m.all():
                m = None
        outs.append(_attention_block(q[:, :, t0:t1], keys[:, :, k0:k1], values[:, :, k0:k1], scale, m))
    return mx.concatenate(outs, axis=2)


def attention_on_host(q: mx.array, n_keys: int) -> bool:
    return mx.default_device() == mx.cpu and q.dtype == mx.float32 and q.shape[1] * q.shape[2] * n_keys >= HOST_MIN_ELEMENTS
