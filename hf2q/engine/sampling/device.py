"""The device back-end of the sampling chain: token sampling inside the MLX graph, so decode
steps can be pipelined.

When the next token is picked on the host, every decode step ends in a device→host sync
and the next step's graph cannot be built until the logits arrive: on a GPU the Python
graph construction (~5 ms for a 36-layer model) then adds to the kernel time instead of
overlapping it. Sampling on the device lets the runner feed step *n*'s token array
straight into step *n+1* and evaluate asynchronously (``MlxModelRunner.decode_async``);
the host reads step *n*'s token while step *n+1* runs.

The chain is the host back-end's (:class:`~hf2q.engine.sampling.host.Sampler`) for the settings it
covers — temperature (0 → argmax), top-k, top-p (over the top-k survivors), min-p — and
the chosen token's logprob is the log-softmax of the raw logits, as there. Draws use the
Gumbel-max trick with one seeded MLX key per request (same seed → same tokens).
Penalties, ``logit_bias``, constraints and ``top_logprobs`` need the host; requests that
use them keep the synchronous path (``hf2q.engine.sampling.device_capable``).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

#: the top-p comparison tolerance of the numpy sampler (keeps both chains on the same side of ties)
TOP_P_EPS = 1e-12


class DeviceSampler:
    """One request's device sampling state: its parameters and its RNG key."""

    def __init__(self, params):
        self.params = params
        seed = params.seed if params.seed is not None else int(np.random.default_rng().integers(2**31))
        self._key = mx.random.key(int(seed) % (2**32))

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def keep_mask(self, x: mx.array) -> tuple[mx.array | None, mx.array, mx.array]:
        """``(order, values, keep)``: values best-first (ids ``order``) when top-k / top-p need a
        ranking, else in id order with ``order`` None; ``keep`` marks the tokens that survive."""
        p = self.params
        m = mx.max(x)
        order = mx.argsort(-x) if (p.top_k or p.top_p < 1.0) else None
        xs = x if order is None else x[order]
        keep = mx.ones(xs.shape, dtype=mx.bool_)
        if order is not None:
            rank = mx.arange(xs.shape[0])
            if p.top_k and p.top_k < xs.shape[0]:
                keep = rank < p.top_k
            if p.top_p < 1.0:
                e = mx.where(keep, mx.exp((xs - m).astype(mx.float32)), 0.0)
                z = mx.sum(e)
                before = (mx.cumsum(e) - e) / z  # mass of the better tokens
                keep = mx.logical_and(keep, before < p.top_p - TOP_P_EPS)
        if p.min_p > 0.0:
            keep = mx.logical_and(keep, xs >= m + math.log(p.min_p))
        return order, xs, keep

    def sample(self, x: mx.array) -> mx.array:
        """One row of float32 logits ``[V]`` → the token id (a scalar int32 array, lazy)."""
        p = self.params
        if p.temperature == 0.0:
            return mx.argmax(x).astype(mx.int32)
        order, xs, keep = self.keep_mask(x)
        gumbel = -mx.log(-mx.log(mx.random.uniform(low=1e-20, high=1.0, shape=xs.shape, key=self.next_key())))
        pick = mx.argmax(mx.where(keep, xs / p.temperature + gumbel, -mx.inf))
        return (pick if order is None else order[pick]).astype(mx.int32)

    def probabilities(self, x: mx.array) -> mx.array:
        """The sampling distribution over the vocabulary in id order (for tests and diagnostics)."""
        order, xs, keep = self.keep_mask(x)
        w = mx.where(keep, xs / max(self.params.temperature, 1e-9), -mx.inf)
        probs = mx.softmax(w)
        if order is None:
            return probs
        return mx.zeros_like(probs).at[order].add(probs)


def sample_rows(logits: mx.array, samplers) -> tuple[mx.array, mx.array]:
    """``logits [N, V]`` float32, one sampler per row → lazy ``(tokens [N] int32, logprobs [N] float32)``."""
    lse = mx.logsumexp(logits, axis=-1)
    if all(s.params.temperature == 0.0 for s in samplers):
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    else:
        tokens = mx.stack([s.sample(logits[i]) for i, s in enumerate(samplers)])
    chosen = mx.take_along_axis(logits, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
    return tokens, chosen - lse
