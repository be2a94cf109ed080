"""Qwen 3.5 / 3.6 (hybrid Gated DeltaNet + gated attention) → GGUF arch ``qwen35`` / ``qwen35moe``.

Three layers in four are linear attention (``linear_attn.*``), the fourth full attention whose
``q_proj`` holds each head's query and output gate interleaved (stored as is: llama.cpp splits
it at run time). The transforms are llama.cpp's converter's, so stock llama.cpp loads the file:

- ``conv1d`` ``[C, 1, K]`` loses its middle axis and stays F32; ``dt_bias`` becomes
  ``ssm_dt.bias``; ``A_log`` is stored as ``-exp(A_log)`` (``ssm_a``).
- every RMSNorm weight is stored as ``1 + w`` (Qwen 3.5 norms multiply by ``1 + w``) except the
  DeltaNet output norm ``linear_attn.norm``, which multiplies by ``w``.
- when there are fewer key heads than value heads, the value heads are reordered from grouped
  by key head (``k0v0 k0v1 … k1v0 …``) to tiled (``k0v0 k1v0 … k0v1 …``), which is what ggml's
  broadcast of the key heads expects: the V rows of ``in_proj_qkv`` and of the conv channels,
  the rows of ``in_proj_z``/``in_proj_a``/``in_proj_b``, ``A_log``, ``dt_bias``, and the
  *columns* of ``out_proj``.
- the multi-token-prediction head (``mtp.*``) becomes block ``num_hidden_layers`` (a full
  attention block plus ``nextn.eh_proj/enorm/hnorm/shared_head_norm``); ``--no-mtp`` drops it,
  ``--mtp`` writes it alone (with the embeddings, final norm and LM head) as a draft model.

llama.cpp computes ``-exp(A_log)`` with torch, whose float32 ``exp`` is not correctly rounded;
hf2q uses torch too when it is installed (the same bits), else a float64 ``exp`` rounded once
(within one float32 ulp of it).
"""

from __future__ import annotations

import logging
import re

import attrs
import gguf
import numpy as np

from hf2q.arch.base import Family, Metadata, RowSource
from hf2q.arch.qwen3_moe import collect_with_experts
from hf2q.errors import InputError
from hf2q.formats.gguf_keys import ExtraKeys, Keys
from hf2q.sources.hf_config import optional, require
from hf2q.sources.safetensors_reader import to_f32

log = logging.getLogger("hf2q.convert")

K = gguf.MODEL_TENSOR
_MTP_LAYER = re.compile(r"^(?:model\.)?mtp\.layers\.(\d+)\.(.+)$")
_MTP_TOP = re.compile(r"^(?:model\.)?mtp\.([a-z_]+)\.(weight|bias)$")
# the MTP head's own tensors (besides its decoder block) → llama.cpp's nextn tensors
_MTP_NEXTN = {"fc": K.NEXTN_EH_PROJ, "pre_fc_norm_embedding": K.NEXTN_ENORM,
              "pre_fc_norm_hidden": K.NEXTN_HNORM, "norm": K.NEXTN_SHARED_HEAD_NORM}
# what an MTP-only draft file keeps of the trunk
_DECODER_LAYER = re.compile(r"^(?:model\.)?layers\.\d+\.")
_MTP_ONLY_KEEPS = ("token_embd.weight", "output_norm.weight", "output.weight")
# llama.cpp writes these sections when a checkpoint's rope_parameters lack them
DEFAULT_MROPE_SECTIONS = (11, 11, 10, 0)


@attrs.define
class Transformed(RowSource):
    """One HF tensor with rows and/or columns gathered in a new order and an elementwise op.

    ``shape`` is the output shape; the checkpoint tensor may have extra size-1 axes (``conv1d``).
    A 1-D tensor is one row, so its reorder is a column order."""

    name: str
    shape: tuple[int, ...]
    row_order: np.ndarray | None = None
    col_order: np.ndarray | None = None
    add: float = 0.0  # 1 + w norms
    neg_exp: bool = False  # A_log → -exp(A_log)

    @property
    def source_names(self) -> tuple[str, ...]:
        return (self.name,)

    def rows(self, ck, lo, hi):
        ncols = self.shape[-1]
        raw = np.asarray(ck.raw(self.name)).reshape(-1, ncols)
        raw = raw[self.row_order[lo:hi]] if self.row_order is not None else raw[lo:hi]
        if self.col_order is not None:
            raw = raw[:, self.col_order]
        dtype = ck.entry(self.name).dtype
        x = to_f32(np.ascontiguousarray(raw), dtype)
        if dtype == "F16":  # llama.cpp's converter does the arithmetic in the checkpoint's float16
            x = x.astype(np.float16)
        if self.add:
            x = x + x.dtype.type(self.add)
        if self.neg_exp:
            x = -_exp(x)
        return np.ascontiguousarray(x, dtype=np.float32)


def _exp(x: np.ndarray) -> np.ndarray:
    """``exp`` with torch's rounding when torch is importable (what llama.cpp's converter runs)."""
    try:
        import torch
    except ImportError:
        return np.exp(x.astype(np.float64)).astype(x.dtype)
    return torch.exp(torch.from_numpy(np.ascontiguousarray(x))).numpy()


def tiled_value_heads(n_k_heads: int, v_per_k: int, head_dim: int) -> np.ndarray:
    """Gather order turning value heads grouped by key head into ggml's tiled broadcast order.

    Row ``j`` of the result is row ``order[j]`` of the source: view the rows as
    ``[key head, value head within the group, head_dim]`` and swap the first two axes."""
    n = n_k_heads * v_per_k * head_dim
    return np.arange(n).reshape(n_k_heads, v_per_k, head_dim).transpose(1, 0, 2).reshape(-1)


def _kind(gguf_name: str) -> str:
    """``blk.3.attn_qkv.weight`` → ``attn_qkv``; ``blk.0.ssm_a`` → ``ssm_a``."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        parts = parts[2:]
    if parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return ".".join(parts)


class Qwen35(Family):
    hf_architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    gguf_arch = gguf.MODEL_ARCH.QWEN35
    tokenizer_kind = "bpe"
    has_mtp = True

    def __init__(self, cfg, src, mtp: str = "keep"):
        super().__init__(cfg, src, mtp=mtp)
        c = cfg
        self.n_k_heads = int(require(c, "linear_num_key_heads"))
        self.n_v_heads = int(require(c, "linear_num_value_heads"))
        self.head_k_dim = int(require(c, "linear_key_head_dim"))
        self.head_v_dim = int(require(c, "linear_value_head_dim"))
        if self.n_v_heads % self.n_k_heads:
            raise InputError(f"config.json: linear_num_value_heads {self.n_v_heads} is not a multiple of "
                             f"linear_num_key_heads {self.n_k_heads}")
        layer_types = c.get("layer_types")
        if layer_types is not None and len(layer_types) != self.n_layer:
            raise InputError(f"config.json: layer_types has {len(layer_types)} entries, "
                             f"expected num_hidden_layers ({self.n_layer})")
        self.n_mtp = 0  # MTP blocks written; known once the checkpoint is planned
        # map names up to the MTP blocks too (a larger map only adds entries)
        self.tensor_map = gguf.get_tensor_name_map(self.gguf_arch, self.n_layer + 8)

    @property
    def block_count(self) -> int:
        return self.n_layer + self.n_mtp

    def expected_blocks(self) -> range:
        # --mtp writes the MTP blocks alone, still numbered after the decoder layers
        return range(self.n_layer, self.block_count) if self.mtp == "only" else range(self.block_count)

    def layer_summary(self) -> dict[str, int]:
        """The layer mix and the recurrent state a serving slot holds (F32, as llama.cpp keeps it):
        per linear layer a (kernel − 1)-token conv window over the q/k/v channels and one
        key × value matrix per value head."""
        c = self.cfg
        interval = int(c.get("full_attention_interval", 4))
        types = c.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                         for i in range(self.n_layer)]
        n_linear = sum(t == "linear_attention" for t in types)
        conv = (int(require(c, "linear_conv_kernel_dim")) - 1) * (
            2 * self.n_k_heads * self.head_k_dim + self.n_v_heads * self.head_v_dim)
        ssm = self.n_v_heads * self.head_k_dim * self.head_v_dim
        return {"linear_attention_layers": n_linear, "full_attention_layers": self.n_layer - n_linear,
                "mtp_blocks": self.n_mtp, "recurrent_state_bytes_per_slot": 4 * n_linear * (conv + ssm)}

    # ---- tensors
    def skip(self, hf_name: str) -> bool:
        dropped_mtp = self.mtp == "drop" and hf_name.startswith(("mtp.", "model.mtp."))
        return super().skip(hf_name) or "visual." in hf_name or dropped_mtp

    def plan(self, ck):
        self.n_mtp = self._count_mtp(ck)
        return super().plan(ck)

    def _count_mtp(self, ck) -> int:
        """MTP blocks in the checkpoint (``mtp.layers.N``), checked against ``mtp_num_hidden_layers``."""
        if self.mtp == "drop":
            return 0
        found = {int(m[1]) for n in ck.names() if (m := _MTP_LAYER.match(n))}
        n = max(found) + 1 if found else 0
        declared = int(self.cfg.get("mtp_num_hidden_layers") or 0)
        if declared and declared != n:
            log.warning("config.json declares %d MTP layer(s) but the checkpoint has %d; writing %d",
                        declared, n, n)
        if self.mtp == "only" and n == 0:
            raise InputError("--mtp: the checkpoint has no multi-token-prediction tensors (mtp.*)")
        if n > 8:
            raise InputError(f"the checkpoint has {n} MTP layers; at most 8 are supported")
        return n

    def renamed(self, ck):
        """MTP tensors take llama.cpp's layer-indexed names; ``--mtp`` keeps only them and the head."""
        for hf_name, name in super().renamed(ck):
            name = name.replace("language_model.", "")
            if name.endswith(".dt_bias"):  # gguf's table knows it as the dt projection's bias
                name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
            if m := _MTP_LAYER.match(name):
                name = f"model.layers.{self.n_layer + int(m[1])}.{m[2]}"
            elif m := _MTP_TOP.match(name):
                if m[1] not in _MTP_NEXTN:
                    raise InputError(f"{self.arch_name}: unknown MTP tensor {hf_name!r}")
                name = f"{gguf.TENSOR_NAMES[_MTP_NEXTN[m[1]]].format(bid=self.n_layer)}.{m[2]}"
            elif self.mtp == "only" and (_DECODER_LAYER.match(name) or self.map_name(name) not in _MTP_ONLY_KEEPS):
                continue  # decoder layers go first: their per-expert tensors have no one-to-one GGUF name
            yield hf_name, name

    def map_name(self, hf_name: str) -> str:
        if hf_name.startswith("blk."):  # already a llama.cpp name (an MTP head tensor)
            return hf_name
        return super().map_name(hf_name)

    def source_tensor(self, ck, hf_name, gguf_name):
        shape = tuple(ck.entry(hf_name).shape)
        kind = _kind(gguf_name)
        rows = cols = None
        add, neg_exp = 0.0, False
        v_per_k = self.n_v_heads // self.n_k_heads
        reorder = v_per_k > 1
        if kind == "ssm_conv1d":
            shape = tuple(d for d in shape if d != 1) if len(shape) == 3 else shape
        if reorder and kind in ("attn_qkv", "ssm_conv1d"):
            qk = 2 * self.n_k_heads * self.head_k_dim
            rows = np.concatenate([np.arange(qk), qk + tiled_value_heads(self.n_k_heads, v_per_k, self.head_v_dim)])
        elif reorder and kind == "attn_gate":
            rows = tiled_value_heads(self.n_k_heads, v_per_k, self.head_v_dim)
        elif reorder and kind in ("ssm_alpha", "ssm_beta"):
            rows = tiled_value_heads(self.n_k_heads, v_per_k, 1)
        elif reorder and kind in ("ssm_a", "ssm_dt"):
            cols = tiled_value_heads(self.n_k_heads, v_per_k, 1)
        elif reorder and kind == "ssm_out":
            cols = tiled_value_heads(self.n_k_heads, v_per_k, self.head_v_dim)
        if kind == "ssm_a":
            neg_exp = True
        elif gguf_name.endswith("norm.weight") and kind != "ssm_norm":
            add = 1.0
        for order, n in ((rows, int(np.prod(shape[:-1])) if len(shape) > 1 else 1), (cols, shape[-1])):
            if order is not None and len(order) != n:
                raise InputError(f"{hf_name}: shape {list(shape)} does not match the linear-attention head "
                                 f"layout ({self.n_k_heads} key / {self.n_v_heads} value heads)")
        return Transformed(hf_name, shape, row_order=rows, col_order=cols, add=add, neg_exp=neg_exp)

    # ---- metadata
    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        a, c = self.arch_name, self.cfg
        if (v := c.get("moe_intermediate_size")) is not None:
            md.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), v)
        if (v := c.get("shared_expert_intermediate_size")) is not None:
            md.u32(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=a), v)
        if self.n_mtp:
            md.u32(Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=a), self.n_mtp)
        md.u32(Keys.SSM.CONV_KERNEL.format(arch=a), require(c, "linear_conv_kernel_dim"))
        md.u32(Keys.SSM.STATE_SIZE.format(arch=a), self.head_k_dim)
        md.u32(Keys.SSM.GROUP_COUNT.format(arch=a), self.n_k_heads)
        md.u32(Keys.SSM.TIME_STEP_RANK.format(arch=a), self.n_v_heads)
        md.u32(Keys.SSM.INNER_SIZE.format(arch=a), self.head_v_dim * self.n_v_heads)
        if (layer_types := c.get("layer_types")) is not None:
            recurrent = [t == "linear_attention" for t in layer_types] + [False] * self.n_mtp
            md.array(ExtraKeys.RECURRENT_LAYERS.format(arch=a), recurrent, gguf.GGUFValueType.BOOL)
        md.u32(Keys.LLM.FULL_ATTENTION_INTERVAL.format(arch=a), c.get("full_attention_interval", 4))
        rope = self.rope_parameters()
        head_dim = c.get("head_dim") or require(c, "hidden_size") // self.n_head
        partial = rope.get("partial_rotary_factor", optional(c, "partial_rotary_factor", "rope_pct") or 0.25)
        md.u32(Keys.Rope.DIMENSION_COUNT.format(arch=a), int(head_dim * partial))
        sections = list(rope.get("mrope_section") or DEFAULT_MROPE_SECTIONS)
        sections = (sections + [0] * 4)[:4]
        md.array(Keys.Rope.DIMENSION_SECTIONS.format(arch=a), sections, gguf.GGUFValueType.INT32)


class Qwen35Moe(Qwen35):
    """The MoE variant: softmax top-k experts plus a shared expert behind a sigmoid gate."""

    hf_architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    gguf_arch = gguf.MODEL_ARCH.QWEN35MOE

    def collect(self, ck):
        return collect_with_experts(self, ck)

    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        require(self.cfg, "num_experts_per_tok")
