"""Qwen3-VL MoE's language model (``qwen3vlmoe``): the M-RoPE decoder of ``qwen3vl.py`` with
Qwen3-MoE's routed experts (softmax router, top-k renormalised, as llama.cpp and transformers)."""

from __future__ import annotations

from hf2q.engine.models.llama import common_config
from hf2q.engine.models.qwen3_moe import MoEFeedForward
from hf2q.engine.models.qwen3vl import Qwen3VLModel
from hf2q.formats.gguf_file import GGUFFile


def build(g: GGUFFile, dtype) -> Qwen3VLModel:
    cfg = common_config(g, traditional=False)
    cfg.qk_norm = True
    top_k = g.hparams.expert_used_count
    return Qwen3VLModel(cfg, g, dtype, lambda i: MoEFeedForward(g, i, dtype, top_k, normalize=True))
