"""Qwen3-VL's language model → GGUF arch ``qwen3vl`` (dense) / ``qwen3vlmoe``.

The text side is Qwen3 (or Qwen3-MoE) with two extra keys: the M-RoPE sections (rotary pairs
given to the time / height / width position ids, padded to four as llama.cpp reads them) and the
number of deepstack layers (vision features added to the first decoder layers' outputs). The
vision tower is left out here; ``hf2q.arch.qwen3vl_mmproj`` writes it as its own GGUF.

MoE experts in a Qwen3-VL Hub checkpoint are fused and stored transposed relative to
Qwen3-MoE's: ``gate_up_proj [E, d, 2·ff]`` and ``down_proj [E, ff, d]``. They become llama.cpp's
``ffn_{gate,up,down}_exps`` by reading columns, lazily, expert by expert. A checkpoint with one
2-D tensor per expert (``mlp.experts.{e}.gate_proj.weight`` …) is stacked as Qwen3-MoE's.
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf

from hf2q.arch.base import ExpertColumns, Family, Metadata, RowSource
from hf2q.arch.qwen3 import Qwen3
from hf2q.arch.qwen3_moe import Qwen3Moe, collect_with_experts
from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys

#: llama.cpp reads four section sizes (time, height, width, and an unused fourth)
N_SECTIONS = 4


def mrope_sections(family: Family) -> list[int]:
    """The config's ``mrope_section`` padded to four entries (each counts rotary pairs)."""
    rope = family.rope_parameters()
    sections = rope.get("mrope_section")
    if not isinstance(sections, list) or not sections or not all(isinstance(s, int) for s in sections):
        raise InputError("config.json: Qwen3-VL needs rope_parameters.mrope_section (a list of pair counts)")
    if len(sections) > N_SECTIONS:
        raise InputError(f"config.json: mrope_section has {len(sections)} entries, at most {N_SECTIONS}")
    if sum(sections) * 2 > family.head_dim:
        raise InputError(f"config.json: mrope_section {sections} covers {2 * sum(sections)} dims, more than "
                         f"head_dim {family.head_dim}")
    return list(sections) + [0] * (N_SECTIONS - len(sections))


def deepstack_count(cfg: dict) -> int:
    vision = cfg.get("vision_config") or {}
    return len(vision.get("deepstack_visual_indexes") or [])


class _VisionLanguageText:
    """What Qwen3-VL adds to a Qwen3 text family (listed before it among the bases): the vision
    tower's tensors left out, the M-RoPE sections checked, the two extra keys written."""

    def skip(self, hf_name: str) -> bool:
        return super().skip(hf_name) or "visual." in hf_name

    def check_config(self) -> None:
        super().check_config()
        mrope_sections(self)

    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        a = self.arch_name
        md.array(Keys.Rope.DIMENSION_SECTIONS.format(arch=a), mrope_sections(self), gguf.GGUFValueType.INT32)
        md.u32(Keys.LLM.NUM_DEEPSTACK_LAYERS.format(arch=a), deepstack_count(self.cfg))


class Qwen3VL(_VisionLanguageText, Qwen3):
    hf_architectures = ("Qwen3VLForConditionalGeneration",)
    gguf_arch = gguf.MODEL_ARCH.QWEN3VL


_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.experts.gate_up_proj.weight",
          "mlp.experts.down_proj.weight")


def _collect_hub_experts(family: Qwen3Moe, ck) -> Iterator[tuple[str, str, RowSource]]:
    e, d = family.n_expert, family.hidden_size
    ff = int(family.cfg.get("moe_intermediate_size") or 0)
    for hf_name, name in family.renamed(ck):
        base = name.removesuffix(".weight")
        if not base.endswith(_FUSED):
            gguf_name = family.map_name(name)
            yield hf_name, gguf_name, family.source_tensor(ck, hf_name, gguf_name)
            continue
        bid = base.split("layers.", 1)[1].split(".", 1)[0]
        shape = tuple(ck.entry(hf_name).shape)
        gate_up = base.endswith("gate_up_proj")
        want = (e, d, 2 * ff) if gate_up else (e, ff, d)
        if shape != want:
            raise InputError(f"{hf_name}: shape {list(shape)}, expected the Hub layout {list(want)} "
                             "(experts [E, d, 2·ff] / [E, ff, d]; a checkpoint saved in transformers' in-memory "
                             "layout [E, 2·ff, d] / [E, d, ff] is not a Hub checkpoint)")
        if gate_up:
            yield hf_name, f"blk.{bid}.ffn_gate_exps.weight", ExpertColumns(hf_name, 0, (e, ff, d))
            yield hf_name, f"blk.{bid}.ffn_up_exps.weight", ExpertColumns(hf_name, ff, (e, ff, d))
        else:
            yield hf_name, f"blk.{bid}.ffn_down_exps.weight", ExpertColumns(hf_name, 0, (e, d, ff))


class Qwen3VLMoe(_VisionLanguageText, Qwen3Moe):
    hf_architectures = ("Qwen3VLMoeForConditionalGeneration",)
    gguf_arch = gguf.MODEL_ARCH.QWEN3VLMOE

    def check_config(self) -> None:
        super().check_config()
        if not self.cfg.get("moe_intermediate_size"):
            raise InputError("config.json: Qwen3-VL MoE needs moe_intermediate_size")

    def collect(self, ck):
        if any(n.endswith(_FUSED) for n in ck.names()):
            return _collect_hub_experts(self, ck)
        return collect_with_experts(self, ck)  # one 2-D tensor per expert, as Qwen3-MoE checkpoints
