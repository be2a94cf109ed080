"""Qwen3-MoE family → GGUF arch ``qwen3moe``: experts merged into 3-D ``*_exps`` tensors.

Checkpoints come in two layouts: per-expert 2-D tensors
(``mlp.experts.{e}.{gate,up,down}_proj.weight``, transformers 4) or fused 3-D tensors
(``mlp.experts.gate_up_proj`` [E, 2·ff, d] and ``mlp.experts.down_proj`` [E, d, ff],
transformers 5). Both become llama.cpp's ``ffn_{gate,up,down}_exps`` with ggml shape
``{d, ff, E}`` / ``{ff, d, E}``; the stacking happens lazily, expert by expert, while writing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import gguf

from hf2q.arch.base import MT, Family, Metadata, RowSource, Stacked
from hf2q.arch.qwen3 import Qwen3
from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys
from hf2q.sources.hf_config import require

_PER_EXPERT = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.mlp\.experts\."
                    r"(gate_up_proj|down_proj)(?:\.weight)?$")
_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def collect_with_experts(family: Family, ck) -> Iterator[tuple[str, str, RowSource]]:
    """``Family.collect`` for a checkpoint whose experts become llama.cpp's 3-D ``*_exps`` tensors.

    Expert tensors are recognised by the names ``family.renamed`` gives (so a renamed MTP block's
    experts stack like any layer's); every other tensor is mapped one to one."""
    n_exp = family.n_expert
    if n_exp <= 0:
        raise InputError(f"config.json: {family.arch_name} needs num_experts")
    per_expert: dict[tuple[int, str], dict[int, str]] = {}
    for hf_name, name in family.renamed(ck):
        if m := _PER_EXPERT.match(name):
            per_expert.setdefault((int(m[1]), m[3]), {})[int(m[2])] = hf_name
            continue
        if m := _FUSED.match(name):
            bid, which = int(m[1]), m[2]
            shape = ck.entry(hf_name).shape
            if len(shape) != 3 or shape[0] != n_exp:
                raise InputError(f"{hf_name}: expected [{n_exp}, rows, cols], got {list(shape)}")
            if which == "down_proj":
                parts = tuple((hf_name, e, 0, shape[1]) for e in range(n_exp))
                yield hf_name, f"blk.{bid}.ffn_down_exps.weight", Stacked(parts, shape)
            else:
                if shape[1] % 2:
                    raise InputError(f"{hf_name}: gate_up rows {shape[1]} are not even")
                ff = shape[1] // 2
                for proj, first in (("gate_proj", 0), ("up_proj", ff)):
                    parts = tuple((hf_name, e, first, ff) for e in range(n_exp))
                    yield hf_name, f"blk.{bid}.{_GGUF[proj]}.weight", Stacked(parts, (n_exp, ff, shape[2]))
            continue
        gguf_name = family.map_name(name)
        yield hf_name, gguf_name, family.source_tensor(ck, hf_name, gguf_name)
    for (bid, proj), experts in sorted(per_expert.items()):
        missing = sorted(set(range(n_exp)) - set(experts))
        if missing:
            raise InputError(f"layer {bid} {proj}: missing expert(s) {missing[:5]} of {n_exp}")
        shape2 = ck.entry(experts[0]).shape
        for e in range(n_exp):
            if ck.entry(experts[e]).shape != shape2:
                raise InputError(f"{experts[e]}: shape differs from expert 0")
        parts = tuple((experts[e], -1, 0, shape2[0]) for e in range(n_exp))
        yield experts[0], f"blk.{bid}.{_GGUF[proj]}.weight", Stacked(parts, (n_exp, *shape2))


class Qwen3Moe(Qwen3):
    hf_architectures = ("Qwen3MoeForCausalLM",)
    gguf_arch = gguf.MODEL_ARCH.QWEN3MOE
    block_tensors = (MT.ATTN_NORM, MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V, MT.ATTN_OUT, MT.ATTN_Q_NORM, MT.ATTN_K_NORM,
                     MT.FFN_NORM, MT.FFN_GATE_INP, MT.FFN_GATE_EXP, MT.FFN_UP_EXP, MT.FFN_DOWN_EXP)

    @property
    def uniform_blocks(self) -> bool:
        # dense layers among the sparse ones (mlp_only_layers, decoder_sparse_step > 1) hold other tensors
        return not self.cfg.get("mlp_only_layers") and int(self.cfg.get("decoder_sparse_step") or 1) == 1

    def expected_dims(self):
        dims = super().expected_dims()
        if (ff := self.cfg.get("moe_intermediate_size")) is not None:
            e, d = self.n_expert, self.hidden_size
            dims.update({MT.FFN_GATE_EXP: (e, ff, d), MT.FFN_UP_EXP: (e, ff, d), MT.FFN_DOWN_EXP: (e, d, ff)})
        return dims

    def collect(self, ck):
        return collect_with_experts(self, ck)

    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        a = self.arch_name
        if (v := self.cfg.get("moe_intermediate_size")) is not None:
            md.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), v)
        if (v := self.cfg.get("shared_expert_intermediate_size")) is not None:
            md.u32(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=a), v)
        require(self.cfg, "num_experts_per_tok")
