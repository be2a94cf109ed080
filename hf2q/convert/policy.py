"""Per-tensor GGML type for a named mix — the same choice llama.cpp's quantizer makes.

Two stages, as in llama.cpp's own pipeline (HF → F16 GGUF → llama-quantize):

1. **export type** (``convert_hf_to_gguf.py``): 1-D tensors, ``*_norm.weight``, MoE routers,
   position/token-type embeddings and non-``.weight`` tensors are F32; everything else takes
   the float type of the export (F16 for every quantized mix).
2. **quantize type** (``llama_tensor_get_type`` in ``src/llama-quant.cpp``): only ≥2-D
   ``*.weight`` tensors that are not norms, routers, or position/type embeddings are
   quantized; the mix then upgrades attn_v / ffn_down / attn_output / token_embd / output by
   layer position, GQA ratio and expert count, and falls back to a 32-block type when a
   row length is not a multiple of 256 (or to F16 when not even 32 fits).

Tensors are visited in llama.cpp's loader order (by block number, then name), because the
attn_v counter (``i_attention_wv``) depends on that order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import gguf

from hf2q.convert.quant_names import QuantName

T = gguf.GGMLQuantizationType
F = gguf.LlamaFileType


@attrs.frozen
class ModelFacts:
    """The hyper-parameters llama.cpp's policy looks at."""

    arch: str
    n_layer: int  # blocks in the GGUF, MTP blocks included (llama.cpp's n_layer_all)
    n_head: int
    n_head_kv: int
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 1

    @property
    def is_llama_70b(self) -> bool:
        return self.arch == "llama" and self.n_layer == 80 and self.n_head != self.n_head_kv


@attrs.frozen
class TensorFacts:
    name: str
    ne: Sequence[int]  # ggml order (row length first)
    f32_only: bool


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                     ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                     ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def ggml_n_dims(ne: Sequence[int]) -> int:
    """ggml's ``ggml_n_dims``: trailing size-1 axes do not count (a ``[d, 1]`` gate is 1-D)."""
    n = len(ne)
    while n > 1 and int(ne[n - 1]) == 1:
        n -= 1
    return n


def allows_quantization(t: TensorFacts) -> bool:
    """llama.cpp's ``tensor_allows_quantization`` for the families we convert."""
    n = t.name
    if ggml_n_dims(t.ne) < 2 or not n.endswith("weight") or "_norm.weight" in n:
        return False
    if "ffn_gate_inp.weight" in n or n in ("position_embd.weight", "token_types.weight"):
        return False
    return not any(s in n for s in ("altup", "laurel", "per_layer_model_proj", "ssm_conv1d", "attn_rel_b.weight"))


def fallback_type(ncols: int, qtype: T) -> T:
    """llama.cpp's substitute when a row is not a multiple of ``qtype``'s block (mixes and tiers alike)."""
    blk = gguf.GGML_QUANT_SIZES[qtype][0]
    if ncols % blk == 0:
        return qtype
    out = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}.get(qtype, qtype)
    if ncols % gguf.GGML_QUANT_SIZES[out][0]:
        out = T.F16
    return out


class _Policy:
    def __init__(self, q: QuantName, m: ModelFacts, names: Iterable[str], has_imatrix: bool):
        self.q, self.m, self.ft, self.has_imatrix = q, m, q.ftype, has_imatrix
        cats = [_category(n) for n in names]
        self.n_attention_wv = sum(c in ("attn_v", "attn_qkv", "attn_kv_b") for c in cats)
        self.tied = "output" not in cats
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0
        self.n_layer = m.n_layer

    @staticmethod
    def more_bits(i: int, n: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    def layer(self, counter: int, name: str) -> int:
        if max(1, self.m.n_expert) > 1:
            return int(name.split(".")[1])
        return counter

    def choose(self, t: TensorFacts, cat: str, new: T) -> T:
        ft, m = self.ft, self.m
        if cat == "output" or (self.tied and cat == "token_embd"):
            if t.ne[0] % gguf.GGML_QUANT_SIZES[new][0] != 0:
                return T.Q8_0
            return new if new == T.Q8_0 else T.Q6_K
        if cat == "token_embd":
            return new
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            if ft == F.MOSTLY_Q2_K:
                new = T.Q4_K if m.n_gqa >= 4 else T.Q3_K
            elif ft == F.MOSTLY_Q2_K_S and m.n_gqa >= 4:
                new = T.Q4_K
            elif ft == F.MOSTLY_Q3_K_M:
                new = T.Q5_K if self.i_attention_wv < 2 else T.Q4_K
            elif ft == F.MOSTLY_Q3_K_L:
                new = T.Q5_K
            elif ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and self.more_bits(self.i_attention_wv, self.n_attention_wv):
                new = T.Q6_K
            elif ft == F.MOSTLY_Q4_K_S and self.i_attention_wv < 4:
                new = T.Q5_K
            if m.is_llama_70b and new in (T.Q3_K, T.Q4_K):
                new = T.Q5_K
            if m.n_expert == 8:
                new = T.Q8_0
            self.i_attention_wv += 1
            return new
        if cat == "attn_k":
            return T.Q8_0 if m.n_expert == 8 else new
        if cat == "ffn_down":
            i, n = self.layer(self.i_ffn_down, t.name), self.n_layer
            if ft == F.MOSTLY_Q2_K:
                new = T.Q3_K
            elif ft == F.MOSTLY_Q2_K_S:
                if i < n // 8:
                    new = T.Q4_K
            elif ft == F.MOSTLY_Q3_K_M:
                new = T.Q5_K if i < n // 16 else T.Q4_K
            elif ft == F.MOSTLY_Q3_K_L:
                new = T.Q5_K
            elif ft == F.MOSTLY_Q4_K_M:
                if self.more_bits(i, n):
                    new = T.Q6_K
            elif ft == F.MOSTLY_Q5_K_M and self.more_bits(i, n):
                new = T.Q6_K
            elif ft == F.MOSTLY_Q4_K_S and i < n // 8:
                new = T.Q5_K
            elif ft in (F.MOSTLY_Q4_0, F.MOSTLY_Q5_0) and self.has_imatrix and i < n // 8:
                new = T.Q4_1 if ft == F.MOSTLY_Q4_0 else T.Q5_1
            self.i_ffn_down += 1
            return new
        if cat == "attn_output":
            if m.n_expert == 8:
                if ft in (F.MOSTLY_Q2_K, F.MOSTLY_Q3_K_S, F.MOSTLY_Q3_K_M, F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M):
                    new = T.Q5_K
            elif ft == F.MOSTLY_Q2_K:
                new = T.Q3_K
            elif ft == F.MOSTLY_Q3_K_M:
                new = T.Q4_K
            elif ft == F.MOSTLY_Q3_K_L:
                new = T.Q5_K
            return new
        if cat == "attn_qkv":  # unreachable (handled with attn_v) — kept for clarity of the mapping
            return new
        if cat == "ffn_gate":
            self.layer(self.i_ffn_gate, t.name)
            self.i_ffn_gate += 1
            return new
        if cat == "ffn_up":
            self.layer(self.i_ffn_up, t.name)
            self.i_ffn_up += 1
            return new
        return new


def export_type(q: QuantName, t: TensorFacts) -> T:
    """Type in llama.cpp's float export (stage 1): F32 for kept-F32 tensors, else the float type."""
    if t.f32_only:
        return T.F32
    if q.is_float:
        return q.default_type
    return T.F16


def plan_types(q: QuantName, model: ModelFacts, tensors: Sequence[TensorFacts],
               has_imatrix: bool = False) -> list[T]:
    """GGML type per tensor (same order as ``tensors``, which must be in loader order).

    Tiers (``q.tier``) have no fixed mix: ``tier_plan.plan_tier`` plans them from the data."""
    if q.tier:
        raise ValueError(f"{q.name} is a tier: its types come from tier_plan.plan_tier")
    pol = _Policy(q, model, [t.name for t in tensors], has_imatrix)
    out: list[T] = []
    for t in tensors:
        base = export_type(q, t)
        if q.is_float or not allows_quantization(t) or base == T.F32 and t.f32_only:
            out.append(base)
            continue
        new = pol.choose(t, _category(t.name), q.default_type)
        out.append(fallback_type(int(t.ne[0]), new))
    return out
