"""Qwen3-MoE: the Qwen3 attention block with a routed mixture-of-experts feed-forward.

The router picks ``expert_used_count`` experts per token from a softmax over
``ffn_gate_inp``; their weights are renormalised to sum to one (``norm_topk_prob``, what
llama.cpp does for this architecture). Expert weights stay stacked ``[E, out, in]`` and
run through one ``gather_qmm`` / ``gather_mm`` per projection, never a Python loop (in the layout
``expert_route`` picks).
"""

from __future__ import annotations

import mlx.core as mx

from hf2q.engine.expert_route import ExpertRoute
from hf2q.engine.layers import Linear, silu
from hf2q.engine.models.decoder import DecoderModel
from hf2q.engine.models.llama import common_config
from hf2q.formats.gguf_file import GGUFFile


class MoEFeedForward:
    def __init__(self, g: GGUFFile, i: int, dtype, top_k: int, normalize: bool):
        p = f"blk.{i}."
        self.router = Linear(g.tensor(p + "ffn_gate_inp.weight"), dtype)
        self.gate_exps = Linear(g.tensor(p + "ffn_gate_exps.weight"), dtype)
        self.up_exps = Linear(g.tensor(p + "ffn_up_exps.weight"), dtype)
        self.down_exps = Linear(g.tensor(p + "ffn_down_exps.weight"), dtype)
        self.top_k = top_k
        self.normalize = normalize

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = mx.softmax(self.router(flat).astype(mx.float32), axis=-1, precise=True)
        k = self.top_k
        idx = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k])
        weights = mx.take_along_axis(probs, idx, axis=-1)
        if self.normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        route = ExpertRoute.of(idx, self.gate_exps.shape[0])
        return route.glu(flat, [self.gate_exps, self.up_exps], self.down_exps, silu, weights).reshape(shape)


def build(g: GGUFFile, dtype) -> DecoderModel:
    cfg = common_config(g, traditional=False)
    cfg.qk_norm = True
    top_k, normalize = g.hparams.expert_used_count, g.hparams.expert_weights_norm
    return DecoderModel(cfg, g, dtype, lambda i: MoEFeedForward(g, i, dtype, top_k, normalize))
