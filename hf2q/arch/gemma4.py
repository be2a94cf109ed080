"""Gemma 4 text family → GGUF arch ``gemma4`` (dense 31B-style, E2B/E4B with per-layer embeddings, 26B-A4B MoE).

Gemma 4 keeps Gemma 3's layout (sliding and global layers, q/k norms, sandwich norms, the
embedding cut to the tokenizer's vocabulary) but changes the rules llama.cpp's converter follows:

* norms are stored as the multiplier itself, so nothing is added to them (Gemma 3 writes ``1 + w``);
* the global layers have their own head size, KV head count and rope (proportional: only a
  ``partial_rotary_factor`` share of each head rotates). llama.cpp's rope rotates a leading run of
  pairs, so the converter generates ``rope_freqs``: divisor 1 for the rotated pairs and 1e30 for the
  others, which freezes them. Only the global layers read it;
* ``attention_k_eq_v`` global layers have no ``v_proj`` (K doubles as V) and the last
  ``num_kv_shared_layers`` layers have no K/V at all (they read an earlier layer's cache) — the
  checkpoint simply lacks those tensors, and the metadata says which layers are which;
* per-layer embeddings (``embed_tokens_per_layer`` and friends) and the MoE block (fused
  ``gate_up_proj`` experts kept fused, a router with its own input scale, a per-expert output scale,
  the dense MLP beside the experts with its own norms) map to llama.cpp's own tensor names.

Per-layer hyper-parameters (KV heads, FFN width) become arrays exactly when llama.cpp writes them
as arrays, so its loader reads our file as it reads its own.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

from hf2q.arch.base import Metadata
from hf2q.arch.gemma3 import Gemma3
from hf2q.arch.llama import ROPE_FREQS, Generated
from hf2q.errors import InputError
from hf2q.formats.gguf_keys import ExtraTensors, Keys
from hf2q.sources.hf_config import optional

# divisor llama.cpp's converter gives the pairs proportional rope leaves unrotated
_FROZEN_PAIR = 1e30
# multimodal checkpoints: the towers and their projections belong to the mmproj file, not this one
# (the name fragments llama.cpp's text converter skips)
_NOT_TEXT = ("vision_", "audio_", "vision.", "audio.", "projector.")


class Gemma4(Gemma3):
    hf_architectures = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
    gguf_arch = gguf.MODEL_ARCH.GEMMA4
    tokenizer_kind = "gemma4"
    norm_offset = 0.0
    # sliding and full layers differ in head size and KV heads, and shared-KV layers lack K/V
    plain_layout = False
    block_tensors = ()

    def __init__(self, cfg: dict[str, Any], src, mtp: str = "keep"):
        super().__init__(cfg, src, mtp=mtp)
        types = cfg.get("layer_types")
        if not isinstance(types, list) or len(types) != self.n_layer:
            raise InputError(f"config.json: Gemma 4 needs layer_types with one entry per layer ({self.n_layer})")
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise InputError(f"config.json: unknown Gemma 4 layer type(s) {unknown}")
        self.layer_types: list[str] = types

    # ---- per-layer shapes
    def _full_layer_override(self, key: str) -> Any:
        """A value of the first global layer's entry in ``per_layer_config`` (transformers ≥ 5.2 configs)."""
        per_layer = self.cfg.get("per_layer_config")
        if not isinstance(per_layer, dict):
            return None
        for idx, entry in per_layer.items():
            try:
                i = int(idx)
            except (TypeError, ValueError):
                continue
            if i < len(self.layer_types) and self.layer_types[i] == "full_attention" and isinstance(entry, dict) \
                    and key in entry:
                return entry[key]
        return None

    @property
    def head_dim_swa(self) -> int:
        return int(self.cfg.get("head_dim") or 256)

    @property
    def head_dim_full(self) -> int:
        v = self.cfg.get("global_head_dim")
        if v is None:
            v = self._full_layer_override("head_dim")
        if v is None:
            raise InputError("config.json: Gemma 4 needs global_head_dim (or per_layer_config head_dim)")
        return int(v)

    @property
    def n_head_kv_full(self) -> int | None:
        v = self.cfg.get("num_global_key_value_heads")
        if v is None:
            v = self._full_layer_override("num_key_value_heads")
        return None if v is None else int(v)

    @property
    def n_head_kv(self) -> int:
        """Layer 0's KV heads: llama-quantize's GQA ratio is that of the first layer."""
        full = self.n_head_kv_full
        if self.layer_types[0] == "full_attention" and full is not None:
            return full
        return super().n_head_kv

    @property
    def n_kv_shared(self) -> int:
        n = int(self.cfg.get("num_kv_shared_layers") or 0)
        if not 0 <= n < self.n_layer:
            raise InputError(f"config.json: num_kv_shared_layers {n} must be below num_hidden_layers {self.n_layer}")
        return n

    def full_rope(self) -> dict[str, Any]:
        rope = self.rope_parameters()
        full = rope.get("full_attention")
        if not isinstance(full, dict) or full.get("rope_type") != "proportional":
            raise InputError("config.json: Gemma 4 global layers need rope_parameters.full_attention "
                             "with rope_type 'proportional'")
        return full

    # ---- tensors
    def skip(self, hf_name: str) -> bool:
        return super().skip(hf_name) or any(part in hf_name for part in _NOT_TEXT)

    def map_name(self, hf_name: str) -> str:
        bid = _block_id(hf_name)
        if hf_name.endswith("router.scale"):
            return ExtraTensors.FFN_GATE_INP_SCALE.format(bid=bid)
        if hf_name.endswith("router.per_expert_scale"):
            return ExtraTensors.FFN_DOWN_EXPS_SCALE.format(bid=bid)
        if hf_name.endswith(("layer_scalar", ".experts.gate_up_proj", ".experts.down_proj")):
            hf_name += ".weight"
        return super().map_name(hf_name)

    def collect(self, ck):
        yield from super().collect(ck)
        full = self.full_rope()
        factor = float(full.get("partial_rotary_factor", 1.0))
        n_pairs = self.head_dim_full // 2
        n_rot = int(self.head_dim_full * factor / 2)
        values = np.array([1.0] * n_rot + [_FROZEN_PAIR] * (n_pairs - n_rot), dtype=np.float32)
        yield ROPE_FREQS, ROPE_FREQS, Generated(values, values.shape)

    # ---- metadata
    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        a, c = self.arch_name, self.cfg
        if (v := optional(c, "num_experts_per_tok", "num_experts_per_token", "top_k_experts")) is not None:
            md.u32(Keys.LLM.EXPERT_USED_COUNT.format(arch=a), v)
        swa = [t == "sliding_attention" for t in self.layer_types]
        md.u32(Keys.Attention.SHARED_KV_LAYERS.format(arch=a), self.n_kv_shared)
        md.u32(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP.format(arch=a), c.get("hidden_size_per_layer_input") or 0)
        md.array(Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=a), swa, gguf.GGUFValueType.BOOL)
        full, local = self.head_dim_full, self.head_dim_swa
        md.u32(Keys.Attention.KEY_LENGTH.format(arch=a), full)
        md.u32(Keys.Attention.VALUE_LENGTH.format(arch=a), full)
        md.u32(Keys.Attention.KEY_LENGTH_SWA.format(arch=a), local)
        md.u32(Keys.Attention.VALUE_LENGTH_SWA.format(arch=a), local)
        if (v := optional(c, "expert_intermediate_size", "moe_intermediate_size")) is not None:
            md.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), v)
        if c.get("use_double_wide_mlp"):
            n_ff, first_shared = int(c["intermediate_size"]), self.n_layer - self.n_kv_shared
            md.array(Keys.LLM.FEED_FORWARD_LENGTH.format(arch=a),
                     [n_ff if il < first_shared else 2 * n_ff for il in range(self.n_layer)], gguf.GGUFValueType.UINT32)
        kv_full, kv_swa = self.n_head_kv_full, c.get("num_key_value_heads")
        if kv_full is not None and kv_swa is not None:
            md.array(Keys.Attention.HEAD_COUNT_KV.format(arch=a),
                     [int(kv_swa) if s else kv_full for s in swa], gguf.GGUFValueType.UINT32)
        # llama.cpp reads the SWA rotary share from the top level of rope_parameters, the global one not at all
        # (the frozen pairs of rope_freqs do that job)
        swa_factor = float(self.rope_parameters().get("partial_rotary_factor", 1.0))
        md.u32(Keys.Rope.DIMENSION_COUNT.format(arch=a), full)
        md.u32(Keys.Rope.DIMENSION_COUNT_SWA.format(arch=a), int(local * swa_factor))
        self.full_rope()

    def tokenizer_overrides(self, md: Metadata) -> None:
        md.boolean(Keys.Tokenizer.ADD_PREFIX, False)
        md.boolean(Keys.Tokenizer.ADD_BOS, True)


def _block_id(hf_name: str) -> int | None:
    for part in hf_name.split("."):
        if part.isdecimal():
            return int(part)
    return None
