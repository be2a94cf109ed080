"""DeepSeek-V4's manifold-constrained hyper-connections: the residual is ``n`` parallel streams.

Each block reads one input from the ``n`` streams and writes its output back into all of them. The
mixing weights are not fixed: a linear map of the (weightlessly RMS-normalised, flattened) streams of
each token gives ``n`` *pre* weights (σ + ε: how much of each stream the block reads), ``n`` *post*
weights (2σ: how much of the block's output each stream receives) and an ``n × n`` *comb* matrix that
carries the old streams over. Comb is a softmax made doubly stochastic by Sinkhorn-Knopp iterations
(columns, then alternately rows and columns), which keeps the stream norms from growing with depth.
Everything here runs in float32 whatever the compute type: the weights feed an iterative
normalisation that low precision would bias.
"""

from __future__ import annotations

import mlx.core as mx

from hf2q.engine.layers import float_array
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile


def _plain_rms(x: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


class HyperConnection:
    """One mixing site (before attention or before the feed-forward) of one block."""

    def __init__(self, g: GGUFFile, prefix: str, n: int, hidden: int, iterations: int, hc_eps: float,
                 norm_eps: float):
        self.fn = float_array(g.tensor(prefix + "fn.weight"), mx.float32)  # [(2 + n)·n, n·hidden]
        self.base = float_array(g.tensor(prefix + "base.weight"), mx.float32).reshape(-1)
        self.scale = float_array(g.tensor(prefix + "scale.weight"), mx.float32).reshape(-1)
        if tuple(self.fn.shape) != ((2 + n) * n, n * hidden) or self.scale.shape[0] != 3:
            raise InputError(f"{g.path.name}: {prefix}fn.weight has shape {tuple(self.fn.shape)}, expected "
                             f"{((2 + n) * n, n * hidden)} for {n} hyper-connection streams")
        self.n, self.iterations, self.hc_eps, self.norm_eps = n, iterations, hc_eps, norm_eps

    def weights(self, streams: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``streams [B, T, n, hidden]`` → ``(pre [B, T, n], post [B, T, n], comb [B, T, n, n])``."""
        n, eps = self.n, self.hc_eps
        B, T = streams.shape[:2]
        flat = _plain_rms(streams.reshape(B, T, -1).astype(mx.float32), self.norm_eps)
        mixed = flat @ self.fn.T
        base, scale = self.base, self.scale
        pre = mx.sigmoid(mixed[..., :n] * scale[0] + base[:n]) + eps
        post = 2 * mx.sigmoid(mixed[..., n:2 * n] * scale[1] + base[n:2 * n])
        comb_logits = mixed[..., 2 * n:].reshape(B, T, n, n) * scale[2] + base[2 * n:].reshape(n, n)
        comb = mx.softmax(comb_logits, axis=-1, precise=True) + eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        return pre, post, comb

    def __call__(self, streams: mx.array, block) -> mx.array:
        """The streams after ``block`` (a function of one ``[B, T, hidden]`` input) read and wrote them."""
        pre, post, comb = self.weights(streams)
        dtype = streams.dtype
        collapsed = (pre[..., None] * streams).sum(axis=2).astype(dtype)
        out = block(collapsed)
        # comb carries stream j into stream k with weight comb[j, k]: the transposed product
        carried = mx.swapaxes(comb, -1, -2).astype(dtype) @ streams
        return post.astype(dtype)[..., None] * out[..., None, :] + carried


class HyperHead:
    """The final collapse of the streams into one hidden state (pre weights only, no Sinkhorn)."""

    def __init__(self, g: GGUFFile, n: int, hc_eps: float, norm_eps: float):
        self.fn = float_array(g.tensor("output_hc_fn.weight"), mx.float32)  # [n, n·hidden]
        self.base = float_array(g.tensor("output_hc_base.weight"), mx.float32).reshape(-1)
        self.scale = float_array(g.tensor("output_hc_scale.weight"), mx.float32).reshape(-1)
        self.n, self.hc_eps, self.norm_eps = n, hc_eps, norm_eps

    def __call__(self, streams: mx.array) -> mx.array:
        B, T = streams.shape[:2]
        flat = _plain_rms(streams.reshape(B, T, -1).astype(mx.float32), self.norm_eps)
        pre = mx.sigmoid((flat @ self.fn.T) * self.scale[0] + self.base) + self.hc_eps
        return (pre[..., None] * streams).sum(axis=2).astype(streams.dtype)
