"""Crafted HF model directories for ``hf2q convert``: one valid tiny Llama and many broken variants.

Each case is a folder shaped like a Hub checkpoint (``config.json``, safetensors, a
byte-level BPE ``tokenizer.json``) with one thing wrong — a config value, a tensor, a
safetensors header, an index, the tokenizer — or nothing wrong (the controls). The weights
are a few kilobytes and the safetensors files are written by hand here, so a header can say
what no safetensors library would write (overlapping ranges, offsets past the end, an
unknown dtype). ``build_cases`` is deterministic: the same folders, byte for byte, every call.

Used by ``tests/test_convert_crafted.py`` and the reliability bench, which run every case
through the real CLI and check the exit code, that a failure is one ``hf2q: error:`` line,
and that nothing (not even a temp file) is left at the output path.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

#: placeholder for the output path inside ``convert_args``
OUT = "{out}"

# a Llama small enough that every folder is a few kilobytes: 2 layers, GQA 4/2 heads × 8, ff 48
HIDDEN, FF, HEADS, KV_HEADS, LAYERS = 32, 48, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
# the Qwen3 variants: per-head Q/K norms, heads wider than hidden / heads; the MoE one has 4 experts of ff 16
QWEN_HEAD_DIM, EXPERTS, EXPERT_FF = 16, 4, 16
N_BYTES = 256
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB = N_BYTES + len(SPECIALS)


@attrs.frozen
class CraftedCheckpoint:
    name: str  # short id
    path: Path  # an HF model directory
    convert_args: tuple[str, ...]  # after ``hf2q convert PATH``; "{out}" stands for the output path
    convert_exit: int  # expected exit code (0 only for the valid controls)
    needle: str = ""  # a word the one-line error must contain (empty for the controls)


def gguf_args(quant: str = "q8_0") -> tuple[str, ...]:
    return ("--quant", quant, "-o", OUT)


# --------------------------------------------------------------------------- the valid checkpoint
def llama_config() -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": True, "vocab_size": VOCAB,
            "bos_token_id": VOCAB - 3, "eos_token_id": VOCAB - 1, "torch_dtype": "float32"}


def qwen3_config(moe: bool = False) -> dict[str, Any]:
    cfg = {**llama_config(), "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
           "model_type": "qwen3_moe" if moe else "qwen3", "head_dim": QWEN_HEAD_DIM, "rope_theta": 1000000.0,
           "rms_norm_eps": 1e-6}
    if moe:
        cfg.update({"num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": EXPERT_FF,
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "tie_word_embeddings": False})
    return cfg


def qwen3_tensors(moe: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded weights under the HF Qwen3 (or Qwen3-MoE, per-expert layout) names."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n: int = HIDDEN) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    q, kv = HEADS * QWEN_HEAD_DIM, KV_HEADS * QWEN_HEAD_DIM
    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                    p + "self_attn.q_proj.weight": w(q, HIDDEN), p + "self_attn.k_proj.weight": w(kv, HIDDEN),
                    p + "self_attn.v_proj.weight": w(kv, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, q),
                    p + "self_attn.q_norm.weight": norm(QWEN_HEAD_DIM),
                    p + "self_attn.k_norm.weight": norm(QWEN_HEAD_DIM)})
        if moe:
            out[p + "mlp.gate.weight"] = w(EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                out.update({p + f"mlp.experts.{e}.gate_proj.weight": w(EXPERT_FF, HIDDEN),
                            p + f"mlp.experts.{e}.up_proj.weight": w(EXPERT_FF, HIDDEN),
                            p + f"mlp.experts.{e}.down_proj.weight": w(HIDDEN, EXPERT_FF)})
        else:
            out.update({p + "mlp.gate_proj.weight": w(FF, HIDDEN), p + "mlp.up_proj.weight": w(FF, HIDDEN),
                        p + "mlp.down_proj.weight": w(HIDDEN, FF)})
    out["model.norm.weight"] = norm()
    if moe:
        out["lm_head.weight"] = w(VOCAB, HIDDEN)
    return out


def llama_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random fp32 weights under the HF Llama names, in the order transformers saves them."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                    p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
                    p + "mlp.gate_proj.weight": w(FF, HIDDEN), p + "mlp.up_proj.weight": w(FF, HIDDEN),
                    p + "mlp.down_proj.weight": w(HIDDEN, FF)})
    out["model.norm.weight"] = norm()
    return out


def tokenizer_json() -> dict[str, Any]:
    """A byte-level BPE with one token per byte (GPT-2's byte → printable mapping) and no merges."""
    vocab = {ch: i for i, ch in enumerate(_byte_chars())}
    added = [{"id": N_BYTES + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIALS)]
    vocab.update({t: N_BYTES + i for i, t in enumerate(SPECIALS)})
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                                                "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": []}}


def _byte_chars() -> list[str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(N_BYTES):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(N_BYTES + extra)
            extra += 1
    return [chars[b] for b in range(N_BYTES)]


def write_checkpoint(path: Path, cfg: dict | list | str | None = None, tensors: dict | None = None,
                     tokenizer: Any = None) -> Path:
    """A complete HF folder; ``cfg`` may be any JSON value (or raw text) to test config parsing."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = llama_config() if cfg is None else cfg
    (path / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg, indent=1))
    write_safetensors(path / "model.safetensors", llama_tensors() if tensors is None else tensors)
    tok = tokenizer_json() if tokenizer is None else tokenizer
    (path / "tokenizer.json").write_text(json.dumps(tok))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "add_bos_token": False,
         "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}))
    return path


# --------------------------------------------------------------------------- safetensors by hand
_ST_DTYPE = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<i8"): "I64"}


def safetensors_header(tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, a in tensors.items():
        header[name] = {"dtype": _ST_DTYPE[a.dtype], "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
        pos += a.nbytes
    return header


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], header: dict | None = None,
                      header_len: int | None = None) -> None:
    """The safetensors layout (u64 header length, JSON header, data) with an optionally forged header."""
    text = json.dumps(safetensors_header(tensors) if header is None else header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in tensors.values())
    path.write_bytes(struct.pack("<Q", len(text) if header_len is None else header_len) + text + data)


# --------------------------------------------------------------------------- the cases
def _config(**changes: Any) -> dict[str, Any]:
    cfg = llama_config()
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


_DROP = object()


def _tensors(drop: tuple[str, ...] = (), **replace: np.ndarray) -> dict[str, np.ndarray]:
    t = llama_tensors()
    for name in drop:
        del t[name]
    for key, value in replace.items():
        t[key.replace("__", ".")] = value
    return t


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


def _forged(edit: Callable[[dict[str, Any]], None], header_len_delta: int = 0) -> Callable[[Path], None]:
    """A builder that writes the valid checkpoint and then rewrites its safetensors header with ``edit``."""
    def build(path: Path) -> None:
        write_checkpoint(path)
        t = llama_tensors()
        header = safetensors_header(t)
        edit(header)
        text_len = len(json.dumps(header, separators=(",", ":")).encode())
        text_len += -text_len % 8
        write_safetensors(path / "model.safetensors", t, header,
                          header_len=text_len + header_len_delta if header_len_delta else None)
    return build


def _shift(name: str, by: int) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [b + by, e + by]
    return edit


def _set(name: str, key: str, value: Any) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        h[name][key] = value
    return edit


def _sharded(index_edit: Callable[[dict], None] | None = None, drop_from_shard: str | None = None,
             ) -> Callable[[Path], None]:
    """Two shards plus ``model.safetensors.index.json`` (optionally edited or with a tensor missing)."""
    def build(path: Path) -> None:
        write_checkpoint(path)
        (path / "model.safetensors").unlink()
        t = llama_tensors()
        names = list(t)
        shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
                  "model-00002-of-00002.safetensors": names[len(names) // 2:]}
        weight_map = {}
        for shard, members in shards.items():
            kept = {n: t[n] for n in members if n != drop_from_shard}
            write_safetensors(path / shard, kept)
            weight_map.update({n: shard for n in members})
        index = {"metadata": {"total_size": sum(a.nbytes for a in t.values())}, "weight_map": weight_map}
        if index_edit:
            index_edit(index)
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return build


def _tokenizer(value: Any) -> Callable[[Path], None]:
    return lambda path: write_checkpoint(path, tokenizer=value)


def _config_case(cfg: Any) -> Callable[[Path], None]:
    return lambda path: write_checkpoint(path, cfg=cfg)


def _tensors_case(tensors: dict[str, np.ndarray], cfg: dict | None = None) -> Callable[[Path], None]:
    return lambda path: write_checkpoint(path, cfg=cfg, tensors=tensors)


def _tok_without_model() -> dict:
    tj = tokenizer_json()
    del tj["model"]
    return tj


def _tok_vocab_list() -> dict:
    tj = tokenizer_json()
    tj["model"]["vocab"] = list(range(VOCAB))
    return tj


def _tok_vocab_string_ids() -> dict:
    tj = tokenizer_json()
    tj["model"]["vocab"] = {k: str(v) for k, v in tj["model"]["vocab"].items()}
    return tj


def _qwen3(moe: bool = False, cfg: dict | None = None, drop: tuple[str, ...] = (),
           **replace: np.ndarray) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        t = qwen3_tensors(moe)
        for name in drop:
            del t[name]
        t.update({k.replace("__", "."): v for k, v in replace.items()})
        write_checkpoint(path, cfg=cfg or qwen3_config(moe), tensors=t)
    return build


L0 = "model.layers.0."
E = "model.embed_tokens.weight"

# name → (builder, convert args, expected exit, a word the error line must contain)
_CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...], int, str]] = {
    # controls: these must convert
    "valid_q8_0": (write_checkpoint, gguf_args("q8_0"), 0, ""),
    "valid_f16": (write_checkpoint, gguf_args("f16"), 0, ""),
    "valid_sharded": (_sharded(), gguf_args("q8_0"), 0, ""),
    # tensors against the config
    "missing_final_norm": (_tensors_case(_tensors(drop=("model.norm.weight",))), gguf_args(), 3, "output_norm"),
    "missing_layer_tensor": (_tensors_case(_tensors(drop=("model.layers.1.mlp.down_proj.weight",))),
                             gguf_args(), 3, "ffn_down"),
    "missing_embedding": (_tensors_case(_tensors(drop=(E,))), gguf_args(), 3, "token_embd"),
    "k_proj_rows_contradict_config": (_tensors_case(_tensors(**{L0 + "self_attn__k_proj__weight": _zeros(32, 32)})),
                                      gguf_args(), 3, "attn_k"),
    "q_proj_cols_contradict_config": (_tensors_case(_tensors(**{L0 + "self_attn__q_proj__weight": _zeros(32, 48)})),
                                      gguf_args(), 3, "attn_q"),
    "embedding_width_contradicts_config": (_tensors_case(_tensors(**{"model__embed_tokens__weight":
                                                                     _zeros(VOCAB, 48)})), gguf_args(), 3,
                                           "token_embd"),
    "up_proj_rows_contradict_config": (_tensors_case(_tensors(**{L0 + "mlp__up_proj__weight": _zeros(64, HIDDEN)})),
                                       gguf_args(), 3, "ffn_up"),
    "norm_length_contradicts_config": (_tensors_case(_tensors(**{"model__norm__weight": _zeros(48)})),
                                       gguf_args(), 3, "output_norm"),
    "norm_is_2d": (_tensors_case(_tensors(**{L0 + "input_layernorm__weight": _zeros(1, HIDDEN)})),
                   gguf_args(), 3, "attn_norm"),
    "embedding_rows_fewer_than_vocab": (_tensors_case(_tensors(**{"model__embed_tokens__weight":
                                                                  _zeros(100, HIDDEN)})), gguf_args(), 3, "vocab"),
    "more_layers_in_config_than_weights": (_config_case(_config(num_hidden_layers=3)), gguf_args(), 3,
                                           "num_hidden_layers"),
    "fewer_layers_in_config_than_weights": (_config_case(_config(num_hidden_layers=1)), gguf_args(), 3,
                                            "num_hidden_layers"),
    "num_hidden_layers_1e9": (_config_case(_config(num_hidden_layers=10**9)), gguf_args(), 3, "num_hidden_layers"),
    "num_hidden_layers_missing": (_config_case(_config(num_hidden_layers=_DROP)), gguf_args(), 3,
                                  "num_hidden_layers"),
    "num_hidden_layers_float": (_config_case(_config(num_hidden_layers=2.5)), gguf_args(), 3, "num_hidden_layers"),
    "num_hidden_layers_bool": (_config_case(_config(num_hidden_layers=True)), gguf_args(), 3, "num_hidden_layers"),
    # config values
    "hidden_size_zero": (_config_case(_config(hidden_size=0)), gguf_args(), 3, "hidden_size"),
    "hidden_size_negative": (_config_case(_config(hidden_size=-64)), gguf_args(), 3, "hidden_size"),
    "hidden_size_string": (_config_case(_config(hidden_size="64")), gguf_args(), 3, "hidden_size"),
    "hidden_size_missing": (_config_case(_config(hidden_size=_DROP)), gguf_args(), 3, "hidden_size"),
    "num_attention_heads_zero": (_config_case(_config(num_attention_heads=0)), gguf_args(), 3,
                                 "num_attention_heads"),
    "num_attention_heads_not_dividing": (_config_case(_config(num_attention_heads=5)), gguf_args(), 3,
                                         "num_attention_heads"),
    "num_key_value_heads_not_dividing": (_config_case(_config(num_key_value_heads=3)), gguf_args(), 3,
                                         "num_key_value_heads"),
    "intermediate_size_string": (_config_case(_config(intermediate_size="48")), gguf_args(), 3,
                                 "intermediate_size"),
    "vocab_size_huge": (_config_case(_config(vocab_size=2**40)), gguf_args(), 3, "vocab_size"),
    "rope_theta_string": (_config_case(_config(rope_theta="10000")), gguf_args(), 3, "rope_theta"),
    "rope_theta_negative": (_config_case(_config(rope_theta=-1.0)), gguf_args(), 3, "rope_theta"),
    "rms_norm_eps_string": (_config_case(_config(rms_norm_eps="1e-5")), gguf_args(), 3, "rms_norm_eps"),
    "rope_scaling_not_object": (_config_case(_config(rope_scaling=[1, 2])), gguf_args(), 3, "rope_scaling"),
    "config_is_a_list": (_config_case([llama_config()]), gguf_args(), 3, "JSON object"),
    "config_is_a_string": (_config_case('"LlamaForCausalLM"'), gguf_args(), 3, "JSON object"),
    "config_invalid_json": (_config_case('{"architectures": ["LlamaForCausalLM"],'), gguf_args(), 3, "JSON"),
    "architectures_not_a_list": (_config_case(_config(architectures="LlamaForCausalLM")), gguf_args(), 3,
                                 "architectures"),
    # safetensors headers
    "overlapping_data_offsets": (_forged(_shift(L0 + "self_attn.k_proj.weight", -64)), gguf_args(), 3, "overlap"),
    "data_offsets_beyond_file": (_forged(_shift("model.norm.weight", 1 << 20)), gguf_args(), 3, "model.norm.weight"),
    "data_offsets_not_numbers": (_forged(_set("model.norm.weight", "data_offsets", ["0", "128"])), gguf_args(), 3,
                                 "model.norm.weight"),
    "data_offsets_reversed": (_forged(_set("model.norm.weight", "data_offsets", [128, 0])), gguf_args(), 3,
                              "model.norm.weight"),
    "shape_negative": (_forged(_set("model.norm.weight", "shape", [-32])), gguf_args(), 3, "model.norm.weight"),
    "header_length_beyond_file": (_forged(lambda h: None, header_len_delta=1 << 30), gguf_args(), 3, "header"),
    "header_not_json": (lambda p: (write_checkpoint(p), (p / "model.safetensors").write_bytes(
        struct.pack("<Q", 16) + b"{not json here!}")), gguf_args(), 3, "header"),
    "header_entry_not_object": (_forged(lambda h: h.__setitem__("model.norm.weight", [1, 2])), gguf_args(), 3,
                                "model.norm.weight"),
    "unknown_dtype": (_forged(_set("model.norm.weight", "dtype", "F12")), gguf_args(), 3, "F12"),
    "empty_tensor": (_forged(lambda h: (_set("model.norm.weight", "shape", [0])(h),
                                        _set("model.norm.weight", "data_offsets", [0, 0])(h))), gguf_args(), 3,
                     "model.norm.weight"),
    "scalar_tensor": (_tensors_case(_tensors(**{L0 + "input_layernorm__weight": np.float32(1.0).reshape(())})),
                      gguf_args(), 3, "attn_norm"),
    "integer_weight_dtype": (_tensors_case(_tensors(**{"model__norm__weight": np.ones(HIDDEN, dtype="<i8")})),
                             gguf_args(), 3, "I64"),
    "empty_safetensors": (lambda p: (write_checkpoint(p), (p / "model.safetensors").write_bytes(b"")),
                          gguf_args(), 3, "safetensors"),
    # sharded checkpoints
    "index_names_tensor_its_shard_lacks": (_sharded(drop_from_shard="model.layers.1.mlp.up_proj.weight"),
                                           gguf_args(), 3, "model.layers.1.mlp.up_proj.weight"),
    "index_names_missing_shard": (_sharded(lambda ix: ix["weight_map"].__setitem__(
        "model.norm.weight", "model-00003-of-00002.safetensors")), gguf_args(), 3, "model-00003-of-00002"),
    "index_weight_map_not_object": (_sharded(lambda ix: ix.__setitem__("weight_map", ["a", "b"])), gguf_args(), 3,
                                    "weight_map"),
    "index_shard_path_escapes": (_sharded(lambda ix: ix["weight_map"].__setitem__(
        "model.norm.weight", "../outside.safetensors")), gguf_args(), 3, "outside"),
    # tokenizer.json
    "tokenizer_is_a_list": (_tokenizer([1, 2, 3]), gguf_args(), 3, "tokenizer.json"),
    "tokenizer_without_model": (_tokenizer(_tok_without_model()), gguf_args(), 3, "tokenizer.json"),
    "tokenizer_vocab_a_list_of_ints": (_tokenizer(_tok_vocab_list()), gguf_args(), 3, "tokenizer.json"),
    "tokenizer_vocab_ids_strings": (_tokenizer(_tok_vocab_string_ids()), gguf_args(), 3, "tokenizer.json"),
    "tokenizer_model_a_string": (_tokenizer({**tokenizer_json(), "model": "BPE"}), gguf_args(), 3,
                                 "tokenizer.json"),
    # other families: Qwen3 (per-head norms, head_dim × heads ≠ hidden) and Qwen3-MoE (experts stacked)
    "qwen3_valid": (_qwen3(), gguf_args("q8_0"), 0, ""),
    "qwen3_moe_valid": (_qwen3(moe=True), gguf_args("q8_0"), 0, ""),
    "qwen3_q_norm_wrong_length": (_qwen3(**{L0 + "self_attn__q_norm__weight": _zeros(HIDDEN)}), gguf_args(), 3,
                                  "attn_q_norm"),
    "qwen3_missing_k_norm": (_qwen3(drop=("model.layers.1.self_attn.k_norm.weight",)), gguf_args(), 3, "attn_k_norm"),
    "qwen3_head_dim_contradicts_weights": (_qwen3(cfg={**qwen3_config(), "head_dim": 8}), gguf_args(), 3, "attn_k"),
    "qwen3_moe_missing_expert": (_qwen3(moe=True, drop=("model.layers.1.mlp.experts.3.up_proj.weight",)),
                                 gguf_args(), 3, "expert"),
    "qwen3_moe_more_experts_in_config": (_qwen3(moe=True, cfg={**qwen3_config(True), "num_experts": 8}),
                                         gguf_args(), 3, "expert"),
    "qwen3_moe_expert_width_contradicts_config": (_qwen3(moe=True, cfg={**qwen3_config(True),
                                                                       "moe_intermediate_size": 32}),
                                                  gguf_args(), 3, "_exps"),
    "qwen3_moe_router_rows_contradict_config": (_qwen3(moe=True, **{L0 + "mlp__gate__weight": _zeros(3, HIDDEN)}),
                                                gguf_args(), 3, "ffn_gate_inp"),
    "qwen3_moe_without_num_experts": (_qwen3(moe=True, cfg={k: v for k, v in qwen3_config(True).items()
                                                           if k != "num_experts"}), gguf_args(), 3, "num_experts"),
    # the command line
    "mlx_quant_to_gguf": (write_checkpoint, ("--format", "gguf", "--quant", "mlx-4", "-o", OUT), 2, "mlx-4"),
}


def build_cases(out_dir: Path) -> list[CraftedCheckpoint]:
    """Write every case under ``out_dir/<name>/`` (replacing what is there) and describe it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = []
    for name, (build, args, code, needle) in _CASES.items():
        path = out_dir / name
        shutil.rmtree(path, ignore_errors=True)
        build(path)
        cases.append(CraftedCheckpoint(name, path, args, code, needle))
    return cases
