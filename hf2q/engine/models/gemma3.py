"""Gemma 3 text: GeGLU-tanh MLP, sandwich norms, q/k norms, √hidden embedding scale,
5 sliding-window layers per global layer with their own RoPE base.

llama.cpp's converter already folds Gemma's ``(1 + w)`` RMSNorm into the stored
weights, so the plain RMSNorm applies. The sliding-window layout follows llama.cpp:
layer ``i`` is local unless ``(i + 1) % pattern == 0`` (pattern 6, or the GGUF's).
"""

from __future__ import annotations

import math

from hf2q.engine.layers import gelu_tanh
from hf2q.engine.models.decoder import DecoderModel
from hf2q.engine.models.llama import common_config, gated_mlp
from hf2q.formats.gguf_file import GGUFFile


def build(g: GGUFFile, dtype) -> DecoderModel:
    cfg = common_config(g, traditional=False)
    cfg.qk_norm = True
    cfg.sandwich_norms = True
    cfg.embed_scale = math.sqrt(cfg.hidden)
    cfg.act = gelu_tanh
    cfg.attn_scale = cfg.head_dim ** -0.5
    if cfg.n_layers == 62:  # 27B: query_pre_attn_scalar = hidden / heads
        cfg.attn_scale = (cfg.hidden / cfg.n_heads) ** -0.5
    hp = g.hparams
    cfg.final_softcap = hp.final_logit_softcap
    window = hp.sliding_window
    if window:
        pattern = hp.sliding_window_pattern
        if isinstance(pattern, list):  # per-layer booleans
            cfg.is_local = lambda i: pattern[i]
        else:
            cfg.is_local = lambda i: (i + 1) % pattern != 0
        cfg.sliding_window = window
        cfg.rope_base_local = hp.rope_base_swa
    return DecoderModel(cfg, g, dtype, lambda i: gated_mlp(g, i, dtype, act=gelu_tanh))
