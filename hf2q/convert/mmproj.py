"""``hf2q convert --mmproj``: a vision-language checkpoint's vision tower as llama.cpp's second GGUF.

The text GGUF comes from the ordinary pipeline; this writes the projector file beside it
(``mmproj-<model>-<type>.gguf`` unless a path is given), streamed tensor by tensor through the same
container writer and crash-safe output. Values are encoded from float32 straight to the output
type, as llama.cpp's converter does for an mmproj (no F16 round trip before Q8_0).
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import numpy as np

from hf2q.arch.base import Metadata, PlannedTensor
from hf2q.arch.qwen3vl_mmproj import MMPROJ_TYPES, Qwen3VLVision
from hf2q.atomic import atomic_output
from hf2q.convert.gguf_writer import GGUFStream, TensorLayout, layout
from hf2q.convert.pipeline import SLAB_BYTES, encode
from hf2q.convert.pipeline import _check_output_dir as check_destination  # noqa: F401 — the command's pre-check
from hf2q.errors import ConversionError, InputError
from hf2q.sources.hf_config import architecture_name
from hf2q.sources.safetensors_reader import SafetensorsCheckpoint

log = logging.getLogger("hf2q.convert")

#: the families whose vision tower hf2q writes, by HF architecture name
VISION_TOWERS = {"Qwen3VLForConditionalGeneration": Qwen3VLVision,
                 "Qwen3VLMoeForConditionalGeneration": Qwen3VLVision}
#: text quant → mmproj type: float and Q8_0 files keep their type, other quants pair with an F16 projector
DEFAULT_TYPE = "f16"


def mmproj_type(quant_name: str) -> str:
    q = quant_name.lower()
    return q if q in MMPROJ_TYPES else DEFAULT_TYPE


def default_path(model_output: Path, src: Path, type_name: str) -> Path:
    """``mmproj-<source name>-<type>.gguf`` in the text model's directory (where llama.cpp users look)."""
    return Path(model_output).parent / f"mmproj-{Path(src).name}-{type_name}.gguf"


@attrs.define
class MmprojPlan:
    tower: Qwen3VLVision
    checkpoint: SafetensorsCheckpoint
    tensors: list[PlannedTensor]
    layouts: list[TensorLayout]
    metadata: Metadata

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.layouts)


def _raw_config(src: Path) -> dict:
    import json

    from hf2q.sources.hf_config import load_config

    load_config(src)  # the one-line errors for a missing or malformed config.json
    return json.loads((src / "config.json").read_text(encoding="utf-8"))


def build_plan(src: Path, type_name: str) -> MmprojPlan:
    src = Path(src)
    if type_name not in MMPROJ_TYPES:
        raise InputError(f"mmproj type {type_name!r}: one of {', '.join(MMPROJ_TYPES)}")
    cfg = _raw_config(src)
    arch = architecture_name(cfg)
    tower_cls = VISION_TOWERS.get(arch)
    if tower_cls is None:
        raise InputError(f"--mmproj: {arch} has no vision tower hf2q writes (supported: {', '.join(VISION_TOWERS)})")
    out_type, file_type = MMPROJ_TYPES[type_name]
    tower = tower_cls(cfg, src)
    ck = SafetensorsCheckpoint(src)
    try:
        tensors = tower.plan(ck)
        types = [tower.tensor_type(t, out_type) for t in tensors]
        layouts = layout([(t.name, t.ne, q) for t, q in zip(tensors, types)])
        name = cfg.get("_name_or_path") or src.name
        md = tower.metadata(name, file_type)
    except BaseException:
        ck.close()
        raise
    return MmprojPlan(tower, ck, tensors, layouts, md)


def convert_mmproj(src: Path, output: Path, type_name: str, threads: int = 1) -> MmprojPlan:
    plan = build_plan(src, type_name)
    try:
        with atomic_output(Path(output)) as f:
            stream = GGUFStream(f, plan.metadata.entries, plan.layouts)
            for t, lay in zip(plan.tensors, plan.layouts):
                ncols = t.shape[-1]
                slab = max(1, SLAB_BYTES // (4 * ncols))
                for lo in range(0, t.source.n_rows, slab):
                    hi = min(t.source.n_rows, lo + slab)
                    stream.write(encode(t.source.rows(plan.checkpoint, lo, hi), lay.qtype, threads))
            if not stream.finished():
                raise ConversionError("internal error: not every mmproj tensor was written")
    except OSError as e:
        raise ConversionError(f"cannot write {output}: {e.strerror or e}") from None
    finally:
        plan.checkpoint.close()
    log.info("wrote mmproj %s (%d tensors)", output, len(plan.tensors))
    return plan


def dry_run(src: Path, type_name: str) -> list[str]:
    plan = build_plan(src, type_name)
    try:
        width = max(len(t.name) for t in plan.tensors)
        lines = [f"mmproj ({plan.tower.arch_name}, {plan.tower.projector}):"]
        for t, lay in zip(plan.tensors, plan.layouts):
            shape = "[" + ", ".join(str(d) for d in lay.ne) + "]"
            lines.append(f"{t.name:<{width}}  {shape:<20} {lay.qtype.name:<5} {lay.nbytes:>12}")
        n = sum(int(np.prod(t.shape)) for t in plan.tensors)
        lines.append(f"mmproj total: {len(plan.tensors)} tensors, {plan.total_bytes} bytes "
                     f"({plan.total_bytes / 2**20:.2f} MiB, {8 * plan.total_bytes / max(1, n):.2f} bits/weight) "
                     f"— {plan.tower.arch_name} {type_name}")
        return lines
    finally:
        plan.checkpoint.close()
