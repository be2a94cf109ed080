"""Qwen3 dense family → GGUF arch ``qwen3`` (per-head Q/K RMS norms, no Q/K permutation).

Tokenizer: GPT-2-style byte-level BPE (``tokenizer.ggml.pre = qwen2``).
"""

from __future__ import annotations

import gguf

from hf2q.arch.base import MT, Family, Metadata
from hf2q.arch.pooling import add_pooling_type


class Qwen3(Family):
    hf_architectures = ("Qwen3ForCausalLM", "Qwen3Model")
    gguf_arch = gguf.MODEL_ARCH.QWEN3
    tokenizer_kind = "bpe"
    plain_layout = True
    block_tensors = (MT.ATTN_NORM, MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V, MT.ATTN_OUT, MT.ATTN_Q_NORM, MT.ATTN_K_NORM,
                     MT.FFN_NORM, MT.FFN_GATE, MT.FFN_UP, MT.FFN_DOWN)

    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        add_pooling_type(self.src, self.cfg, md, self.arch_name)
