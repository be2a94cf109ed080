"""Qwen3-VL's vision tower → an mmproj GGUF (arch ``clip``, projector ``qwen3vl_merger``).

llama.cpp runs a vision-language model as two files: the text GGUF and a projector ("mmproj")
GGUF holding the vision encoder and the merger that maps its patches into the text model's
embedding space. This module plans the second file the way llama.cpp's converter
(``convert_hf_to_gguf.py --mmproj``) writes it for Qwen3-VL:

* the ViT blocks under the ``clip`` tensor names (``v.blk.N.attn_qkv`` …);
* the final merger as ``v.post_ln`` + ``mm.0`` / ``mm.2``, and each deepstack merger as
  ``v.deepstack.K.*`` where K is the *encoder block* it taps (``deepstack_visual_indexes``), not
  its position in the list;
* the Conv3D patch embedding (temporal patch 2) split along time into two Conv2D kernels,
  ``v.patch_embd.weight`` and ``v.patch_embd.weight.1``;
* hyper-parameters, image mean/std from ``preprocessor_config.json`` (or ``processor_config.json``),
  and one deepstack flag per encoder block.

Tensor types follow that converter, not ``llama-quantize`` (which never sees an mmproj): 1-D
tensors, biases, norms and the position embedding F32; the patch kernels F16 in an F16 file and
F32 otherwise; the rest the output type, with F16 where a Q8_0 row does not fill its blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

from hf2q.arch.base import Direct, Metadata, PlannedTensor, RowSource
from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys
from hf2q.sources.hf_config import read_json_object, require
from hf2q.sources.safetensors_reader import SafetensorsCheckpoint, to_f32

T = gguf.GGMLQuantizationType
MT = gguf.MODEL_TENSOR
#: output types an mmproj can be written in (llama.cpp's converter writes these itself)
MMPROJ_TYPES: dict[str, tuple[T, gguf.LlamaFileType]] = {
    "f32": (T.F32, gguf.LlamaFileType.ALL_F32), "f16": (T.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (T.BF16, gguf.LlamaFileType.MOSTLY_BF16), "q8_0": (T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
#: the Conv3D's temporal extent llama.cpp's graph handles (two Conv2D kernels)
TEMPORAL_PATCH = 2
_PATCH = gguf.TENSOR_NAMES[MT.V_ENC_EMBD_PATCH]
_POSITION = gguf.TENSOR_NAMES[MT.V_ENC_EMBD_POS]
_VISION_PREFIXES = ("model.visual.", "visual.")


@attrs.define
class TimeSlice(RowSource):
    """One time step ``t`` of a Conv3D kernel ``[out, in, T, p, p]`` as a Conv2D kernel ``[out, in, p, p]``."""

    name: str
    step: int
    shape: tuple[int, ...]

    @property
    def source_names(self) -> tuple[str, ...]:
        return (self.name,)

    def rows(self, ck, lo, hi):
        kernel = np.asarray(ck.raw(self.name))[:, :, self.step]
        x = to_f32(np.ascontiguousarray(kernel), ck.entry(self.name).dtype)
        return np.ascontiguousarray(x.reshape(-1, self.shape[-1])[lo:hi], dtype=np.float32)


def preprocessor_config(src: Path) -> dict[str, Any]:
    """``preprocessor_config.json`` overlaid with ``processor_config.json``'s ``image_processor`` (the
    converter's precedence)."""
    out: dict[str, Any] = {}
    if (p := src / "preprocessor_config.json").is_file():
        cfg = read_json_object(p)
        out.update({**cfg, **(cfg.get("media_proc_cfg") or {})})
    if (p := src / "processor_config.json").is_file():
        cfg = read_json_object(p)
        out.update({**cfg, **(cfg.get("image_processor") or {})})
    return out


class Qwen3VLVision:
    """The vision tower of a Qwen3-VL checkpoint, planned as llama.cpp's mmproj."""

    arch_name = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ]
    projector = gguf.VisionProjectorType.QWEN3VL

    def __init__(self, raw_cfg: dict[str, Any], src: Path):
        self.src = Path(src)
        vision = raw_cfg.get("vision_config")
        if not isinstance(vision, dict):
            raise InputError("config.json: no vision_config; this checkpoint has no vision tower to write")
        self.vision = vision
        text = raw_cfg.get("text_config") if isinstance(raw_cfg.get("text_config"), dict) else {}
        self.text = {**raw_cfg, **text}
        self.depth = int(require(vision, "depth", "num_hidden_layers", kind=int))
        self.deepstack = [int(i) for i in vision.get("deepstack_visual_indexes") or []]
        if bad := [i for i in self.deepstack if not 0 <= i < self.depth]:
            raise InputError(f"config.json: deepstack_visual_indexes {bad} outside the {self.depth} vision blocks")
        self.tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, self.depth)
        self.preprocessor = preprocessor_config(self.src)

    # ---- what the report and dry run ask of a family
    @property
    def block_count(self) -> int:
        return self.depth

    def layer_summary(self) -> dict[str, int]:
        return {"vision_blocks": self.depth, "deepstack_mergers": len(self.deepstack)}

    @property
    def image_size(self) -> int:
        if (v := self.vision.get("image_size")) is not None:
            return int(v)
        n_pos = int(self.vision.get("num_position_embeddings", 2304))
        return int(n_pos ** 0.5 * int(self.vision.get("patch_size", 16)))

    # ---- tensors
    def _gguf_name(self, name: str, hf_name: str) -> str:
        """``name`` is the checkpoint name with the ``visual.`` prefix."""
        if name.startswith("visual.deepstack_merger_list."):
            index, part, suffix = name.split(".", 2)[2].split(".", 2)
            kind = {"norm": MT.V_DS_NORM, "linear_fc1": MT.V_DS_FC1, "linear_fc2": MT.V_DS_FC2}.get(part)
            if kind is None or not index.isdecimal() or int(index) >= len(self.deepstack):
                raise InputError(f"mmproj: unexpected deepstack tensor {hf_name!r}")
            return gguf.TENSOR_NAMES[kind].format(bid=self.deepstack[int(index)]) + f".{suffix}"
        if name.startswith("visual.merger."):
            part, suffix = name.split(".", 2)[2].split(".", 1)
            if part in ("linear_fc1", "linear_fc2"):
                return gguf.TENSOR_NAMES[MT.V_MMPROJ].format(bid=0 if part == "linear_fc1" else 2) + f".{suffix}"
            if part == "norm":
                return gguf.TENSOR_NAMES[MT.V_POST_NORM] + f".{suffix}"
            raise InputError(f"mmproj: unexpected merger tensor {hf_name!r}")
        new = self.tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise InputError(f"mmproj: cannot map vision tensor {hf_name!r} to a llama.cpp name")
        return new

    def collect(self, ck: SafetensorsCheckpoint):
        for hf_name in ck.names():
            prefix = next((p for p in _VISION_PREFIXES if hf_name.startswith(p)), None)
            if prefix is None:
                continue
            name = "visual." + hf_name[len(prefix):]
            shape = tuple(ck.entry(hf_name).shape)
            if name == "visual.patch_embed.proj.weight":
                if len(shape) != 5 or shape[2] != TEMPORAL_PATCH:
                    raise InputError(f"{hf_name}: expected a Conv3D kernel [out, in, {TEMPORAL_PATCH}, p, p], "
                                     f"got {list(shape)}")
                kernel = (shape[0], shape[1], shape[3], shape[4])
                yield hf_name, f"{_PATCH}.weight", TimeSlice(hf_name, 0, kernel)
                yield hf_name, f"{_PATCH}.weight.1", TimeSlice(hf_name, 1, kernel)
            elif name == "visual.patch_embed.proj.bias":
                yield hf_name, f"{_PATCH}.bias", Direct(hf_name, shape)
            else:
                yield hf_name, self._gguf_name(name, hf_name), Direct(hf_name, shape)

    def plan(self, ck: SafetensorsCheckpoint) -> list[PlannedTensor]:
        out = [PlannedTensor(g, s, self._stays_f32(g, len(s.shape))) for _, g, s in self.collect(ck)]
        if not out:
            raise InputError(f"{self.src}: the checkpoint has no vision tensors (model.visual.*)")
        names = [t.name for t in out]
        if len(set(names)) != len(names):
            raise InputError("mmproj: two vision tensors map to the same GGUF tensor")
        missing = [n for n in (f"{_PATCH}.weight", f"{_POSITION}.weight") if n not in names]
        if missing:
            raise InputError(f"mmproj: the vision tower lacks {', '.join(missing)}")
        return out

    @staticmethod
    def _stays_f32(name: str, n_dims: int) -> bool:
        return n_dims <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") \
            or name.startswith(_POSITION)

    def tensor_type(self, t: PlannedTensor, out_type: T) -> T:
        """The converter's choice for one tensor in an ``out_type`` file."""
        if t.name.startswith(f"{_PATCH}.weight"):
            return T.F16 if out_type == T.F16 else T.F32
        if t.f32_only:
            return T.F32
        if out_type == T.Q8_0 and t.ne[0] % gguf.GGML_QUANT_SIZES[T.Q8_0][0]:
            return T.F16  # the converter's fallback when a row does not fill Q8_0 blocks
        return out_type

    # ---- metadata
    def metadata(self, name: str, file_type: gguf.LlamaFileType) -> Metadata:
        v, md = self.vision, Metadata()
        md.string(Keys.General.ARCHITECTURE, self.arch_name)
        md.string(Keys.General.TYPE, gguf.GGUFType.MMPROJ)
        md.string(Keys.General.NAME, name)
        md.u32(Keys.General.FILE_TYPE, int(file_type))
        md.boolean(Keys.Clip.HAS_VISION_ENCODER, True)
        md.u32(Keys.ClipVision.PROJECTION_DIM, require(self.text, "hidden_size", kind=int))
        md.u32(Keys.ClipVision.IMAGE_SIZE, self.image_size)
        md.u32(Keys.ClipVision.PATCH_SIZE, require(v, "patch_size", kind=int))
        md.u32(Keys.ClipVision.EMBEDDING_LENGTH, require(v, "hidden_size", kind=int))
        md.u32(Keys.ClipVision.FEED_FORWARD_LENGTH, require(v, "intermediate_size", kind=int))
        md.u32(Keys.ClipVision.BLOCK_COUNT, self.depth)
        md.u32(Keys.ClipVision.Attention.HEAD_COUNT, require(v, "num_heads", "num_attention_heads", kind=int))
        for key, field in ((Keys.ClipVision.IMAGE_MEAN, "image_mean"), (Keys.ClipVision.IMAGE_STD, "image_std")):
            values = self.preprocessor.get(field)
            if not isinstance(values, list) or not all(isinstance(x, (int, float)) for x in values):
                raise InputError(f"{self.src}: preprocessor_config.json needs {field} (a list of numbers)")
            md.array(key, [float(x) for x in values], gguf.GGUFValueType.FLOAT32)
        md.string(Keys.Clip.PROJECTOR_TYPE, self.projector)
        md.boolean(Keys.ClipVision.USE_GELU, True)
        if (merge := v.get("spatial_merge_size")) is not None:
            md.u32(Keys.ClipVision.SPATIAL_MERGE_SIZE, int(merge))
        # llama.cpp takes the vision layer-norm epsilon from the text model's RMS epsilon
        md.f32(Keys.ClipVision.Attention.LAYERNORM_EPS, float(self.text.get("rms_norm_eps", 1e-6)))
        if self.depth:
            flags = [i in self.deepstack for i in range(self.depth)]
            md.array(Keys.ClipVision.IS_DEEPSTACK_LAYERS, flags, gguf.GGUFValueType.BOOL)
        md.u32(Keys.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION)
        return md


def projector_summary(metadata: dict[str, Any]) -> str:
    """One line about an mmproj GGUF's vision tower, from its metadata (for ``hf2q info``)."""
    g = metadata.get
    flags = g(Keys.ClipVision.IS_DEEPSTACK_LAYERS) or []
    return (f"{g(Keys.Clip.PROJECTOR_TYPE) or '?'}: {g(Keys.ClipVision.BLOCK_COUNT)} blocks of "
            f"{g(Keys.ClipVision.EMBEDDING_LENGTH)}, patch {g(Keys.ClipVision.PATCH_SIZE)}, "
            f"{sum(bool(f) for f in flags)} deepstack, into a text width of {g(Keys.ClipVision.PROJECTION_DIM)}")
