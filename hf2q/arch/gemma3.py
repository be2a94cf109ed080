"""Gemma 3 text family → GGUF arch ``gemma3`` (sliding-window attention, Q/K norms, ``norm + 1``).

Gemma's RMSNorm multiplies by ``1 + w``; llama.cpp's graph multiplies by the stored weight,
so every ``*norm.weight`` is written as ``w + 1`` (in float32, as llama.cpp's converter does).
The embedding matrix is cut to the tokenizer's real vocabulary (Gemma pads its embedding
rows), and the local/global rope bases and window size go into the metadata.
"""

from __future__ import annotations

import gguf

from hf2q.arch.base import MT, Direct, Family, Metadata
from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys


class Gemma3(Family):
    hf_architectures = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    gguf_arch = gguf.MODEL_ARCH.GEMMA3
    tokenizer_kind = "auto"
    #: added to every ``*norm.weight`` (Gemma 3's RMSNorm multiplies by ``1 + w``; Gemma 4 stores the multiplier)
    norm_offset: float = 1.0
    plain_layout = True
    block_tensors = (MT.ATTN_NORM, MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V, MT.ATTN_OUT, MT.FFN_GATE, MT.FFN_UP, MT.FFN_DOWN)

    @property
    def head_dim(self) -> int:
        return int(self.cfg.get("head_dim") or 256)  # transformers' Gemma 3 default

    def skip(self, hf_name: str) -> bool:
        return super().skip(hf_name) or hf_name.startswith(("vision_tower.", "multi_modal_projector.")) \
            or ".vision_tower." in hf_name or "multi_modal_projector" in hf_name

    def real_vocab_size(self) -> int | None:
        if (self.src / "tokenizer.model").is_file():
            from hf2q.sources.tokenizer_meta import spm_vocab
            return len(spm_vocab(self.src, self.cfg)[0])
        path = self.src / "tokenizer.json"
        if not path.is_file():
            return None
        from hf2q.sources.tokenizer_meta import load_tokenizer_json
        tj = load_tokenizer_json(self.src)
        try:
            return len(tj["model"]["vocab"]) + len(tj.get("added_tokens", []))
        except (KeyError, TypeError) as e:
            raise InputError(f"{path}: cannot read the vocabulary ({e})") from None

    def source_tensor(self, ck, hf_name, gguf_name):
        shape = ck.entry(hf_name).shape
        if "embed_tokens.weight" in hf_name:
            n = self.real_vocab_size()
            if n is not None and n < shape[0]:
                shape = (n, *shape[1:])
        add = self.norm_offset if hf_name.endswith("norm.weight") else 0.0
        return Direct(hf_name, shape, add=add)

    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        a, c = self.arch_name, self.cfg
        md.u32(Keys.LLM.CONTEXT_LENGTH.format(arch=a), c.get("max_position_embeddings", 131072))
        md.u32(Keys.Attention.HEAD_COUNT.format(arch=a), c.get("num_attention_heads", 8))
        md.f32(Keys.Attention.LAYERNORM_RMS_EPS.format(arch=a), c.get("rms_norm_eps", 1e-6))
        md.u32(Keys.Attention.KEY_LENGTH.format(arch=a), c.get("head_dim", 256))
        md.u32(Keys.Attention.VALUE_LENGTH.format(arch=a), c.get("head_dim", 256))
        rope = self.rope_parameters()
        md.f32(Keys.Rope.FREQ_BASE.format(arch=a), rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
        if c.get("final_logit_softcapping"):
            md.f32(Keys.LLM.FINAL_LOGIT_SOFTCAPPING.format(arch=a), c["final_logit_softcapping"])
        if c.get("sliding_window_pattern") != 1:
            if c.get("sliding_window") is None:
                raise InputError("config.json: Gemma 3 needs sliding_window")
            md.u32(Keys.Attention.SLIDING_WINDOW.format(arch=a), c["sliding_window"])
        md.u32(Keys.Attention.HEAD_COUNT_KV.format(arch=a), c.get("num_key_value_heads", 4))

    def tokenizer_overrides(self, md: Metadata) -> None:
        if (self.src / "tokenizer.model").is_file():
            md.boolean(Keys.Tokenizer.ADD_PREFIX, False)
