"""Whether the engine can serve a GGUF: the one check ``hf2q info``, ``serve``, ``generate`` and every
model build run before a single weight reaches a kernel.

The C kernels trust their dimensions: a ``blk.0.attn_k.weight`` with twice the rows the head
counts imply makes the host decode step write past its buffers. So nothing is inferred from a
tensor's own shape. The hyper-parameters are read first, each a number of the right kind in a sane
range; from them every tensor the family's graph reads gets its exact GGUF dims (ggml order, the
converter's layout, as llama.cpp's ``create_tensor`` declares them), a type the loader repacks, and
a name the family knows. Blocks must be exactly ``0 .. block_count − 1`` (a hybrid model's MTP
blocks after them are allowed and ignored), the vocabulary must be the embedding's rows, and small
vectors (norms, biases, the recurrent decay) must be finite. :func:`open_gguf` has already
checked the container itself: byte ranges, alignment, overlaps, counts.

Each defect is one :class:`~hf2q.errors.InputError` naming the file, the key or tensor, and what
was expected against what was found (exit 3); :func:`problem` returns the same line without raising.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile, open_gguf
from hf2q.formats.gguf_hparams import DEFAULTS, ENCODER_ARCHS, RECURRENT_ARCHS, moe_block
from hf2q.formats.gguf_keys import ExtraKeys, Keys

_A, _L, _R, _S, _TK = Keys.Attention, Keys.LLM, Keys.Rope, Keys.SSM, Keys.Tokenizer

#: tensor types the loader repacks into MLX (``engine.quant_repack``)
SUPPORTED_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
                             T.Q5_K, T.Q6_K})
#: types of the 1-D tensors (norms, biases): llama.cpp's quantizer never quantizes a vector
VECTOR_TYPES = frozenset({T.F32, T.F16, T.BF16})
#: tokenizer models the text layer builds
TOKENIZER_MODELS = ("gpt2", "llama", "bert", "gemma4", "t5")

# sane upper bounds: far above any released model, far below what overflows a C int index
MAX_DIM = 1 << 20
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12
MAX_CONTEXT = 1 << 26
MAX_EXPERTS = 1 << 12
_KNOWN_SCALING = (None, "none", "linear", "yarn")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
#: stored ``[n_embd, 1]`` by the converter and ``[n_embd]`` by llama-quantize; the engine takes both
_SQUEEZABLE = "ffn_gate_inp_shexp.weight"


def check_servable(g: GGUFFile) -> None:
    """Raise the first defect that keeps the engine from serving ``g`` as an ``InputError``."""
    _Checker(g).run(tokenizer=True)


def check_weights(g: GGUFFile) -> None:
    """The engine's part of :func:`check_servable`: hyper-parameters and tensors, the tokenizer only
    where the file has one (an engine-only copy may leave the vocabulary out; the embedding's rows
    then stand for it). What every model build runs."""
    _Checker(g).run(tokenizer=False)


def open_servable(path) -> GGUFFile:
    """``open_gguf(path)`` that also passed :func:`check_servable`: what serve, generate and the
    engine's loader open a model with."""
    g = open_gguf(path)
    check_servable(g)
    return g


def unserved(arch: str | None) -> str:
    """Why an architecture the engine lacks is refused: convertible-but-not-servable says so plainly."""
    from hf2q.arch.registry import FAMILIES as CONVERT_FAMILIES

    if arch and arch in {f.architecture() for f in CONVERT_FAMILIES}:
        return f"architecture {arch!r}: hf2q converts it but cannot serve it yet (no {arch} engine)"
    return f"unsupported architecture {arch or '(none)'!r}"


def problem(g: GGUFFile) -> str | None:
    """The same check, as the one-line reason without the file name, or None when servable."""
    try:
        check_servable(g)
    except InputError as e:
        return str(e).split(": ", 1)[-1]
    return None


class _Checker:
    def __init__(self, g: GGUFFile):
        self.g = g
        self.hp = g.hparams
        self.arch = g.arch

    def fail(self, what: str) -> InputError:
        return InputError(f"{self.g.path.name}: {what}")

    # ---- hyper-parameters ------------------------------------------------------------

    def _raw(self, template: str) -> tuple[str, Any]:
        key = self.hp.key(template)
        return key, self.g.metadata.get(key)

    def int_key(self, template: str, lo: int = 1, hi: int = MAX_DIM, *, required: bool = False,
                default: int | None = None) -> int:
        """An integer hyper-parameter within ``[lo, hi]`` (stored, else ``default`` / the table's)."""
        key, v = self._raw(template)
        if v is None:
            if required:
                raise self.fail(f"missing GGUF metadata key {key!r}")
            if default is None:
                d = DEFAULTS.get(template)
                default = d(self.hp) if callable(d) else d
            if default is None:
                raise self.fail(f"missing GGUF metadata key {key!r}")
            v = default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(f"{key} must be an integer, found {_show(v)}")
        if not lo <= v <= hi:
            raise self.fail(f"{key} must be in {lo}..{hi}, found {v}")
        return v

    def float_key(self, template: str, lo: float = 0.0, *, strict: bool = True) -> float | None:
        """A real hyper-parameter, finite and above ``lo`` (``strict``) or at least ``lo``; None when absent."""
        key, v = self._raw(template)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(f"{key} must be a finite number, found {_show(v)}")
        if v < lo or (strict and v == lo):
            raise self.fail(f"{key} must be {'>' if strict else '>='} {lo:g}, found {v:g}")
        return float(v)

    def hparams(self) -> dict[str, Any]:
        """Every shape-giving hyper-parameter, checked; the dims the tensor table is built from."""
        d: dict[str, Any] = {}
        d["n_layer"] = self.int_key(_L.BLOCK_COUNT, hi=MAX_LAYERS, required=True)
        d["hidden"] = self.int_key(_L.EMBEDDING_LENGTH, required=True)
        for name, template in (("n_head", _A.HEAD_COUNT), ("n_kv", _A.HEAD_COUNT_KV)):
            key, v = self._raw(template)
            if isinstance(v, list) and not (name == "n_kv" and self.arch == "gemma4"):
                raise self.fail(f"{key}: per-layer head counts are not supported")
        d["n_head"] = self.int_key(_A.HEAD_COUNT, hi=MAX_HEADS, required=True)
        if self.arch == "gemma4":
            self.gemma4(d)
        d["n_kv"] = self.int_key(_A.HEAD_COUNT_KV, hi=MAX_HEADS, default=d["n_head"]) \
            if self.arch != "gemma4" else max(d["n_kv_layer"])
        if d["n_head"] % d["n_kv"]:
            raise self.fail(f"{self.hp.key(_A.HEAD_COUNT)} {d['n_head']} is not a multiple of "
                            f"{self.hp.key(_A.HEAD_COUNT_KV)} {d['n_kv']}")
        own_head = self._raw(_A.KEY_LENGTH)[1] is not None and self._raw(_A.VALUE_LENGTH)[1] is not None
        if not own_head and d["hidden"] % d["n_head"]:
            raise self.fail(f"{self.hp.key(_L.EMBEDDING_LENGTH)} {d['hidden']} is not a multiple of "
                            f"{self.hp.key(_A.HEAD_COUNT)} {d['n_head']} (and no key_length/value_length)")
        default_head = d["hidden"] // d["n_head"]
        d["head_k"] = self.int_key(_A.KEY_LENGTH, default=default_head)
        d["head_v"] = self.int_key(_A.VALUE_LENGTH, default=default_head)
        d["n_ctx"] = self.int_key(_L.CONTEXT_LENGTH, hi=MAX_CONTEXT)
        if self.arch in ENCODER_ARCHS:
            self.float_key(_A.LAYERNORM_EPS)
            pooling = self.int_key(_L.POOLING_TYPE, lo=0, hi=16)
            if pooling not in (1, 2):
                raise self.fail(f"{self.hp.key(_L.POOLING_TYPE)} {pooling} is not supported (1 mean, 2 CLS)")
            if d["head_k"] * d["n_head"] != d["hidden"]:
                raise self.fail(f"BERT needs heads × head size = {self.hp.key(_L.EMBEDDING_LENGTH)} "
                                f"({d['n_head']} × {d['head_k']} ≠ {d['hidden']})")
            if self.arch in ("nomic-bert", "nomic-bert-moe"):
                self.rope(d)
            if self.arch == "nomic-bert-moe":
                d["n_expert"] = self.int_key(_L.EXPERT_COUNT, lo=1, hi=MAX_EXPERTS, required=True)
                d["n_used"] = self.int_key(_L.EXPERT_USED_COUNT, lo=1, hi=d["n_expert"], required=True)
                d["moe_every"] = self.int_key(_L.MOE_EVERY_N_LAYERS, lo=0, hi=d["n_layer"], default=0)
        else:
            self.float_key(_A.LAYERNORM_RMS_EPS)
            self.rope(d)
        if self.arch not in ("qwen3moe", "qwen3vlmoe", "qwen35moe", "gemma4"):
            key, v = self._raw(_L.FEED_FORWARD_LENGTH)
            if isinstance(v, list):
                raise self.fail(f"{key}: per-layer feed-forward sizes are not supported")
            d["n_ff"] = self.int_key(_L.FEED_FORWARD_LENGTH, required=True)
        if self.arch in ("qwen3moe", "qwen3vlmoe", "qwen35moe"):
            d["n_expert"] = self.int_key(_L.EXPERT_COUNT, hi=MAX_EXPERTS, required=True)
            d["n_used"] = self.int_key(_L.EXPERT_USED_COUNT, hi=d["n_expert"], required=True)
            d["n_ff_exp"] = self.int_key(_L.EXPERT_FEED_FORWARD_LENGTH, required=True)
            if self.arch == "qwen35moe":
                d["n_ff_shexp"] = self.int_key(_L.EXPERT_SHARED_FEED_FORWARD_LENGTH, required=True)
        d["n_main"] = d["n_layer"]
        if self.arch in RECURRENT_ARCHS:
            self.recurrent(d)
        return d

    def rope(self, d: dict[str, Any]) -> None:
        rope_dims = self.int_key(_R.DIMENSION_COUNT, lo=2, hi=d["head_k"], default=d["head_k"])
        if rope_dims % 2:
            raise self.fail(f"{self.hp.key(_R.DIMENSION_COUNT)} must be even, found {rope_dims}")
        for template in (_R.FREQ_BASE, _R.FREQ_BASE_SWA, _R.SCALING_ATTN_FACTOR, _R.SCALING_YARN_BETA_FAST,
                         _R.SCALING_YARN_BETA_SLOW):
            self.float_key(template)
        for template in (_R.SCALING_FACTOR, _R.SCALING_YARN_EXT_FACTOR, _R.SCALING_YARN_LOG_MUL):
            self.float_key(template, strict=False)
        key, scaling = self._raw(_R.SCALING_TYPE)
        if scaling not in _KNOWN_SCALING:
            raise self.fail(f"{key}: rope scaling {scaling!r} is not supported (supported: linear, yarn, "
                            "Llama 3 rope_freqs)")
        if self._raw(_R.SCALING_ORIG_CTX_LEN)[1] is not None:
            self.int_key(_R.SCALING_ORIG_CTX_LEN, hi=MAX_CONTEXT)
        if scaling == "yarn" and (self.float_key(_R.SCALING_FACTOR, strict=False) or 1.0) > 1.0:
            self.yarn(rope_dims, d["head_k"])
        if self._raw(_A.SLIDING_WINDOW)[1] is not None:
            self.int_key(_A.SLIDING_WINDOW, lo=0, hi=MAX_CONTEXT)
        d["rope_dims"] = rope_dims

    def gemma4(self, d: dict[str, Any]) -> None:
        """Gemma 4's two layer kinds: per-layer KV heads, the sliding flags, the sliding layers' own head
        size and rotary dims (``engine.models.gemma4``); the shapes the engine does not run yet refused."""
        n = d["n_layer"]
        key, kv = self._raw(_A.HEAD_COUNT_KV)
        kv = kv if isinstance(kv, list) else [self.int_key(_A.HEAD_COUNT_KV, hi=MAX_HEADS, required=True)] * n
        if len(kv) != n or any(isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= MAX_HEADS
                                or d["n_head"] % h for h in kv):
            raise self.fail(f"{key} needs one KV head count per layer ({n}), each dividing "
                            f"{self.hp.key(_A.HEAD_COUNT)} {d['n_head']}; found {_show(kv)}")
        d["n_kv_layer"] = kv
        key, flags = self._raw(_A.SLIDING_WINDOW_PATTERN)
        if not isinstance(flags, list) or len(flags) != n or not all(isinstance(f, bool) for f in flags):
            raise self.fail(f"{key} needs one sliding flag per layer ({n}), found {_show(flags)}")
        d["swa"] = flags
        d["head_swa"] = self.int_key(_A.KEY_LENGTH_SWA, required=True)
        if self.int_key(_A.VALUE_LENGTH_SWA, required=True) != d["head_swa"]:
            raise self.fail(f"{self.hp.key(_A.VALUE_LENGTH_SWA)} must equal {self.hp.key(_A.KEY_LENGTH_SWA)}")
        rot = self.int_key(_R.DIMENSION_COUNT_SWA, lo=2, hi=d["head_swa"], default=d["head_swa"])
        if rot % 2:
            raise self.fail(f"{self.hp.key(_R.DIMENSION_COUNT_SWA)} must be even, found {rot}")
        key, ff = self._raw(_L.FEED_FORWARD_LENGTH)
        ff = ff if isinstance(ff, list) else [self.int_key(_L.FEED_FORWARD_LENGTH, required=True)] * n
        if len(ff) != n or any(isinstance(f, bool) or not isinstance(f, int) or not 1 <= f <= MAX_DIM for f in ff):
            raise self.fail(f"{key} needs one feed-forward size per layer ({n}), found {_show(ff)}")
        d["n_ff_layer"] = ff
        shared = self.int_key(_A.SHARED_KV_LAYERS, lo=0, hi=n - 1, default=0)
        d["kv_source"] = list(range(n - shared))
        for i in range(n - shared, n):  # a KV-shared layer reads the last earlier layer of its kind
            source = [j for j in range(n - shared) if flags[j] == flags[i]]
            if not source:
                raise self.fail(f"KV-shared layer {i} has no earlier layer of its kind to read K/V from")
            d["kv_source"].append(source[-1])
        d["ple"] = self.int_key(_L.EMBD_LENGTH_PER_LAYER_INP, lo=0, hi=MAX_DIM, default=0)
        d["n_expert"] = self.int_key(_L.EXPERT_COUNT, lo=0, hi=MAX_EXPERTS, default=0)
        if d["n_expert"]:  # 26B-A4B: routed experts beside the dense MLP
            d["n_used"] = self.int_key(_L.EXPERT_USED_COUNT, hi=d["n_expert"], required=True)
            d["n_ff_exp"] = self.int_key(_L.EXPERT_FEED_FORWARD_LENGTH, required=True)

    def yarn(self, rope_dims: int, head_k: int) -> None:
        """The YaRN variants the engine implements (``engine.models.llama``): llama.cpp's ramp with
        ext_factor 1, no DeepSeek mscale, full rotary dims, an original context to ramp over."""
        hp = self.hp
        if hp.yarn_ext_factor != 1.0:
            raise self.fail(f"YaRN with {hp.key(_R.SCALING_YARN_EXT_FACTOR)} {hp.yarn_ext_factor:g} is not "
                            "supported (only 1)")
        if hp.yarn_log_multiplier != 0.0:
            raise self.fail(f"YaRN with {hp.key(_R.SCALING_YARN_LOG_MUL)} (DeepSeek-style mscale) is not supported")
        if not hp.rope_original_context:
            raise self.fail(f"YaRN rope scaling needs {hp.key(_R.SCALING_ORIG_CTX_LEN)}")
        if rope_dims != head_k or self.arch == "gemma3":
            raise self.fail(f"YaRN rope scaling on {self.arch} with {rope_dims} of {head_k} rotary dims "
                            "is not supported")

    def recurrent(self, d: dict[str, Any]) -> None:
        nextn = self.int_key(_L.NEXTN_PREDICT_LAYERS, lo=0, hi=d["n_layer"] - 1, default=0)
        d["n_main"] = d["n_layer"] - nextn
        key, flags = self._raw(ExtraKeys.RECURRENT_LAYERS)
        if flags is not None:
            if not isinstance(flags, list) or len(flags) < d["n_main"]:
                raise self.fail(f"{key} needs one flag per block ({d['n_main']}), found {_show(flags)}")
        else:
            self.int_key(_L.FULL_ATTENTION_INTERVAL, hi=MAX_LAYERS)
        d["recurrent"] = self.hp.recurrent_layers
        d["conv_k"] = self.int_key(_S.CONV_KERNEL, hi=64, required=True)
        d["k_dim"] = self.int_key(_S.STATE_SIZE, required=True)
        d["k_heads"] = self.int_key(_S.GROUP_COUNT, hi=MAX_HEADS, required=True)
        d["v_heads"] = self.int_key(_S.TIME_STEP_RANK, hi=MAX_HEADS, required=True)
        d["inner"] = self.int_key(_S.INNER_SIZE, required=True)
        if d["inner"] % d["v_heads"] or d["v_heads"] % d["k_heads"]:
            raise self.fail(f"linear attention with {d['v_heads']} value heads, {d['k_heads']} key heads and "
                            f"inner size {d['inner']} is not a valid layout")
        d["v_dim"] = d["inner"] // d["v_heads"]

    # ---- tokenizer -------------------------------------------------------------------

    def tokenizer(self) -> int:
        """The vocabulary size, after checking the tokenizer keys the text layer reads."""
        meta = self.g.metadata
        model, tokens = meta.get(_TK.MODEL), meta.get(_TK.LIST)
        if not model or not tokens:
            raise self.fail(f"no tokenizer metadata ({_TK.MODEL} / {_TK.LIST})")
        if not isinstance(model, str) or model not in TOKENIZER_MODELS:
            raise self.fail(f"{_TK.MODEL} {_show(model)} is not supported ({', '.join(TOKENIZER_MODELS)})")
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens[:1]):
            raise self.fail(f"{_TK.LIST} must be an array of strings, found {_show(tokens)}")
        n = len(tokens)
        for key in (_TK.TOKEN_TYPE, _TK.SCORES):
            v = meta.get(key)
            if v is not None and (not isinstance(v, list) or len(v) != n):
                raise self.fail(f"{key} must have one entry per token ({n}), found {_count(v)}")
        if model in ("llama", "t5") and meta.get(_TK.SCORES) is None:
            raise self.fail(f"a SentencePiece vocabulary needs {_TK.SCORES}")
        if model in ("gpt2", "gemma4"):
            merges = meta.get(_TK.MERGES)
            if not isinstance(merges, list):
                raise self.fail(f"a BPE vocabulary needs {_TK.MERGES} (an array of strings), found {_show(merges)}")
        if model == "gpt2":
            from hf2q.text.pretokenizers import rule_for

            pre = meta.get(_TK.PRE)
            if (pre is not None and not isinstance(pre, str)) or rule_for(pre) is None:
                raise self.fail(f"{_TK.PRE} {_show(pre)} is not a known pre-tokenizer")
        for key in (_TK.BOS_ID, _TK.EOS_ID, _TK.UNK_ID, _TK.SEP_ID, _TK.PAD_ID, _TK.EOT_ID, _TK.EOM_ID,
                    ExtraKeys.CLS_ID):
            v = meta.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n):
                raise self.fail(f"{key} must be a token id in 0..{n - 1}, found {_show(v)}")
        return n

    # ---- tensors ---------------------------------------------------------------------

    def run(self, tokenizer: bool) -> None:
        if self.arch == "deepseek4":  # its own hyper-parameters and table (formats.gguf_check_deepseek4)
            from hf2q.formats.gguf_check_deepseek4 import check_deepseek4

            vocab = self.tokenizer() if tokenizer or self.g.metadata.get(_TK.LIST) is not None else None
            return check_deepseek4(self.g, self.fail, vocab)
        if self.arch not in _FAMILY_TABLES:  # the architectures with a checker here
            raise self.fail(unserved(self.arch))
        unsupported = [t for t in self.g.tensors.values() if t.qtype not in SUPPORTED_TYPES]
        if unsupported:
            kinds = ", ".join(sorted({t.qtype.name for t in unsupported}))
            raise self.fail(f"unsupported tensor type(s) {kinds} (first: {unsupported[0].name})")
        embd = self.g.tensors.get("token_embd.weight")
        if tokenizer or self.g.metadata.get(_TK.LIST) is not None or embd is None:
            vocab = self.tokenizer()
        else:
            vocab = embd.shape[0]
        d = self.hparams()
        self.blocks(d)
        d["vocab"] = vocab
        if embd is not None and len(embd.shape) == 2 and embd.shape[0] != d["vocab"]:
            raise self.fail(f"{_TK.LIST} has {d['vocab']} tokens but token_embd.weight has {embd.shape[0]} rows "
                            "(they must be equal)")
        expected = _FAMILY_TABLES[self.arch](d)
        for name, (dims, required) in expected.items():
            t = self.g.tensors.get(name)
            if t is None:
                if required:
                    raise self.fail(f"missing tensor {name!r} (expected dims {_text(dims)})")
                continue
            found = tuple(reversed(t.shape))
            if not _matches(found, dims) and not (name.endswith(_SQUEEZABLE) and found == dims[:1]):
                raise self.fail(f"tensor {name} has dims {_text(found)}, expected {_text(dims)} from the metadata")
            allowed = VECTOR_TYPES if len(dims) == 1 else SUPPORTED_TYPES
            if t.qtype not in allowed:
                raise self.fail(f"tensor {name} has type {t.qtype.name}, expected one of "
                                f"{', '.join(sorted(x.name for x in allowed))}")
            if len(dims) == 1:
                values = _floats(t)
                if not np.all(np.isfinite(values)):
                    raise self.fail(f"tensor {name} holds NaN or infinite values")
                if name == "rope_freqs.weight" and np.any(values <= 0):
                    raise self.fail(f"tensor {name} holds values <= 0 (they divide the RoPE frequencies)")
        for name in self.g.tensors:
            m = _BLOCK.fullmatch(name)
            if name not in expected and not (m and int(m.group(1)) >= d["n_main"]):
                raise self.fail(f"unexpected tensor {name!r} for {self.arch} (the engine would ignore it)")

    def blocks(self, d: dict[str, Any]) -> None:
        present = {int(m.group(1)) for m in map(_BLOCK.fullmatch, self.g.tensors) if m}
        if present and min(present) >= d["n_main"] and d["n_main"] < d["n_layer"]:
            raise self.fail("the file holds only the MTP head (a draft model); the engine serves the main blocks")
        if present != set(range(d["n_layer"])):
            missing = sorted(set(range(d["n_layer"])) - present)
            extra = sorted(present - set(range(d["n_layer"])))
            span = f"blocks {min(present)}..{max(present)}" if present else "no blocks"
            why = f"block {missing[0]} is missing" if missing else f"block {extra[0]} is extra"
            raise self.fail(f"{self.hp.key(_L.BLOCK_COUNT)} is {d['n_layer']} but the file has {span} ({why})")


# ---- the per-family tables: tensor name → (GGUF dims in ggml order, required) ------------

Table = dict[str, tuple[tuple[int | None, ...], bool]]


def _globals(d: dict[str, Any]) -> Table:
    return {"token_embd.weight": ((d["hidden"], d["vocab"]), True), "output_norm.weight": ((d["hidden"],), True),
            "output.weight": ((d["hidden"], d["vocab"]), False)}


def _attention(d: dict[str, Any], p: str, q_mult: int = 1, qk_norm: bool = False) -> Table:
    h, hk, hv = d["hidden"], d["head_k"], d["head_v"]
    t = {p + "attn_q.weight": ((h, d["n_head"] * hk * q_mult), True),
         p + "attn_k.weight": ((h, d["n_kv"] * hk), True),
         p + "attn_v.weight": ((h, d["n_kv"] * hv), True),
         p + "attn_output.weight": ((d["n_head"] * hv, h), True)}
    if qk_norm:
        t[p + "attn_q_norm.weight"] = ((hk,), True)
        t[p + "attn_k_norm.weight"] = ((hk,), True)
    return t


def _dense_ffn(d: dict[str, Any], p: str) -> Table:
    h, ff = d["hidden"], d["n_ff"]
    return {p + "ffn_gate.weight": ((h, ff), True), p + "ffn_up.weight": ((h, ff), True),
            p + "ffn_down.weight": ((ff, h), True)}


def _moe_ffn(d: dict[str, Any], p: str) -> Table:
    h, ff, e = d["hidden"], d["n_ff_exp"], d["n_expert"]
    return {p + "ffn_gate_inp.weight": ((h, e), True), p + "ffn_gate_exps.weight": ((h, ff, e), True),
            p + "ffn_up_exps.weight": ((h, ff, e), True), p + "ffn_down_exps.weight": ((ff, h, e), True)}


def _decoder(d: dict[str, Any], *, qk_norm: bool, moe: bool = False, sandwich: bool = False) -> Table:
    t = _globals(d)
    h = d["hidden"]
    for i in range(d["n_layer"]):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = ((h,), True)
        t[p + "ffn_norm.weight"] = ((h,), True)
        t.update(_attention(d, p, qk_norm=qk_norm))
        t.update(_moe_ffn(d, p) if moe else _dense_ffn(d, p))
        if sandwich:
            t[p + "post_attention_norm.weight"] = ((h,), True)
            t[p + "post_ffw_norm.weight"] = ((h,), True)
    return t


def _llama(d: dict[str, Any]) -> Table:
    t = _decoder(d, qk_norm=False)
    t["rope_freqs.weight"] = ((d["rope_dims"] // 2,), False)
    return t


def _qwen35(d: dict[str, Any], moe: bool = False) -> Table:
    t = _globals(d)
    h = d["hidden"]
    kd, inner, vh = d["k_heads"] * d["k_dim"], d["inner"], d["v_heads"]
    for i in range(d["n_main"]):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = ((h,), True)
        t[p + "post_attention_norm.weight"] = ((h,), True)
        if d["recurrent"][i]:
            t.update({p + "attn_qkv.weight": ((h, 2 * kd + inner), True), p + "attn_gate.weight": ((h, inner), True),
                      p + "ssm_beta.weight": ((h, vh), True), p + "ssm_alpha.weight": ((h, vh), True),
                      p + "ssm_out.weight": ((inner, h), True),
                      p + "ssm_conv1d.weight": ((d["conv_k"], 2 * kd + inner), True),
                      p + "ssm_dt.bias": ((vh,), True), p + "ssm_a": ((vh,), True),
                      p + "ssm_norm.weight": ((d["v_dim"],), True)})
        else:
            t.update(_attention(d, p, q_mult=2, qk_norm=True))
        if moe:
            s = d["n_ff_shexp"]
            t.update(_moe_ffn(d, p))
            t.update({p + "ffn_gate_shexp.weight": ((h, s), True), p + "ffn_up_shexp.weight": ((h, s), True),
                      p + "ffn_down_shexp.weight": ((s, h), True), p + "ffn_gate_inp_shexp.weight": ((h, 1), True)})
        else:
            t.update(_dense_ffn(d, p))
    return t


def _gemma4(d: dict[str, Any]) -> Table:
    """Sliding and global layers of their own head size and KV heads; ``attn_v`` optional (K as V);
    KV-shared layers without K/V; per-layer embeddings (E2B/E4B) when ``ple`` is set; experts beside
    the dense MLP (26B-A4B) when ``n_expert`` is."""
    t = _globals(d)
    h, heads, n, ple = d["hidden"], d["n_head"], d["n_layer"], d["ple"]
    if not all(d["swa"]):
        t["rope_freqs.weight"] = ((d["rope_dims"] // 2,), True)
    if ple:
        t.update({"per_layer_token_embd.weight": ((ple * n, d["vocab"]), True),
                  "per_layer_model_proj.weight": ((h, ple * n), True), "per_layer_proj_norm.weight": ((ple,), True)})
    for i in range(n):
        p = f"blk.{i}."
        hd, kv, ff = (d["head_swa"] if d["swa"][i] else d["head_k"]), d["n_kv_layer"][i], d["n_ff_layer"][i]
        t.update({p + "attn_q.weight": ((h, heads * hd), True), p + "attn_output.weight": ((heads * hd, h), True),
                  p + "attn_q_norm.weight": ((hd,), True), p + "layer_output_scale.weight": ((1,), False),
                  p + "ffn_gate.weight": ((h, ff), True), p + "ffn_up.weight": ((h, ff), True),
                  p + "ffn_down.weight": ((ff, h), True)})
        if d["kv_source"][i] == i:
            t.update({p + "attn_k.weight": ((h, kv * hd), True), p + "attn_v.weight": ((h, kv * hd), False),
                      p + "attn_k_norm.weight": ((hd,), True)})
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            t[p + norm + ".weight"] = ((h,), True)
        if ple:
            t.update({p + "inp_gate.weight": ((h, ple), True), p + "proj.weight": ((ple, h), True),
                      p + "post_norm.weight": ((h,), True)})
        if d["n_expert"]:
            e, fe = d["n_expert"], d["n_ff_exp"]
            t.update({p + "ffn_gate_inp.weight": ((h, e), True), p + "ffn_gate_inp.scale": ((h,), True),
                      p + "ffn_gate_up_exps.weight": ((h, 2 * fe, e), True),
                      p + "ffn_down_exps.weight": ((fe, h, e), True), p + "ffn_down_exps.scale": ((e,), True)})
            for norm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                t[p + norm + ".weight"] = ((h,), True)
    return t


def _encoder(d: dict[str, Any], learned_positions: bool,
             products: tuple[tuple[str, tuple[int, int], int | None], ...]) -> Table:
    """A BERT-style encoder: token (and type) embeddings with a biased norm, then per block ``products``
    (name, dims, bias size or None) and two post-norms with biases."""
    h = d["hidden"]
    t: Table = {"token_embd.weight": ((h, d["vocab"]), True)}
    if learned_positions:
        t["position_embd.weight"] = ((h, None), True)
    t.update({"token_types.weight": ((h, 2), False), "token_embd_norm.weight": ((h,), True),
              "token_embd_norm.bias": ((h,), True)})
    for i in range(d["n_layer"]):
        p = f"blk.{i}."
        for name, dims, bias in products:
            t[p + name + ".weight"] = (dims, True)
            if bias is not None:
                t[p + name + ".bias"] = ((bias,), False)
        for norm in ("attn_output_norm", "layer_output_norm"):
            t[p + norm + ".weight"] = ((h,), True)
            t[p + norm + ".bias"] = ((h,), True)
    return t


def _bert(d: dict[str, Any]) -> Table:
    h, ff = d["hidden"], d["n_ff"]
    return _encoder(d, True, (("attn_q", (h, h), h), ("attn_k", (h, h), h), ("attn_v", (h, h), h),
                              ("attn_output", (h, h), h), ("ffn_up", (h, ff), ff), ("ffn_down", (ff, h), h)))


def _nomic_bert(d: dict[str, Any]) -> Table:
    """BERT without learned positions or biases: fused QKV, SwiGLU MLP, post-norms with biases."""
    h, ff = d["hidden"], d["n_ff"]
    return _encoder(d, False, (("attn_qkv", (h, 3 * h), None), ("attn_output", (h, h), None),
                               ("ffn_gate", (h, ff), None), ("ffn_up", (h, ff), None), ("ffn_down", (ff, h), None)))


def _nomic_bert_moe(d: dict[str, Any]) -> Table:
    """nomic-embed-text v2: biased fused QKV and output; blocks ``i % moe_every == 1`` route to experts
    (up and down, GELU), the others a biased GELU MLP."""
    h, ff, e = d["hidden"], d["n_ff"], d["n_expert"]
    t = _encoder(d, False, (("attn_qkv", (h, 3 * h), 3 * h), ("attn_output", (h, h), h)))
    t["token_types.weight"] = ((h, None), False)
    for i in range(d["n_layer"]):
        p = f"blk.{i}."
        if moe_block(i, d["moe_every"]):
            t.update({p + "ffn_gate_inp.weight": ((h, e), True), p + "ffn_up_exps.weight": ((h, ff, e), True),
                      p + "ffn_down_exps.weight": ((ff, h, e), True)})
        else:
            t.update({p + "ffn_up.weight": ((h, ff), True), p + "ffn_up.bias": ((ff,), False),
                      p + "ffn_down.weight": ((ff, h), True), p + "ffn_down.bias": ((h,), False)})
    return t


_FAMILY_TABLES: dict[str, Callable[[dict[str, Any]], Table]] = {
    "llama": _llama,
    "qwen3": lambda d: _decoder(d, qk_norm=True),
    "qwen3moe": lambda d: _decoder(d, qk_norm=True, moe=True),
    "qwen3vl": lambda d: _decoder(d, qk_norm=True),
    "qwen3vlmoe": lambda d: _decoder(d, qk_norm=True, moe=True),
    "gemma3": lambda d: _decoder(d, qk_norm=True, sandwich=True),
    "gemma4": _gemma4,
    "bert": _bert,
    "nomic-bert": _nomic_bert,
    "nomic-bert-moe": _nomic_bert_moe,
    "qwen35": _qwen35,
    "qwen35moe": lambda d: _qwen35(d, moe=True),
}


def _matches(found: tuple[int, ...], dims: tuple[int | None, ...]) -> bool:
    """``None`` in ``dims`` is a dimension the engine reads off the tensor (BERT's learned positions);
    trailing size-1 dimensions may be missing (``llama-quantize`` drops them: a one-row type embedding)."""
    found = tuple(found) + (1,) * (len(dims) - len(found))
    return len(found) == len(dims) and all(e is None or f == e for f, e in zip(found, dims))


def _text(dims: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("any" if d is None else str(d) for d in dims) + "]"


def _floats(t) -> np.ndarray:
    raw = np.asarray(t.data)
    if t.qtype == T.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw


def _show(v: Any) -> str:
    if isinstance(v, list):
        return f"an array of {len(v)}"
    s = repr(v)
    return f"{type(v).__name__} {s[:40] + '…' if len(s) > 40 else s}"


def _count(v: Any) -> str:
    return f"{len(v)} entries" if isinstance(v, list) else _show(v)
