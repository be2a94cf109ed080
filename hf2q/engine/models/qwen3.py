"""Qwen3 dense: Llama layout plus per-head RMSNorm on q and k, NeoX (half-split) RoPE."""

from __future__ import annotations

from hf2q.engine.models.decoder import DecoderModel
from hf2q.engine.models.llama import common_config, gated_mlp
from hf2q.formats.gguf_file import GGUFFile


def build(g: GGUFFile, dtype) -> DecoderModel:
    cfg = common_config(g, traditional=False)
    cfg.qk_norm = True
    return DecoderModel(cfg, g, dtype, lambda i: gated_mlp(g, i, dtype))
