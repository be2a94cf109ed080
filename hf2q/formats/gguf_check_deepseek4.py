"""The servability check of a DeepSeek-V4 (``deepseek4``) GGUF: its hyper-parameters and tensor table.

DeepSeek-V4 shares little with the decoder table of ``formats.gguf_check`` (no ``attn_q``/``attn_k``,
per-layer attention kinds, hyper-connection tensors, hash routing tables, MXFP4 experts), so it has a
table of its own, built from the same metadata the engine's ``models/deepseek4.py`` reads: every
tensor the engine loads must be present with the shape and type the hyper-parameters imply, and no
other tensor of a main block may be present. Blocks past ``block_count`` (the MTP head) are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile
from hf2q.formats.gguf_keys import ExtraKeys, Keys

#: compress ratios llama.cpp's deepseek4 graph (and ours) has: sliding window only, compressed sparse (with
#: the lightning indexer and overlapping windows), heavily compressed — the one list the converter, this
#: check and the engine read
RATIOS = (0, 4, 128)


def bad_ratios(ratios) -> list:
    """The entries of ``ratios`` no deepseek4 graph has a path for (empty when all are fine)."""
    return sorted({r for r in ratios if r not in RATIOS})


def ratios_problem(ratios, n_layers: int) -> str | None:
    """Why ``ratios`` (a GGUF's ``compress_ratios``) cannot drive ``n_layers`` layers, or None."""
    if not isinstance(ratios, list) or len(ratios) < n_layers or bad_ratios(ratios[:n_layers]):
        return f"needs one ratio in {RATIOS} per layer ({n_layers}), found {ratios}"
    return None

_A, _L = Keys.Attention, Keys.LLM

#: types the engine reads a matrix in (dequantized at load where no kernel takes them)
MATRIX_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
                          T.Q5_K, T.Q6_K, T.MXFP4})
VECTOR_TYPES = frozenset({T.F32, T.F16, T.BF16})
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _ints(g: GGUFFile, fail: Callable[[str], InputError]) -> dict[str, int]:
    hp = g.hparams
    out = {}
    for name, template in (("layers", _L.BLOCK_COUNT), ("hidden", _L.EMBEDDING_LENGTH), ("heads", _A.HEAD_COUNT),
                           ("head_dim", _A.KEY_LENGTH), ("q_lora", _A.Q_LORA_RANK),
                           ("ff", _L.EXPERT_FEED_FORWARD_LENGTH),
                           ("experts", _L.EXPERT_COUNT), ("used", _L.EXPERT_USED_COUNT),
                           ("groups", ExtraKeys.OUTPUT_GROUP_COUNT), ("o_lora", ExtraKeys.OUTPUT_LORA_RANK),
                           ("index_heads", _A.Indexer.HEAD_COUNT), ("index_dim", _A.Indexer.KEY_LENGTH),
                           ("top_k", _A.Indexer.TOP_K), ("window", _A.SLIDING_WINDOW),
                           ("hc", ExtraKeys.HYPER_CONNECTION_COUNT)):
        v = hp.stored(template)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20:
            raise fail(f"{hp.key(template)} must be a positive integer, found {v!r}")
        out[name] = v
    out["hash"] = int(hp.stored(ExtraKeys.HASH_LAYER_COUNT) or 0)
    out["shared_ff"] = out["ff"] * int(hp.stored(_L.EXPERT_SHARED_COUNT) or 1)
    rope = hp.stored(Keys.Rope.DIMENSION_COUNT)
    if not isinstance(rope, int) or rope % 2 or not 2 <= rope <= min(out["head_dim"], out["index_dim"]):
        raise fail(f"{hp.key(Keys.Rope.DIMENSION_COUNT)} must be even and at most the head sizes, found {rope!r}")
    if out["used"] > out["experts"]:
        raise fail(f"{hp.key(_L.EXPERT_USED_COUNT)} {out['used']} is more than {hp.key(_L.EXPERT_COUNT)} "
                   f"{out['experts']}")
    if (out["heads"] * out["head_dim"]) % out["groups"]:
        raise fail(f"{out['heads']} heads of {out['head_dim']} do not split into "
                   f"{hp.key(ExtraKeys.OUTPUT_GROUP_COUNT)} {out['groups']} groups")
    gating = hp.stored(_L.EXPERT_GATING_FUNC)
    if gating not in (None, 4):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRTSOFTPLUS
        raise fail(f"{hp.key(_L.EXPERT_GATING_FUNC)} {gating!r} is not supported (only sqrt-softplus, 4)")
    return out


def table(g: GGUFFile, d: dict[str, int], ratios: list[int]) -> dict[str, tuple[tuple[int, ...], frozenset]]:
    """Tensor name → (numpy shape, allowed types)."""
    h, H, D, n = d["hidden"], d["heads"], d["head_dim"], d["hc"]
    I, Hi, E, ff, sff = d["index_dim"], d["index_heads"], d["experts"], d["ff"], d["shared_ff"]
    vocab = g.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in g.tensors else 0
    mat, vec = MATRIX_TYPES, VECTOR_TYPES
    t = {"token_embd.weight": ((vocab, h), mat), "output_norm.weight": ((h,), vec), "output.weight": ((vocab, h), mat),
         "output_hc_fn.weight": ((n, n * h), vec | mat), "output_hc_base.weight": ((n,), vec),
         "output_hc_scale.weight": ((1,), vec)}
    for i, ratio in enumerate(ratios):
        p = f"blk.{i}."
        for site in ("attn", "ffn"):
            t[p + f"hc_{site}_fn.weight"] = (((2 + n) * n, n * h), vec | mat)
            t[p + f"hc_{site}_base.weight"] = (((2 + n) * n,), vec)
            t[p + f"hc_{site}_scale.weight"] = ((3,), vec)
        t.update({p + "attn_norm.weight": ((h,), vec), p + "ffn_norm.weight": ((h,), vec),
                  p + "attn_q_a.weight": ((d["q_lora"], h), mat), p + "attn_q_a_norm.weight": ((d["q_lora"],), vec),
                  p + "attn_q_b.weight": ((H * D, d["q_lora"]), mat), p + "attn_kv.weight": ((D, h), mat),
                  p + "attn_kv_a_norm.weight": ((D,), vec), p + "attn_sinks.weight": ((H,), vec),
                  p + "attn_output_a.weight": ((d["groups"] * d["o_lora"], H * D // d["groups"]), mat),
                  p + "attn_output_b.weight": ((h, d["groups"] * d["o_lora"]), mat),
                  p + "ffn_gate_inp.weight": ((E, h), mat),
                  p + "ffn_gate_exps.weight": ((E, ff, h), mat), p + "ffn_up_exps.weight": ((E, ff, h), mat),
                  p + "ffn_down_exps.weight": ((E, h, ff), mat),
                  p + "ffn_gate_shexp.weight": ((sff, h), mat), p + "ffn_up_shexp.weight": ((sff, h), mat),
                  p + "ffn_down_shexp.weight": ((h, sff), mat)})
        if i < d["hash"]:
            t[p + "ffn_gate_tid2eid.weight"] = ((vocab, d["used"]), frozenset({T.I32}))
        else:
            t[p + "exp_probs_b.bias"] = ((E,), vec)
        if ratio:
            w = 2 * D if ratio == 4 else D
            t.update({p + "attn_compressor_kv.weight": ((w, h), mat), p + "attn_compressor_gate.weight": ((w, h), mat),
                      p + "attn_compressor_ape.weight": ((ratio, w), vec),
                      p + "attn_compressor_norm.weight": ((D,), vec)})
        if ratio == 4:
            t.update({p + "indexer_compressor_kv.weight": ((2 * I, h), mat),
                      p + "indexer_compressor_gate.weight": ((2 * I, h), mat),
                      p + "indexer_compressor_ape.weight": ((ratio, 2 * I), vec),
                      p + "indexer_compressor_norm.weight": ((I,), vec),
                      p + "indexer.attn_q_b.weight": ((Hi * I, d["q_lora"]), mat),
                      p + "indexer.proj.weight": ((Hi, h), mat)})
    return t


def check_deepseek4(g: GGUFFile, fail: Callable[[str], InputError], vocab: int | None) -> None:
    """Raise ``fail(reason)`` for the first defect that keeps the engine from running ``g``."""
    d = _ints(g, fail)
    hp = g.hparams
    ratios = hp.stored(ExtraKeys.COMPRESS_RATIOS)
    if problem := ratios_problem(ratios, d["layers"]):
        raise fail(f"{hp.key(ExtraKeys.COMPRESS_RATIOS)} {problem}")
    ratios = [int(r) for r in ratios[:d["layers"]]]
    expected = table(g, d, ratios)
    for name, (shape, types) in expected.items():
        t = g.tensors.get(name)
        if t is None:
            if name == "output.weight":
                continue  # tied to the embedding
            raise fail(f"missing tensor {name!r} (expected shape {list(shape)})")
        if tuple(t.shape) != shape:
            raise fail(f"tensor {name} has shape {list(t.shape)}, expected {list(shape)} from the metadata")
        if t.qtype not in types:
            raise fail(f"tensor {name} has type {t.qtype.name}, expected one of "
                       f"{', '.join(sorted(x.name for x in types))}")
        if len(shape) == 1 and t.qtype in VECTOR_TYPES:
            raw = np.asarray(t.data)
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if t.qtype == T.BF16 else raw
            if not np.all(np.isfinite(values)):
                raise fail(f"tensor {name} holds NaN or infinite values")
    for i in range(min(d["hash"], d["layers"])):  # a hash table entry indexes the layer's experts
        name = f"blk.{i}.ffn_gate_tid2eid.weight"
        ids = np.asarray(g.tensors[name].data)
        if ids.size and (ids.min() < 0 or ids.max() >= d["experts"]):
            raise fail(f"tensor {name} routes to expert {int(ids.max() if ids.max() >= d['experts'] else ids.min())}"
                       f" (the layer has {d['experts']})")
    for name in g.tensors:
        m = _BLOCK.fullmatch(name)
        if name not in expected and not (m and int(m.group(1)) >= d["layers"]):
            raise fail(f"unexpected tensor {name!r} for deepseek4 (the engine would ignore it)")
    if vocab is not None and vocab != g.tensors["token_embd.weight"].shape[0]:
        raise fail(f"the vocabulary has {vocab} tokens but token_embd.weight has "
                   f"{g.tensors['token_embd.weight'].shape[0]} rows (they must be equal)")
