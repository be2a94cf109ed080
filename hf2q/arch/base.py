"""What an architecture family is: HF names → llama.cpp tensors, hyper-parameter metadata, tokenizer kind.

A family turns an HF checkpoint into a *plan*: an ordered list of ``PlannedTensor`` (GGUF
name, shape, how to produce its float32 rows on demand) plus a list of metadata entries.
Nothing is loaded while planning, so ``--dry-run`` and the type policy work on shapes only,
and the writer can stream each tensor in row slabs.

The tensor-name map comes from the ``gguf`` package (llama.cpp's own table), and the
per-family quirks mirror llama.cpp's ``convert_hf_to_gguf.py`` so stock llama.cpp loads the
result: the Q/K row permutation for Llama-style rope, experts stacked into 3-D tensors,
Gemma's ``norm + 1``, BERT's unused pooler dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import gguf
import numpy as np

from hf2q.arch.smoke_prompts import CHAT_CASES, PARITY_PROMPTS
from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys
from hf2q.sources.hf_config import optional, require
from hf2q.sources.safetensors_reader import SafetensorsCheckpoint, to_f32

T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType

# llama.cpp's converter keeps these tensor kinds in F32 whatever the output type
_ALWAYS_F32 = frozenset({
    gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.POS_EMBD,
    gguf.MODEL_TENSOR.TOKEN_TYPES, gguf.MODEL_TENSOR.SSM_CONV1D,
})

#: what to do with a multi-token-prediction head: keep it, drop it (``--no-mtp``), or write only it (``--mtp``)
MTP_CHOICES = ("keep", "drop", "only")

#: the config keys HF uses for the number of decoder layers
LAYER_KEYS = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")

MT = gguf.MODEL_TENSOR
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")
#: norms over the residual stream: one weight (and bias) per hidden unit
HIDDEN_NORMS = (MT.OUTPUT_NORM, MT.ATTN_NORM, MT.FFN_NORM, MT.ATTN_POST_NORM, MT.FFN_POST_NORM, MT.FFN_PRE_NORM,
                MT.TOKEN_EMBD_NORM, MT.ATTN_OUT_NORM, MT.LAYER_OUT_NORM)


# --------------------------------------------------------------------------- sources of rows
class RowSource:
    """Produces float32 rows ``[lo, hi)`` of a tensor viewed as a matrix ``[rows, shape[-1]]``."""

    shape: tuple[int, ...]
    source_names: tuple[str, ...]

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    def rows(self, ck: SafetensorsCheckpoint, lo: int, hi: int) -> np.ndarray:
        raise NotImplementedError


@attrs.define
class Direct(RowSource):
    """One HF tensor, optionally with rows reordered, truncated, or shifted by a constant."""

    name: str
    shape: tuple[int, ...]
    row_order: np.ndarray | None = None  # gather rows in this order (Q/K permutation)
    add: float = 0.0  # Gemma norms store w, llama.cpp wants 1 + w

    @property
    def source_names(self) -> tuple[str, ...]:
        return (self.name,)

    def rows(self, ck, lo, hi):
        if len(self.shape) == 1:
            x = ck.f32(self.name)[None, :]
        else:
            ncols = self.shape[-1]
            raw = ck.raw(self.name).reshape(-1, ncols)
            sel = raw[self.row_order[lo:hi]] if self.row_order is not None else raw[lo:hi]
            x = to_f32(np.asarray(sel), ck.entry(self.name).dtype)
        if self.add:
            x = x + np.float32(self.add)
        return np.ascontiguousarray(x, dtype=np.float32)


@attrs.define
class ExpertColumns(RowSource):
    """Experts fused as ``[E, cols_in, width]`` (or its rows flattened, ``[E·cols_in, width]``) read as
    ``[E, width_part, cols_in]``: columns ``[first, first + n)`` of each expert's matrix, transposed."""

    name: str
    first: int
    shape: tuple[int, ...]  # (E, n, cols_in)

    @property
    def source_names(self) -> tuple[str, ...]:
        return (self.name,)

    def rows(self, ck, lo, hi):
        per = self.shape[1]
        raw = ck.raw(self.name)
        if raw.ndim == 2:
            raw = raw.reshape(self.shape[0], self.shape[2], -1)
        dtype = ck.entry(self.name).dtype
        out = []
        r = lo
        while r < hi:
            e, local = divmod(r, per)
            take = min(hi - r, per - local)
            cols = np.asarray(raw[e][:, self.first + local:self.first + local + take])
            out.append(to_f32(cols, dtype).T)
            r += take
        return np.ascontiguousarray(np.concatenate(out, axis=0), dtype=np.float32)


@attrs.define
class Stacked(RowSource):
    """Per-expert 2-D HF tensors (or row slices of one fused 3-D tensor) stacked into [E, R, C]."""

    parts: tuple[tuple[str, int, int, int], ...]  # (hf name, expert index or -1, first row, n rows)
    shape: tuple[int, ...]

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p[0] for p in self.parts))

    def rows(self, ck, lo, hi):
        per = self.shape[1]
        out = []
        r = lo
        while r < hi:
            e, local = divmod(r, per)
            take = min(hi - r, per - local)
            name, idx, first, _ = self.parts[e]
            raw = ck.raw(name)
            m = raw[idx] if idx >= 0 else raw
            out.append(to_f32(np.asarray(m[first + local:first + local + take]), ck.entry(name).dtype))
            r += take
        return np.ascontiguousarray(np.concatenate(out, axis=0), dtype=np.float32)


class Packed(RowSource):
    """A source that writes its own bytes in a fixed type (a checkpoint's pre-quantized blocks, integer tables).

    ``packed`` gives the stored bytes of rows ``[lo, hi)``; ``rows`` their float values. Such sources
    check their own dtypes (they may read integer tensors)."""

    stored_type: gguf.GGMLQuantizationType
    reads_integers: ClassVar[bool] = True
    #: the stored bytes are ``stored_type``'s quantization of ``rows`` as they are (no F16 step, no
    #: importance weights): the convert pipeline then encodes them on its worker pool like other tensors
    quantizes_rows: ClassVar[bool] = False

    def packed(self, ck: SafetensorsCheckpoint, lo: int, hi: int) -> np.ndarray:
        raise NotImplementedError


@attrs.define
class PlannedTensor:
    """One output tensor: its GGUF name, numpy shape, float type llama.cpp's F16 export gives it."""

    name: str
    source: RowSource
    f32_only: bool  # llama.cpp's converter keeps it F32 (1-D, norms, routers, position/type embeddings)
    #: a type the family fixes whatever the quant name (llama.cpp's ``tensor_force_quant``), else None
    stored_type: gguf.GGMLQuantizationType | None = None

    def __attrs_post_init__(self) -> None:
        if self.stored_type is None and isinstance(self.source, Packed):
            self.stored_type = self.source.stored_type

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def ne(self) -> list[int]:
        """ggml dimension order (innermost first)."""
        return list(reversed(self.shape))

    @property
    def n_dims(self) -> int:
        return len(self.shape)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


# --------------------------------------------------------------------------- metadata
@attrs.define
class Metadata:
    """Ordered GGUF key/value entries with their value types (mirrors what llama.cpp writes)."""

    entries: dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = attrs.field(factory=dict)

    def u32(self, key: str, v) -> None:
        self.entries[key] = (int(v), V.UINT32, None)

    def i32(self, key: str, v) -> None:
        self.entries[key] = (int(v), V.INT32, None)

    def f32(self, key: str, v) -> None:
        self.entries[key] = (float(v), V.FLOAT32, None)

    def boolean(self, key: str, v) -> None:
        self.entries[key] = (bool(v), V.BOOL, None)

    def string(self, key: str, v) -> None:
        self.entries[key] = (str(v), V.STRING, None)

    def array(self, key: str, values, item: gguf.GGUFValueType) -> None:
        self.entries[key] = (list(values), V.ARRAY, item)

    def get(self, key: str, default=None):
        e = self.entries.get(key)
        return e[0] if e else default

    def remove(self, key: str) -> None:
        self.entries.pop(key, None)


# --------------------------------------------------------------------------- family base
class Family:
    """Base of every architecture module; a subclass is one file in ``hf2q/arch/``."""

    hf_architectures: ClassVar[tuple[str, ...]] = ()
    gguf_arch: ClassVar[gguf.MODEL_ARCH]
    #: the GGUF architecture name where the PyPI ``gguf`` package has no ``MODEL_ARCH`` for it
    gguf_arch_name: ClassVar[str | None] = None
    tokenizer_kind: ClassVar[str] = "bpe"  # "bpe" | "spm" | "wordpiece" | "xlmr" | "auto"

    #: whether the family has a multi-token-prediction head that ``--no-mtp`` / ``--mtp`` select
    has_mtp: ClassVar[bool] = False

    #: tensors outside the blocks that every checkpoint of the family has
    required_tensors: ClassVar[tuple[gguf.MODEL_TENSOR, ...]] = (MT.TOKEN_EMBD, MT.OUTPUT_NORM)
    #: tensors every block has; set only where all blocks are alike (not hybrid layer mixes)
    block_tensors: ClassVar[tuple[gguf.MODEL_TENSOR, ...]] = ()
    #: whether attention and MLP widths follow the plain rule (heads × head_dim, intermediate_size)
    plain_layout: ClassVar[bool] = False

    #: ``hf2q smoke``'s end-gate cases (``hf2q/arch/smoke_prompts.py``); None: not a chat model
    smoke_cases: ClassVar[tuple[dict, ...] | None] = CHAT_CASES
    #: the raw-text prompts ``hf2q parity`` captures greedy continuations of
    parity_prompts: ClassVar[tuple[str, ...]] = PARITY_PROMPTS

    def __init__(self, cfg: dict[str, Any], src: Path, mtp: str = "keep"):
        self.cfg, self.src = cfg, Path(src)
        self.n_layer = int(require(cfg, *LAYER_KEYS, kind=int))
        self.tensor_map = gguf.get_tensor_name_map(self.gguf_arch, self.n_layer)
        if mtp not in MTP_CHOICES:
            raise InputError(f"unknown MTP choice {mtp!r}; expected one of {', '.join(MTP_CHOICES)}")
        if mtp != "keep" and not self.has_mtp:
            raise InputError(f"--no-mtp / --mtp: {self.arch_name} has no multi-token-prediction head")
        self.mtp = mtp

    @property
    def arch_name(self) -> str:
        return self.architecture()

    @classmethod
    def architecture(cls) -> str:
        """The GGUF ``general.architecture`` this family writes."""
        return cls.gguf_arch_name or gguf.MODEL_ARCH_NAMES[cls.gguf_arch]

    def check_quant(self, quant) -> None:
        """Refuse (``InputError``) a quant name the family cannot be converted to."""

    def file_type(self, quant) -> gguf.LlamaFileType:
        """``general.file_type``: the quant name's, unless the family's fixed types make it another."""
        return quant.ftype

    # ---- hyper-parameters used by the type policy
    @property
    def block_count(self) -> int:
        """Blocks in the GGUF (``{arch}.block_count``): the decoder layers plus any MTP blocks after them."""
        return self.n_layer

    @property
    def n_head(self) -> int:
        return int(optional(self.cfg, "num_attention_heads", "n_head", "n_heads") or 1)

    @property
    def n_head_kv(self) -> int:
        return int(optional(self.cfg, "num_key_value_heads", "n_kv_heads") or self.n_head)

    @property
    def n_expert(self) -> int:
        return int(optional(self.cfg, "num_local_experts", "num_experts", "n_routed_experts") or 0)

    @property
    def hidden_size(self) -> int:
        return int(require(self.cfg, "hidden_size", "n_embd", kind=int))

    @property
    def head_dim(self) -> int:
        return int(self.cfg.get("head_dim") or self.hidden_size // self.n_head)

    # ---- what the config implies about the tensors (checked by hf2q.convert.checkpoint_check)
    @property
    def uniform_blocks(self) -> bool:
        """Every block holds the same tensors (so one block's extra tensor means another lacks it)."""
        return bool(self.block_tensors)

    def expected_blocks(self) -> range:
        """The ``blk.N`` numbers the plan must cover, each with at least one tensor."""
        return range(self.block_count)

    def check_config(self) -> None:
        """Relations between hyper-parameters that a reshape would otherwise trip over."""
        if self.n_head % self.n_head_kv:
            raise InputError(f"config.json: num_attention_heads {self.n_head} is not a multiple of "
                             f"num_key_value_heads {self.n_head_kv}")
        if self.plain_layout and not self.cfg.get("head_dim") and self.hidden_size % self.n_head:
            raise InputError(f"config.json: hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.n_head} (and no head_dim is given)")

    def expected_dims(self) -> dict[gguf.MODEL_TENSOR, tuple[int | None, ...]]:
        """Per tensor kind, the shape (numpy order, ``None`` = any size) the config implies.

        Every family: the residual width on the matrices that read or write the residual stream,
        the norms over it, and the expert count on expert tensors. ``plain_layout`` families add
        the head and MLP widths."""
        d, e = self.hidden_size, self.n_expert
        dims: dict[gguf.MODEL_TENSOR, tuple[int | None, ...]] = {k: (d,) for k in HIDDEN_NORMS}
        dims.update({k: (None, d) for k in (MT.TOKEN_EMBD, MT.OUTPUT, MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V, MT.FFN_GATE,
                                            MT.FFN_UP, MT.FFN_GATE_SHEXP, MT.FFN_UP_SHEXP)})
        dims.update({k: (d, None) for k in (MT.ATTN_OUT, MT.FFN_DOWN, MT.FFN_DOWN_SHEXP)})
        if e:
            dims.update({MT.FFN_GATE_INP: (e, d), MT.FFN_GATE_EXP: (e, None, d), MT.FFN_UP_EXP: (e, None, d),
                         MT.FFN_DOWN_EXP: (e, d, None)})
        if self.plain_layout:
            hd = self.head_dim
            q, kv = self.n_head * hd, self.n_head_kv * hd
            dims.update({MT.ATTN_Q: (q, d), MT.ATTN_K: (kv, d), MT.ATTN_V: (kv, d), MT.ATTN_OUT: (d, q),
                         MT.ATTN_Q_NORM: (hd,), MT.ATTN_K_NORM: (hd,)})
            if (ff := optional(self.cfg, "intermediate_size")) is not None:
                dims.update({MT.FFN_GATE: (ff, d), MT.FFN_UP: (ff, d), MT.FFN_DOWN: (d, ff)})
        return dims

    def layer_summary(self) -> dict[str, int] | None:
        """Per-family facts for ``--dry-run`` and the report beyond tensors (hybrid layer mix, state size)."""
        return None

    # ---- tensors
    def skip(self, hf_name: str) -> bool:
        """HF tensors llama.cpp's converter drops."""
        return hf_name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq"))

    def map_name(self, hf_name: str) -> str:
        name = hf_name.replace("language_model.", "")
        new = self.tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None and (m := _LAYER_INDEX.search(name)) and int(m[1]) >= self.n_layer:
            raise InputError(f"config.json: num_hidden_layers is {self.n_layer} but the checkpoint has layer "
                             f"{m[1]} ({hf_name!r})")
        if new is None:
            raise InputError(f"{self.arch_name}: cannot map checkpoint tensor {hf_name!r} to a llama.cpp name")
        return new

    def tensor_kind(self, gguf_name: str) -> gguf.MODEL_TENSOR | None:
        for kind, pattern in gguf.TENSOR_NAMES.items():
            if kind not in gguf.MODEL_TENSORS[self.gguf_arch]:
                continue
            base = gguf_name.rsplit(".", 1)[0]
            if "{bid}" in pattern:
                parts = base.split(".")
                if len(parts) > 2 and parts[0] == "blk" and pattern.format(bid=parts[1]) == base:
                    return kind
            elif pattern == base:
                return kind
        return None

    def is_f32_only(self, gguf_name: str, n_dims: int) -> bool:
        """llama.cpp's converter rule: 1-D, ``*_norm.weight``, routers, position/type embeddings stay F32."""
        if n_dims <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
            return True
        return self.tensor_kind(gguf_name) in _ALWAYS_F32

    def source_tensor(self, ck: SafetensorsCheckpoint, hf_name: str, gguf_name: str) -> RowSource:
        """Hook for per-tensor transforms (permutation, +1, truncation)."""
        return Direct(hf_name, ck.entry(hf_name).shape)

    def plan(self, ck: SafetensorsCheckpoint) -> list[PlannedTensor]:
        out: list[PlannedTensor] = []
        for hf_name, gguf_name, source in self.collect(ck):
            out.append(PlannedTensor(gguf_name, source, self.is_f32_only(gguf_name, len(source.shape))))
        names = [t.name for t in out]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise InputError(f"two checkpoint tensors map to the same GGUF tensor(s): {', '.join(sorted(dup)[:3])}")
        return sorted(out, key=lambda t: quantize_order_key(t.name))

    def renamed(self, ck: SafetensorsCheckpoint) -> Iterable[tuple[str, str]]:
        """``(checkpoint name, name to map)`` of every kept tensor; a family renames here (MTP blocks)."""
        for hf_name in ck.names():
            if not self.skip(hf_name):
                yield hf_name, hf_name

    def collect(self, ck: SafetensorsCheckpoint) -> Iterable[tuple[str, str, RowSource]]:
        for hf_name, name in self.renamed(ck):
            gguf_name = self.map_name(name)
            yield hf_name, gguf_name, self.source_tensor(ck, hf_name, gguf_name)

    # ---- metadata
    def hparams(self, md: Metadata) -> None:
        """Common keys, written the way llama.cpp's ``TextModel.set_gguf_parameters`` does."""
        a, c = self.arch_name, self.cfg
        md.u32(Keys.LLM.BLOCK_COUNT.format(arch=a), self.block_count)
        if (v := optional(c, "max_position_embeddings", "n_ctx", "n_positions", "max_length")) is not None:
            md.u32(Keys.LLM.CONTEXT_LENGTH.format(arch=a), v)
        if (v := optional(c, "hidden_size", "n_embd", "dim")) is not None:
            md.u32(Keys.LLM.EMBEDDING_LENGTH.format(arch=a), v)
        if (v := optional(c, "intermediate_size", "n_inner", "hidden_dim")) is not None:
            md.u32(Keys.LLM.FEED_FORWARD_LENGTH.format(arch=a), v)
        if (v := optional(c, "num_attention_heads", "n_head", "n_heads")) is not None:
            md.u32(Keys.Attention.HEAD_COUNT.format(arch=a), v)
        if (v := optional(c, "num_key_value_heads", "n_kv_heads")) is not None:
            md.u32(Keys.Attention.HEAD_COUNT_KV.format(arch=a), v)
        if c.get("is_causal") is False:
            md.boolean(Keys.Attention.CAUSAL.format(arch=a), False)
        rope = self.rope_parameters()
        full = rope.get("full_attention", rope)
        rope_type = full.get("rope_type") or full.get("type")
        factor = full.get("factor")
        if rope_type == "linear" and factor is not None:
            md.string(Keys.Rope.SCALING_TYPE.format(arch=a), "linear")
            md.f32(Keys.Rope.SCALING_FACTOR.format(arch=a), factor)
        elif rope_type == "yarn" and factor is not None:
            md.string(Keys.Rope.SCALING_TYPE.format(arch=a), "yarn")
            md.f32(Keys.Rope.SCALING_FACTOR.format(arch=a), factor)
            if full.get("original_max_position_embeddings") is None:
                raise InputError("config.json: yarn rope scaling needs original_max_position_embeddings")
            md.u32(Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=a), full["original_max_position_embeddings"])
        if (theta := full.get("rope_theta")) is not None:
            md.f32(Keys.Rope.FREQ_BASE.format(arch=a), theta)
        if (swa := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
            md.f32(Keys.Rope.FREQ_BASE_SWA.format(arch=a), swa)
        if (v := optional(c, "rms_norm_eps", "norm_eps")) is not None:
            md.f32(Keys.Attention.LAYERNORM_RMS_EPS.format(arch=a), v)
        if (v := optional(c, "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")) is not None:
            md.f32(Keys.Attention.LAYERNORM_EPS.format(arch=a), v)
        if (v := optional(c, "num_local_experts", "num_experts", "n_routed_experts")) is not None:
            md.u32(Keys.LLM.EXPERT_COUNT.format(arch=a), v)
        if (v := optional(c, "num_experts_per_tok", "num_experts_per_token")) is not None:
            md.u32(Keys.LLM.EXPERT_USED_COUNT.format(arch=a), v)
        if (v := c.get("head_dim")) is not None:
            md.u32(Keys.Attention.KEY_LENGTH.format(arch=a), v)
            md.u32(Keys.Attention.VALUE_LENGTH.format(arch=a), v)

    def rope_parameters(self) -> dict[str, Any]:
        """transformers 5 ``rope_parameters`` or older ``rope_scaling`` + top-level thetas, one shape."""
        c = self.cfg
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        if "full_attention" not in rope and "sliding_attention" not in rope:
            local = optional(c, "local_rope_theta", "rope_local_base_freq", "swa_rope_theta")
            if local is not None:
                rope["sliding_attention"] = {"rope_theta": local}
            theta = optional(c, "rope_global_theta", "rope_theta", "rotary_emb_base")
            if "rope_theta" not in rope and theta is not None:
                rope["rope_theta"] = theta
            if "rope_type" not in rope and rope.get("type") is not None:
                rope["rope_type"] = rope["type"]
        return rope

    def tokenizer_overrides(self, md: Metadata) -> None:
        """Per-family tokenizer tweaks applied after the generic tokenizer metadata."""


def quantize_order_key(name: str) -> tuple[int, str]:
    """llama.cpp's loader order (non-block tensors first, then by block number, then by name)."""
    if name.startswith("blk."):
        try:
            return int(name.split(".")[1]), name
        except ValueError:
            pass
    return -1, name


def permute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that turns HF's rotate-half Q/K layout into llama.cpp's interleaved one.

    Same index mapping as llama.cpp's ``LlamaModel.permute``: view the rows as
    ``[head, 2, half]`` and swap the last two axes.
    """
    half = n_rows // n_head // 2
    idx = np.arange(n_rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(-1)
    return idx

