"""Gemma 3 text: GeGLU-tanh MLP, sandwich norms, q/k norms, √hidden embedding scale,
5 sliding-window layers per global layer with their own RoPE base.

llama.cpp's converter already folds Gemma's ``(1 + w)`` RMSNorm into the stored
weights, so the plain RMSNorm applies. The sliding-window layout follows llama.cpp:
layer ``i`` is local unless ``(i + 1) % pattern == 0`` (pattern 6, or the GGUF's).

The local layers keep only their window (``kv_cache.SlidingWindow``) wherever the MLX graph runs the
decode (the GPU); the CPU host decode step keeps every position (its kernels address absolute
positions), so the runner windows only without it (``MlxModelRunner.window_layers``).
"""

from __future__ import annotations

import math

from hf2q.engine.layers import gelu_tanh
from hf2q.engine.models.decoder import DecoderModel
from hf2q.engine.memory_plan import gemma3_local_layers
from hf2q.engine.models.llama import common_config, gated_mlp
from hf2q.formats.gguf_file import GGUFFile


class Gemma3Model(DecoderModel):
    """The shared decoder, naming the local layers whose K/V may keep only the window."""

    @property
    def sliding_window_layers(self) -> tuple[int, frozenset[int]] | None:
        c = self.cfg
        layers = frozenset(i for i in range(c.n_layers) if c.is_local(i))
        return (c.sliding_window, layers) if c.sliding_window and layers else None


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
        local = gemma3_local_layers(hp)
        cfg.is_local = lambda i: local[i]
        cfg.sliding_window = window
        cfg.rope_base_local = hp.rope_base_swa
    model = Gemma3Model(cfg, g, dtype, lambda i: gated_mlp(g, i, dtype, act=gelu_tanh))
    return model
