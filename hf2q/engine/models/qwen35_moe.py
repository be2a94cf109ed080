"""Qwen 3.5 / 3.6 MoE (``qwen35moe``): the ``qwen35`` hybrid blocks with a routed feed-forward.

Each block's feed-forward is the Qwen3-MoE router (softmax over ``ffn_gate_inp``, top
``expert_used_count``, weights renormalised to sum to one) plus a shared expert, a SwiGLU of its
own size whose output is scaled per token by ``σ(ffn_gate_inp_shexp · x)``. That gate is one row, stored
``[hidden]`` (as llama.cpp's loader takes it, and hf2q's converter writes it) or ``[1, hidden]`` (llama.cpp's
converter): read as the latter either way, so it gives one value per token, ``[..., 1]``.
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from hf2q.engine.layers import GatedMLP, Linear
from hf2q.engine.models.qwen3_moe import MoEFeedForward
from hf2q.engine.models.qwen35 import Qwen35Model
from hf2q.formats.gguf_file import GGUFFile


class SharedExpertMoE:
    def __init__(self, g: GGUFFile, i: int, dtype, top_k: int):
        p = f"blk.{i}."
        self.routed = MoEFeedForward(g, i, dtype, top_k, normalize=True)
        self.shared = GatedMLP.load(*(g.tensor(f"{p}ffn_{n}_shexp.weight") for n in ("gate", "up", "down")), dtype)
        gate = g.tensor(p + "ffn_gate_inp_shexp.weight")
        self.shared_gate = Linear(attrs.evolve(gate, shape=(1, gate.shape[-1])), dtype)  # [1, hidden]

    def linears(self):
        r, s = self.routed, self.shared
        return (r.router, r.gate_exps, r.up_exps, r.down_exps, s.gate, s.up, s.down, self.shared_gate)

    def __call__(self, x: mx.array) -> mx.array:
        return self.routed(x) + self.shared(x) * mx.sigmoid(self.shared_gate(x))


def build(g: GGUFFile, dtype) -> Qwen35Model:
    top_k = g.hparams.expert_used_count
    return Qwen35Model(g, dtype, lambda i: SharedExpertMoE(g, i, dtype, top_k))
