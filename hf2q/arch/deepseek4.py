"""DeepSeek-V4 family → GGUF arch ``deepseek4``, from DeepSeek's own inference layout.

DeepSeek publishes V4 in the layout its inference code loads, not transformers': ``embed``,
``head``, ``layers.N.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}``, a compressor (and
on ratio-4 layers a lightning indexer with its own compressor) per compressed layer,
``ffn.gate.{weight,bias,tid2eid}``, shared and routed experts and the hyper-connection mixers
``hc_*``; the MTP block sits under ``mtp.0.``. Its storage decides the GGUF types, the way
llama.cpp's converter (``DeepseekV4Model``) decides them, whatever float type is asked for:

* FP8 E4M3 matrices with a 128×128-block scale are dequantized and written as Q8_0;
* routed experts are MXFP4 (row-packed codes + E8M0 exponents): repacked into ``block_mxfp4``
  bit for bit and stacked per layer, so the file type is ``MOSTLY_MXFP4_MOE``;
* BF16 matrices stay BF16, F32 tensors stay F32, vectors become F32;
* the hash layers' ``tid2eid`` token → expert table is written as I32 (their router bias is unused
  and dropped); the MTP block's ``e_proj``/``h_proj`` are joined into one Q8_0 ``eh_proj``.

``--mtp`` writes only the MTP block (as llama.cpp's ``--mtp``: embedding, head and output norm
kept, the block's own hyper-connection head in place of the trunk's); the default, like llama.cpp's,
leaves it out. llama-quantize refuses to requantize the export's Q8_0 and MXFP4 tensors, so only the
float names are offered.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import gguf
import numpy as np

from hf2q.arch.base import MT, Direct, Family, Metadata, Packed, PlannedTensor, quantize_order_key
from hf2q.errors import InputError
from hf2q.formats.gguf_check_deepseek4 import RATIOS, bad_ratios
from hf2q.formats.gguf_keys import DeepSeek4Keys, DeepSeek4Tensors, ExtraKeys, Keys
from hf2q.ggml import mxfp4
from hf2q.sources import fp8
from hf2q.sources.hf_config import require
from hf2q.sources.safetensors_reader import SafetensorsCheckpoint, to_f32

log = logging.getLogger("hf2q.convert")
T = gguf.GGMLQuantizationType

#: residual streams llama.cpp's hyper-connection kernels are written for
HC_STREAMS = 4
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_EXPERT_PROJ = {"w1": DeepSeek4Tensors.FFN_GATE_EXPS, "w2": DeepSeek4Tensors.FFN_DOWN_EXPS,
                "w3": DeepSeek4Tensors.FFN_UP_EXPS}
# an MTP block's own tensors (the rest of ``mtp.N.*`` is an ordinary decoder layer)
_MTP_OWN = {"e_proj.weight", "e_proj.scale", "h_proj.weight", "h_proj.scale", "enorm.weight", "hnorm.weight",
            "norm.weight"}
_MTP_ROOT = ("hc_head_fn", "hc_head_base", "hc_head_scale")
# what every block holds (official names after ``layers.N.``), and what its compress ratio and MTP role add
_BLOCK_REQUIRED = ("attn_norm.weight", "attn.attn_sink", "attn.wq_a.weight", "attn.q_norm.weight", "attn.wq_b.weight",
                   "attn.wkv.weight", "attn.kv_norm.weight", "attn.wo_a.weight", "attn.wo_b.weight", "hc_attn_fn",
                   "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "ffn_norm.weight",
                   "ffn.gate.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
                   "ffn.shared_experts.w3.weight")
_COMPRESSOR_REQUIRED = ("attn.compressor.ape", "attn.compressor.wkv.weight", "attn.compressor.wgate.weight",
                        "attn.compressor.norm.weight")
_INDEXER_REQUIRED = ("attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight", "attn.indexer.compressor.ape",
                     "attn.indexer.compressor.wkv.weight", "attn.indexer.compressor.wgate.weight",
                     "attn.indexer.compressor.norm.weight")
_NEXTN_REQUIRED = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight")
# what an ``--mtp`` file keeps of the trunk
_MTP_KEEPS = ("embed.weight", "norm.weight", "head.weight", "head.scale")
_VISION = ("aligner.", "image_")


# --------------------------------------------------------------------------- row sources
@attrs.define
class BlockScaledQ8(Packed):
    """FP8 (or plain float) matrices, block-dequantized, joined along columns, written as Q8_0.

    llama.cpp quantizes the float32 product directly (no F16 step), which this does too; the convert
    pipeline does it on its worker pool (``quantizes_rows``), ``packed`` is the one-thread path."""

    parts: tuple[tuple[str, str | None], ...]  # (weight, its block scale or None)
    shape: tuple[int, ...]
    stored_type: T = T.Q8_0
    quantizes_rows: ClassVar[bool] = True

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(n for p in self.parts for n in p if n is not None)

    def rows(self, ck, lo, hi):
        out = []
        for weight, scale in self.parts:
            e = ck.entry(weight)
            x = to_f32(np.asarray(ck.raw(weight)[lo:hi]), e.dtype)
            if scale is not None:
                x = fp8.dequantize_rows(x, to_f32(ck.raw(scale), ck.entry(scale).dtype), lo)
            out.append(x)
        return np.ascontiguousarray(np.concatenate(out, axis=1), dtype=np.float32)

    def packed(self, ck, lo, hi):
        from hf2q.ggml import codec

        return codec.quantize(self.rows(ck, lo, hi), T.Q8_0, 1)


@attrs.define
class StackedMxfp4(Packed):
    """Per-expert row-packed MXFP4 weights stacked into one ``[E, rows, cols]`` ``block_mxfp4`` tensor."""

    parts: tuple[tuple[str, str], ...]  # per expert: (packed codes, exponents)
    shape: tuple[int, ...]
    stored_type: T = T.MXFP4

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(n for p in self.parts for n in p)

    def _slices(self, ck, lo, hi):
        per = self.shape[1]
        r = lo
        while r < hi:
            e, local = divmod(r, per)
            take = min(hi - r, per - local)
            codes, exps = self.parts[e]
            yield ck.raw(codes)[local:local + take], ck.raw(exps)[local:local + take]
            r += take

    def rows(self, ck, lo, hi):
        return np.concatenate([mxfp4.decode_packed(c, s) for c, s in self._slices(ck, lo, hi)], axis=0)

    def packed(self, ck, lo, hi):
        return np.concatenate([mxfp4.repack_rows(c, s) for c, s in self._slices(ck, lo, hi)], axis=0)


@attrs.define
class HashTable(Packed):
    """A hash layer's token → experts table, written as I32 (llama.cpp reads it with ``get_rows``)."""

    name: str
    shape: tuple[int, ...]
    stored_type: T = T.I32

    @property
    def source_names(self) -> tuple[str, ...]:
        return (self.name,)

    def rows(self, ck, lo, hi):
        return np.asarray(ck.raw(self.name)[lo:hi], dtype=np.float32)

    def packed(self, ck, lo, hi):
        return np.ascontiguousarray(ck.raw(self.name)[lo:hi], dtype="<i4").view(np.uint8)


# --------------------------------------------------------------------------- the family
class DeepSeek4(Family):
    hf_architectures = ("DeepseekV4ForCausalLM",)
    # gguf 0.19 has no DEEPSEEK4: the stand-in only gives the base class a tensor map it never uses
    gguf_arch = gguf.MODEL_ARCH.DEEPSEEK2
    gguf_arch_name = DeepSeek4Keys.ARCH
    has_mtp = True

    def __init__(self, cfg: dict[str, Any], src: Path, mtp: str = "keep"):
        super().__init__(cfg, src, mtp=mtp)
        self.n_nextn = require(cfg, "num_nextn_predict_layers", kind=int) if cfg.get("num_nextn_predict_layers") else 0
        if self.n_nextn < 0:
            raise InputError(f"config.json: num_nextn_predict_layers {self.n_nextn} is below 0")
        if self.mtp == "only" and self.n_nextn < 1:
            raise InputError("--mtp: config.json has no num_nextn_predict_layers (the checkpoint has no MTP block)")
        self.ratios = self._compress_ratios()
        self.n_hash = int(require(cfg, "num_hash_layers", kind=int))

    @property
    def arch_name(self) -> str:
        return DeepSeek4Keys.ARCH

    @property
    def block_count(self) -> int:
        return self.n_layer + (self.n_nextn if self.mtp == "only" else 0)

    def expected_blocks(self) -> range:
        return range(self.n_layer, self.block_count) if self.mtp == "only" else range(self.n_layer)

    # ---- config
    def _compress_ratios(self) -> list[int]:
        ratios = self.cfg.get("compress_ratios")
        if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
            raise InputError("config.json: DeepSeek-V4 needs compress_ratios (one whole number per layer)")
        need = self.n_layer + (self.n_nextn if self.mtp == "only" else 0)
        if len(ratios) < need:
            raise InputError(f"config.json: compress_ratios has {len(ratios)} entries but the model has {need} blocks")
        if bad := bad_ratios(ratios):
            raise InputError(f"config.json: compress ratio(s) {bad} are not supported (llama.cpp's deepseek4 "
                             f"has {', '.join(map(str, RATIOS))})")
        return ratios

    def check_config(self) -> None:
        c = self.cfg
        if (hc := require(c, "hc_mult", kind=int)) != HC_STREAMS:
            raise InputError(f"config.json: hc_mult {hc} is not supported (llama.cpp's deepseek4 mixes "
                             f"{HC_STREAMS} hyper-connection streams)")
        if (score := c.get("scoring_func", "sqrtsoftplus")) != "sqrtsoftplus":
            raise InputError(f"config.json: scoring_func {score!r} is not supported (DeepSeek-V4 routes with "
                             "sqrtsoftplus)")
        if self.n_head_kv != 1:
            raise InputError(f"config.json: num_key_value_heads {self.n_head_kv} is not supported "
                             "(DeepSeek-V4 attends with one shared KV head)")
        groups = require(c, "o_groups", kind=int)
        if groups < 1 or self.n_head % groups:
            raise InputError(f"config.json: num_attention_heads {self.n_head} is not a multiple of o_groups {groups}")
        if not 0 <= self.n_hash <= self.n_layer:
            raise InputError(f"config.json: num_hash_layers {self.n_hash} must be between 0 and "
                             f"num_hidden_layers {self.n_layer}")
        if (rope := require(c, "qk_rope_head_dim", kind=int)) > self.head_dim or rope % 2:
            raise InputError(f"config.json: qk_rope_head_dim {rope} must be even and at most head_dim {self.head_dim}")
        if (dtype := c.get("expert_dtype", (c.get("quantization_config") or {}).get("expert_dtype", "fp4"))) != "fp4":
            raise InputError(f"config.json: expert_dtype {dtype!r} is not supported (routed experts must be "
                             "MXFP4-packed, as DeepSeek-V4 ships them)")

    def check_quant(self, quant) -> None:
        if not quant.is_float:
            raise InputError(f"deepseek4: --quant {quant.name} is not available (llama-quantize refuses to "
                             "requantize the Q8_0 and MXFP4 tensors of the export); use f16 or bf16: FP8 weights "
                             "become Q8_0, experts stay MXFP4")

    def file_type(self, quant) -> gguf.LlamaFileType:
        return gguf.LlamaFileType.MOSTLY_MXFP4_MOE

    def layer_summary(self) -> dict[str, int]:
        ratios = self.ratios[:self.n_layer]
        return {"sliding window layers": ratios.count(0), "compressed sparse layers": ratios.count(4),
                "heavily compressed layers": ratios.count(128), "hash-routed layers": self.n_hash,
                "mtp blocks": self.n_nextn if self.mtp == "only" else 0}

    # ---- tensors
    def tensor_kind(self, gguf_name: str) -> gguf.MODEL_TENSOR | None:
        # only the kinds the generic checks look up (the embedding's rows against the vocabulary)
        return MT.TOKEN_EMBD if gguf_name == "token_embd.weight" else None

    def renamed(self, ck: SafetensorsCheckpoint) -> Iterable[tuple[str, str]]:
        """``(checkpoint name, official name as a trunk tensor)``: MTP blocks become blocks after the trunk."""
        for name in ck.names():
            if name.startswith(_VISION):
                continue
            if m := _MTP.match(name):
                if self.mtp != "only":
                    continue
                idx, rest = int(m[1]), m[2]
                if idx >= self.n_nextn:
                    raise InputError(f"{name}: MTP block {idx} beyond num_nextn_predict_layers {self.n_nextn}")
                bid = self.n_layer + idx
                if rest in _MTP_ROOT:
                    yield name, rest
                elif rest in _MTP_OWN:
                    yield name, f"layers.{bid}.nextn.{'shared_head_norm.weight' if rest == 'norm.weight' else rest}"
                else:
                    yield name, f"layers.{bid}.{rest}"
                continue
            if self.mtp == "only" and name not in _MTP_KEEPS:
                continue
            if (m := _LAYER.match(name)) and int(m[1]) >= self.n_layer:
                raise InputError(f"config.json: num_hidden_layers is {self.n_layer} but the checkpoint has layer "
                                 f"{m[1]} ({name!r})")
            yield name, name

    def plan(self, ck: SafetensorsCheckpoint) -> list[PlannedTensor]:
        by_official: dict[str, str] = {}  # official trunk name → checkpoint name
        for hf_name, official in self.renamed(ck):
            if official in by_official:
                raise InputError(f"{hf_name} and {by_official[official]} are both the model's {official}")
            by_official[official] = hf_name
        experts: dict[tuple[int, str], dict[int, dict[str, str]]] = {}
        out: list[PlannedTensor] = []
        scales = {o for o in by_official if o.endswith(".scale")}
        for official, hf_name in sorted(by_official.items()):
            if m := _EXPERT.match(official):
                experts.setdefault((int(m[1]), m[3]), {}).setdefault(int(m[2]), {})[m[4]] = hf_name
                continue
            if official in scales:
                continue  # read with its weight
            if (m := _LAYER.match(official)) and m[2] in ("ffn.gate.bias",) and int(m[1]) < self.n_hash:
                continue  # hash layers route by tid2eid; their bias is never read
            if official.endswith(".nextn.h_proj.weight"):
                continue  # joined into eh_proj with e_proj
            out.append(self._planned(ck, official, hf_name, by_official))
        for (bid, proj), per in sorted(experts.items()):
            out.append(self._experts(ck, bid, proj, per))
        seen = [t.name for t in out]
        if dup := sorted({n for n in seen if seen.count(n) > 1}):
            raise InputError(f"two checkpoint tensors map to the same GGUF tensor(s): {', '.join(dup[:3])}")
        self._check_complete(set(seen))
        for t in out:
            if isinstance(t.source, HashTable):
                self._check_hash_table(ck, t.source)
        return sorted(out, key=lambda t: quantize_order_key(t.name))

    def _check_complete(self, names: set[str]) -> None:
        """Every tensor llama.cpp's loader requires of each block (by its compress ratio and routing) is there."""
        want = [DeepSeek4Tensors.ROOT[n] for n in ("embed.weight", "norm.weight", "head.weight", *_MTP_ROOT)]
        for bid in self.expected_blocks():
            ratio = self.ratios[bid]
            keys = list(_BLOCK_REQUIRED)
            keys.append("ffn.gate.tid2eid" if bid < self.n_hash else "ffn.gate.bias")
            keys += _COMPRESSOR_REQUIRED if ratio else []
            keys += _INDEXER_REQUIRED if ratio == 4 else []
            keys += _NEXTN_REQUIRED if bid >= self.n_layer else []
            want += [DeepSeek4Tensors.LAYER[k].format(bid=bid) for k in keys]
            want += [p.format(bid=bid) for p in _EXPERT_PROJ.values()]
        if missing := [n for n in want if n not in names]:
            raise InputError(f"the checkpoint lacks {', '.join(missing[:3])}"
                             + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                             + " (llama.cpp's deepseek4 needs them)")

    def _check_hash_table(self, ck, src: HashTable) -> None:
        rows, k = (src.shape + (0,))[:2]
        used = require(self.cfg, "num_experts_per_tok", kind=int)
        if len(src.shape) != 2 or k != used or rows < int(self.cfg.get("vocab_size") or 0):
            raise InputError(f"{src.name} has shape {list(src.shape)}; a hash table is [vocab_size, "
                             f"num_experts_per_tok {used}]")
        table = ck.raw(src.name)
        if table.size and (int(table.min()) < 0 or int(table.max()) >= self.n_expert):
            raise InputError(f"{src.name} routes to expert {int(table.max())} (or below 0) but the model has "
                             f"{self.n_expert} experts")

    def gguf_name(self, official: str) -> str:
        if official in DeepSeek4Tensors.ROOT:
            return DeepSeek4Tensors.ROOT[official]
        m = _LAYER.match(official)
        if m is None or m[2] not in DeepSeek4Tensors.LAYER:
            raise InputError(f"deepseek4: cannot map checkpoint tensor {official!r} to a llama.cpp name")
        return DeepSeek4Tensors.LAYER[m[2]].format(bid=int(m[1]))

    def _planned(self, ck, official: str, hf_name: str, by_official: dict[str, str]) -> PlannedTensor:
        e = ck.entry(hf_name)
        if official.endswith(".nextn.e_proj.weight"):
            h_official = official.replace(".e_proj.", ".h_proj.")
            if h_official not in by_official:
                raise InputError(f"{hf_name}: the MTP block has e_proj but no h_proj")
            parts = tuple((by_official[o], self._scale_of(ck, o, by_official))
                          for o in (official, h_official))
            shapes = [ck.entry(p[0]).shape for p in parts]
            if shapes[0][0] != shapes[1][0]:
                raise InputError(f"{hf_name}: e_proj {list(shapes[0])} and h_proj {list(shapes[1])} differ in rows")
            name = self.gguf_name(official.replace(".e_proj.", ".eh_proj."))
            return PlannedTensor(name, BlockScaledQ8(parts, (shapes[0][0], shapes[0][1] + shapes[1][1])), False)
        name = self.gguf_name(official)
        if official.endswith(".ffn.gate.tid2eid"):
            if e.dtype not in ("I64", "I32", "I16", "U8", "I8"):
                raise InputError(f"{hf_name} has dtype {e.dtype}; the hash table must hold integers")
            return PlannedTensor(name, HashTable(hf_name, e.shape), False)
        self._check_shape(official, hf_name, e.shape)
        if e.dtype in ("F8_E4M3", "F8_E5M2"):
            scale = self._scale_of(ck, official, by_official)  # raises when an 8-bit float has none
            return PlannedTensor(name, BlockScaledQ8(((hf_name, scale),), e.shape), False)
        if e.dtype not in ("F32", "BF16", "F16"):
            raise InputError(f"{hf_name} has dtype {e.dtype}; expected F32, BF16, F16 or block-scaled FP8")
        src = Direct(hf_name, e.shape)
        if len(e.shape) <= 1 or e.dtype == "F32":
            stored = T.F32
        elif e.dtype == "BF16":
            stored = T.BF16
        else:
            stored = None  # F16 matrices take the output's float type, as llama.cpp's converter gives them
        return PlannedTensor(name, src, stored == T.F32, stored_type=stored)

    def _scale_of(self, ck, official: str, by_official: dict[str, str]) -> str | None:
        weight = by_official[official]
        scale_official = official.removesuffix(".weight") + ".scale"
        scale = by_official.get(scale_official)
        if ck.entry(weight).dtype not in ("F8_E4M3", "F8_E5M2"):
            return None
        if scale is None:
            raise InputError(f"{weight} is {ck.entry(weight).dtype} but the checkpoint has no {scale_official}")
        if ck.entry(scale).dtype not in fp8.SCALE_DTYPES:
            raise InputError(f"{scale} has dtype {ck.entry(scale).dtype}; a block scale is "
                             f"{' or '.join(fp8.SCALE_DTYPES)}")
        fp8.check_block_scale(weight, ck.entry(weight).shape, ck.entry(scale).shape)
        return scale

    def _experts(self, ck, bid: int, proj: str, per: dict[int, dict[str, str]]) -> PlannedTensor:
        n_exp = self.n_expert
        missing = sorted(set(range(n_exp)) - set(per))
        if missing:
            raise InputError(f"layer {bid} {proj}: missing expert(s) {missing[:5]} of {n_exp}")
        parts = []
        shape2 = None
        for eid in range(n_exp):
            pair = per[eid]
            if "weight" not in pair or "scale" not in pair:
                raise InputError(f"layers.{bid}.ffn.experts.{eid}.{proj}: needs both .weight and .scale "
                                 "(MXFP4 codes and exponents)")
            w, s = ck.entry(pair["weight"]), ck.entry(pair["scale"])
            if w.dtype not in ("I8", "U8") or s.dtype not in ("F8_E8M0", "U8"):
                raise InputError(f"{pair['weight']} ({w.dtype}, scale {s.dtype}): routed experts must be "
                                 "MXFP4-packed (I8/U8 codes with F8_E8M0 exponents)")
            shape = mxfp4.check_packed(pair["weight"], w.shape, s.shape)
            if shape2 is not None and shape != shape2:
                raise InputError(f"{pair['weight']}: shape differs from expert 0")
            shape2 = shape
            parts.append((pair["weight"], pair["scale"]))
        self._check_shape(f"layers.{bid}.ffn.experts.0.{proj}.weight", parts[0][0], shape2)
        name = _EXPERT_PROJ[proj].format(bid=bid)
        return PlannedTensor(name, StackedMxfp4(tuple(parts), (n_exp, *shape2)), False)

    # ---- shapes the config implies (numpy order)
    def _expected(self, rest: str, bid: int | None) -> tuple[int, ...] | None:
        c = self.cfg
        d, heads, hd = self.hidden_size, self.n_head, self.head_dim
        ql, groups, ol = (require(c, k, kind=int) for k in ("q_lora_rank", "o_groups", "o_lora_rank"))
        hc = HC_STREAMS
        mix = (2 + hc) * hc
        ff_exp = require(c, "moe_intermediate_size", kind=int)
        ff = ff_exp * require(c, "n_shared_experts", kind=int)
        ih, idim = require(c, "index_n_heads", kind=int), require(c, "index_head_dim", kind=int)
        ratio = self.ratios[bid] if bid is not None else 0
        coff = 2 if ratio == 4 else 1
        table = {
            "embed.weight": (None, d), "head.weight": (None, d), "norm.weight": (d,),
            "hc_head_fn": (hc, hc * d), "hc_head_base": (hc,), "hc_head_scale": (1,),
            "attn.attn_sink": (heads,), "attn.wq_a.weight": (ql, d), "attn.q_norm.weight": (ql,),
            "attn.wq_b.weight": (heads * hd, ql), "attn.wkv.weight": (hd, d), "attn.kv_norm.weight": (hd,),
            "attn.wo_a.weight": (groups * ol, heads * hd // groups), "attn.wo_b.weight": (d, groups * ol),
            "attn.compressor.ape": (ratio, coff * hd), "attn.compressor.wkv.weight": (coff * hd, d),
            "attn.compressor.wgate.weight": (coff * hd, d), "attn.compressor.norm.weight": (hd,),
            "attn.indexer.wq_b.weight": (ih * idim, ql), "attn.indexer.weights_proj.weight": (ih, d),
            "attn.indexer.compressor.ape": (ratio, 2 * idim), "attn.indexer.compressor.wkv.weight": (2 * idim, d),
            "attn.indexer.compressor.wgate.weight": (2 * idim, d), "attn.indexer.compressor.norm.weight": (idim,),
            "attn_norm.weight": (d,), "ffn_norm.weight": (d,), "ffn.gate.weight": (self.n_expert, d),
            "ffn.gate.bias": (self.n_expert,), "ffn.shared_experts.w1.weight": (ff, d),
            "ffn.shared_experts.w2.weight": (d, ff), "ffn.shared_experts.w3.weight": (ff, d),
            "ffn.experts.0.w1.weight": (ff_exp, d), "ffn.experts.0.w2.weight": (d, ff_exp),
            "ffn.experts.0.w3.weight": (ff_exp, d),
            "hc_attn_fn": (mix, hc * d), "hc_attn_base": (mix,), "hc_attn_scale": (3,),
            "hc_ffn_fn": (mix, hc * d), "hc_ffn_base": (mix,), "hc_ffn_scale": (3,),
            "nextn.enorm.weight": (d,), "nextn.hnorm.weight": (d,), "nextn.shared_head_norm.weight": (d,),
            "nextn.e_proj.weight": (d, d), "nextn.h_proj.weight": (d, d),
        }
        if rest.startswith("attn.compressor.") and ratio == 0 or rest.startswith("attn.indexer.") and ratio != 4:
            raise InputError(f"layer {bid} has compress ratio {ratio} but the checkpoint has its {rest}")
        return table.get(rest)

    def _check_shape(self, official: str, hf_name: str, shape) -> None:
        m = _LAYER.match(official)
        bid, rest = (int(m[1]), m[2]) if m else (None, official)
        want = self._expected(rest, bid)
        if want is None:
            self.gguf_name(official)  # unknown tensors fail here with one line
            return
        if len(want) != len(shape) or any(w is not None and w != s for w, s in zip(want, shape)):
            shown = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
            raise InputError(f"{hf_name} has shape {list(shape)} but config.json implies {shown}")

    # ---- metadata
    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        a, c, n = self.arch_name, self.cfg, self.block_count
        md.remove(Keys.LLM.FEED_FORWARD_LENGTH.format(arch=a))
        rope = self.rope_parameters()
        if (rope.get("rope_type") or rope.get("type")) == "yarn" and rope.get("factor") is not None:
            for key, name in ((Keys.Rope.SCALING_YARN_EXT_FACTOR, "extrapolation_factor"),
                              (Keys.Rope.SCALING_YARN_ATTN_FACTOR, "attention_factor"),
                              (Keys.Rope.SCALING_YARN_BETA_FAST, "beta_fast"),
                              (Keys.Rope.SCALING_YARN_BETA_SLOW, "beta_slow")):
                value = rope.get(name, rope.get("attn_factor")) if name == "attention_factor" else rope.get(name)
                if value is not None:
                    md.f32(key.format(arch=a), value)
        md.u32(Keys.LLM.EXPERT_GATING_FUNC.format(arch=a), DeepSeek4Keys.GATING_SQRT_SOFTPLUS)
        md.u32(Keys.Rope.DIMENSION_COUNT.format(arch=a), require(c, "qk_rope_head_dim", kind=int))
        md.u32(Keys.Attention.Q_LORA_RANK.format(arch=a), require(c, "q_lora_rank", kind=int))
        md.u32(Keys.Attention.SLIDING_WINDOW.format(arch=a), require(c, "sliding_window", kind=int))
        md.u32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), require(c, "moe_intermediate_size", kind=int))
        md.u32(Keys.LLM.EXPERT_SHARED_COUNT.format(arch=a), require(c, "n_shared_experts", kind=int))
        md.f32(Keys.LLM.EXPERT_WEIGHTS_SCALE.format(arch=a), require(c, "routed_scaling_factor"))
        md.boolean(Keys.LLM.EXPERT_WEIGHTS_NORM.format(arch=a), bool(c.get("norm_topk_prob", True)))
        clamp = float(require(c, "swiglu_limit"))
        md.array(Keys.LLM.SWIGLU_CLAMP_EXP.format(arch=a), [clamp] * n, gguf.GGUFValueType.FLOAT32)
        md.array(Keys.LLM.SWIGLU_CLAMP_SHEXP.format(arch=a), [clamp] * n, gguf.GGUFValueType.FLOAT32)
        md.u32(Keys.Attention.Indexer.HEAD_COUNT.format(arch=a), require(c, "index_n_heads", kind=int))
        md.u32(Keys.Attention.Indexer.KEY_LENGTH.format(arch=a), require(c, "index_head_dim", kind=int))
        md.u32(Keys.Attention.Indexer.TOP_K.format(arch=a), require(c, "index_topk", kind=int))
        md.u32(ExtraKeys.OUTPUT_GROUP_COUNT.format(arch=a), require(c, "o_groups", kind=int))
        md.u32(ExtraKeys.OUTPUT_LORA_RANK.format(arch=a), require(c, "o_lora_rank", kind=int))
        md.array(ExtraKeys.COMPRESS_RATIOS.format(arch=a), self.ratios, gguf.GGUFValueType.INT32)
        md.f32(ExtraKeys.COMPRESS_ROPE_FREQ_BASE.format(arch=a), require(c, "compress_rope_theta"))
        md.u32(ExtraKeys.HYPER_CONNECTION_COUNT.format(arch=a), require(c, "hc_mult", kind=int))
        md.u32(ExtraKeys.HYPER_CONNECTION_SINKHORN_ITERATIONS.format(arch=a),
               require(c, "hc_sinkhorn_iters", kind=int))
        md.f32(ExtraKeys.HYPER_CONNECTION_EPSILON.format(arch=a), require(c, "hc_eps"))
        md.u32(ExtraKeys.HASH_LAYER_COUNT.format(arch=a), self.n_hash)
        md.u32(Keys.LLM.EMBEDDING_LENGTH_OUT.format(arch=a), self.hidden_size * HC_STREAMS)
        if self.mtp == "only":
            md.u32(Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=a), self.n_nextn)

    def tokenizer_overrides(self, md: Metadata) -> None:
        """Without a template of its own the file gets llama.cpp's DeepSeek-V4 one, as its converter embeds it."""
        if Keys.Tokenizer.CHAT_TEMPLATE in md.entries:
            return
        if (text := default_template(self.src)) is not None:
            md.string(Keys.Tokenizer.CHAT_TEMPLATE, text)


def default_template(src: Path) -> str | None:
    """llama.cpp's template for the checkpoint: ``…-Flash-0731.jinja`` when the folder name says 0731."""
    from hf2q.text.official_templates import official_template

    name = "deepseek-ai-DeepSeek-V4-Flash-0731" if "0731" in Path(src).name else "deepseek-ai-DeepSeek-V4"
    try:
        return official_template(name)
    except Exception as e:  # noqa: BLE001 — no network or no sdist: the file is still usable without a template
        log.warning("deepseek4: no chat template in the checkpoint and llama.cpp's %s is unavailable (%s); "
                    "the GGUF has none", name, e)
        return None

