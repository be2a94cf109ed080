"""Llama family (Llama 2/3, SmolLM2, Mistral-style dense models) → GGUF arch ``llama``.

Llama-style checkpoints store Q/K in HF's rotate-half layout; llama.cpp's rope kernel
expects the interleaved layout, so the Q and K rows (and biases) are permuted exactly as
llama.cpp's converter does. Tokenizer: SentencePiece when ``tokenizer.model`` exists,
otherwise the GPT-2-style BPE of ``tokenizer.json``.
"""

from __future__ import annotations

import json

import gguf

from hf2q.arch.base import Direct, Family, Metadata, permute_rows
from hf2q.sources.hf_config import require


class Llama(Family):
    hf_architectures = ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM", "LlamaModel")
    gguf_arch = gguf.MODEL_ARCH.LLAMA
    tokenizer_kind = "auto"

    def source_tensor(self, ck, hf_name, gguf_name):
        shape = ck.entry(hf_name).shape
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return Direct(hf_name, shape, row_order=permute_rows(shape[0], self.n_head))
        if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return Direct(hf_name, shape, row_order=permute_rows(shape[0], self.n_head_kv))
        return Direct(hf_name, shape)

    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        a = self.arch_name
        md.u32(f"{a}.vocab_size", require(self.cfg, "vocab_size"))
        head_dim = self.cfg.get("head_dim") or require(self.cfg, "hidden_size") // self.n_head
        md.u32(f"{a}.rope.dimension_count", head_dim)

    def tokenizer_overrides(self, md: Metadata) -> None:
        tc = self.src / "tokenizer_config.json"
        if tc.is_file():
            try:
                prefix = json.loads(tc.read_text(encoding="utf-8")).get("add_prefix_space")
            except ValueError:
                prefix = None
            if prefix is not None:
                md.boolean("tokenizer.ggml.add_space_prefix", prefix)
        # llama.cpp's converter turns BOS off for 49152-token vocabularies (Granite / SmolLM)
        if self.cfg.get("vocab_size", 32000) == 49152:
            md.boolean("tokenizer.ggml.add_bos_token", False)
