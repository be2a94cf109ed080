"""Tiny random-weight HF checkpoints of real architectures, paired with real tokenizers.

``checkpoint(family)`` returns a folder shaped exactly like a Hub checkpoint of that family
(``config.json``, fp32 ``model.safetensors``, tokenizer files, chat template) but with a
handful of small layers, so converters and engines can be checked against transformers'
forward pass in seconds. The head layouts of the real models are kept (GQA, Qwen3's
``head_dim × heads ≠ hidden``, Gemma's single KV head and sliding/global mix, tied or
untied embeddings as the real model), and the embedding has as many rows as the real
tokenizer needs.

Weights: transformers' own initialisation under ``torch.manual_seed(0)``, then every
parameter gets extra seeded noise so that no tensor is a constant (norm weights of all ones,
zero biases, or Gemma's zero-centred norms would hide a converter that drops or mis-offsets
them), and matrices are scaled so logits have a std of 1-2 (see ``_perturb``).

Folders are cached under ``<hf2q cache>/test-models/tiny-<family>-<version>/`` and built once.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.models.cache import build_once
from tests.models.tokenizer_files import copy_tokenizer, vocab_size

# bumped when a family's files change (v2: weights scaled so logits are not flat;
# llama v4: SmolLM2 tokenizer with its digit splitting)
VERSIONS = {"llama": "v4", "qwen3": "v3", "qwen3_moe": "v3", "gemma3": "v3", "bert": "v3",
            "llama_rope_llama3": "v1", "llama_rope_linear": "v1", "llama_rope_yarn": "v1", "gemma3_rope_linear": "v1",
            "qwen35": "v1", "qwen35_moe": "v2",  # qwen35_moe v1: taken in the shared cache
            "gemma4": "v1", "gemma4_e2b": "v1", "gemma4_moe": "v1"}
FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma3", "bert", "qwen35", "qwen35_moe")
SEED = 0

# the tiny llama's shape without its rope settings (shared by the rope-scaling variants)
_LLAMA_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1,
                "eos_token_id": 2, "pad_token_id": 2}
_LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}

# family → (tokenizer, transformers config class name, auto-model kind, config kwargs, legacy keys)
# Legacy keys: transformers 5 writes ``rope_parameters``; the real Hub configs (and mlx-lm,
# llama.cpp's convert_hf_to_gguf.py) use the flat names, so they are written too.
_SPECS: dict[str, dict] = {
    # SmolLM2-135M: hidden 576, 9 heads / 3 KV (head_dim 64), tied embeddings, rope 1e5.
    "llama": {
        "tokenizer": "smollm2", "config": "LlamaConfig", "kind": "causal",
        "kwargs": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
        "legacy": {"rope_theta": 100000.0}, "scales": (5.0, 3.0),
    },
    # Qwen3-0.6B: hidden 1024, 16 heads × 128 (≠ hidden), 8 KV, q/k norms, tied embeddings.
    "qwen3": {
        "tokenizer": "qwen3", "config": "Qwen3Config", "kind": "causal",
        "kwargs": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        "legacy": {"rope_theta": 1000000.0}, "scales": (5.0, 3.0),
    },
    # Qwen3-30B-A3B: 128 experts top-8 (here 4 experts top-2), normalised top-k, untied.
    "qwen3_moe": {
        "tokenizer": "qwen3", "config": "Qwen3MoeConfig", "kind": "causal",
        "kwargs": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4,
                    "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                    "bos_token_id": 151643, "eos_token_id": 151645,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        "legacy": {"rope_theta": 1000000.0, "num_experts": 4},  # transformers 5 renames it num_local_experts
        "scales": (5.0, 3.0),
    },
    # Gemma3-270m: 4 heads / 1 KV, head_dim 256, sliding window 512 with 5 local : 1 global,
    # two rope bases, q/k norms, (1 + w) norms, tied. Here: 2 sliding layers + 1 global, window 16.
    "gemma3": {
        "tokenizer": "gemma3", "config": "Gemma3TextConfig", "kind": "causal",
        "kwargs": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                    "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
                    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        "legacy": {"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
                    "_sliding_window_pattern": 3, "sliding_window_pattern": 3},  # mlx-lm reads the latter
        "scales": (3.0, 3.0),  # Gemma multiplies embeddings by sqrt(hidden): a smaller embedding scale
    },
    # Rope-scaling variants of the tiny llama (not in FAMILIES): a short original context (64) so the
    # scaling bites within a ~200-token test; base 1e4 and head_dim 16 put pairs on every branch
    # (kept, blended, scaled). Llama 3.1's rope_scaling, in both the new and the legacy keys.
    "llama_rope_llama3": {
        "tokenizer": "smollm2", "config": "LlamaConfig", "kind": "causal",
        "kwargs": {**_LLAMA_SHAPE, "max_position_embeddings": 2048,
                    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, **_LLAMA3_SCALING}},
        "legacy": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "llama3", **_LLAMA3_SCALING}},
        "scales": (5.0, 3.0),
    },
    "llama_rope_linear": {
        "tokenizer": "smollm2", "config": "LlamaConfig", "kind": "causal",
        "kwargs": {**_LLAMA_SHAPE, "max_position_embeddings": 2048,
                    "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        "legacy": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        "scales": (5.0, 3.0),
    },
    # YaRN: max_position_embeddings = factor × original, so transformers' attention factor is 0.1·ln(4) + 1
    "llama_rope_yarn": {
        "tokenizer": "smollm2", "config": "LlamaConfig", "kind": "causal",
        "kwargs": {**_LLAMA_SHAPE, "max_position_embeddings": 256,
                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 64}},
        "legacy": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 64}},
        "scales": (5.0, 3.0),
    },
    # Qwen3.5-9B: Gated DeltaNet linear-attention layers with one gated full-attention layer every
    # full_attention_interval (4 there, 2 here so both kinds follow each other), 16 key / 32 value heads
    # of 128 in the DeltaNet (here 2 / 4 of 32: key heads ≠ value heads), 16 query / 4 KV heads of 256
    # with a 0.25 partial rotary (here 4 / 2 of 32 → 8 rotary dims), untied. d ≠ 2·ff ≠ ff.
    "qwen35": {
        "tokenizer": "qwen3", "config": "Qwen3_5TextConfig", "kind": "causal",
        "kwargs": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 32, "linear_conv_kernel_dim": 4,
                    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4, "full_attention_interval": 2, "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 151643,
                    "eos_token_id": 151645,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                        "mrope_interleaved": True}},
        "legacy": {"full_attention_interval": 2}, "scales": (5.0, 3.0),
    },
    # all-MiniLM-L6-v2: BertModel, hidden 384, 12 heads, mean pooling (sentence-transformers files).
    "bert": {
        "tokenizer": "bert", "config": "BertConfig", "kind": "base",
        "kwargs": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0},
        "legacy": {},
    },
}

# Qwen3.5-9B: 3 Gated DeltaNet layers : 1 gated-attention layer, 16 key / 32 value linear heads of 128,
# 16 query heads / 4 KV of 256 with a quarter rotary (interleaved mrope sections), norms stored as w for
# (1 + w). Here 4 layers, 2 key / 4 value heads (so the value-head reorder bites), hidden 64 ≠ ff 256 ≠ 2·ff,
# 64-wide heads (256-wide attention / DeltaNet outputs, so K-quants are used, not only their fallbacks).
# These are the converter's parity models, named apart from the engine's tiny qwen35 (its forward tests).
_QWEN35 = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64,
           "linear_value_head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "layer_types": ["linear_attention"] * 3 + ["full_attention"], "full_attention_interval": 4,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
           "bos_token_id": 151643, "eos_token_id": 151645,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [3, 3, 2], "mrope_interleaved": True}}
_SPECS["qwen35_parity"] = {"tokenizer": "qwen3", "config": "Qwen3_5TextConfig", "kind": "causal",
                           "kwargs": _QWEN35, "legacy": {}, "scales": (5.0, 3.0)}
# the same with a hand-made multi-token-prediction head (transformers does not model it; real checkpoints
# ship it as mtp.*: one full-attention block plus its fc / pre-fc norms / final norm)
_SPECS["qwen35_parity_mtp"] = {**_SPECS["qwen35_parity"], "legacy": {"mtp_num_hidden_layers": 1}, "mtp": True}
# Qwen3.5-35B-A3B: 256 experts top-8 plus a gated shared expert, untied. Here 4 experts top-2, expert
# ff 96 ≠ shared ff 48 ≠ hidden 64, with an MTP head whose block is MoE too.
_SPECS["qwen35moe_parity_mtp"] = {
    "tokenizer": "qwen3", "config": "Qwen3_5MoeTextConfig", "kind": "causal",
    "kwargs": {**{k: v for k, v in _QWEN35.items() if k != "intermediate_size"}, "tie_word_embeddings": False,
               "moe_intermediate_size": 96, "shared_expert_intermediate_size": 48, "num_experts": 4,
               "num_experts_per_tok": 2},
    "legacy": {"mtp_num_hidden_layers": 1}, "scales": (5.0, 3.0), "mtp": True,
}
VERSIONS.update({"qwen35_parity": "v1", "qwen35_parity_mtp": "v1", "qwen35moe_parity_mtp": "v1"})

# Gemma 3 4B/12B/27B: linear rope scaling (factor 8) on the global layers only; sliding layers keep plain rope
_SPECS["gemma3_rope_linear"] = {
    **_SPECS["gemma3"],
    "kwargs": {**_SPECS["gemma3"]["kwargs"], "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "legacy": {**_SPECS["gemma3"]["legacy"], "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
}


# Qwen3.5-35B-A3B: the qwen35 blocks with a softmax top-8-of-256 MoE (renormalised) plus a shared
# expert gated by σ(shared_expert_gate·x); here top-2 of 4, shared ff 48 ≠ expert ff 32
_SPECS["qwen35_moe"] = {
    **_SPECS["qwen35"], "config": "Qwen3_5MoeTextConfig",
    "kwargs": {**{k: v for k, v in _SPECS["qwen35"]["kwargs"].items() if k != "intermediate_size"},
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 48},
}
# Gemma 4 (engine: hf2q/engine/models/gemma4.py; its own tests, tests/test_engine_gemma4.py). 31B-style dense: sliding layers with 2 KV heads × 32 and
# full layers with global_head_dim 64, one KV head whose K doubles as V (attention_k_eq_v), proportional
# rope (a quarter of the global head rotated) and both rope bases; plain w norms (no 1 + w), a layer
# scalar per layer, final soft-cap 30.
_GEMMA4_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 32, "global_head_dim": 64, "sliding_window": 16, "max_position_embeddings": 4096,
                 "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
                 "pad_token_id": 0, "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
                 "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                        "rope_theta": 1000000.0}}}
_SPECS["gemma4"] = {
    "tokenizer": "gemma4", "config": "Gemma4TextConfig", "kind": "causal",
    "kwargs": {**_GEMMA4_SHAPE, "num_hidden_layers": 3, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    "legacy": {}, "scales": (3.0, 3.0),
}
# E2B/E4B-style: per-layer embeddings (8 per layer here, 256 in E2B), the last two layers reuse the KV of
# the last earlier layer of their type (num_kv_shared_layers) and have a double-wide MLP; no k_eq_v.
_SPECS["gemma4_e2b"] = {
    **_SPECS["gemma4"],
    "kwargs": {**_GEMMA4_SHAPE, "num_hidden_layers": 4, "num_key_value_heads": 1, "hidden_size_per_layer_input": 8,
               "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
}
# 26B-A4B-style: every layer has the dense MLP beside 4 routed experts (top 2) with their own norms.
_SPECS["gemma4_moe"] = {
    **_SPECS["gemma4"],
    "kwargs": {**_SPECS["gemma4"]["kwargs"], "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
               "moe_intermediate_size": 32},
}


def checkpoint(family: str) -> Path:
    """Path of the tiny ``family`` checkpoint (built on first use, then reused)."""
    if family not in _SPECS:
        raise ValueError(f"unknown tiny family {family!r}; known: {', '.join(_SPECS)}")
    return build_once(f"tiny-{family}-{VERSIONS[family]}", lambda out: _build(family, out))


def spec(family: str) -> dict:
    """The config values a tiny checkpoint was built with (for tests that need shapes)."""
    s = _SPECS[family]
    return {**s["kwargs"], "vocab_size": vocab_size(s["tokenizer"]), "tokenizer": s["tokenizer"]}


def _perturb(model, seed: int, embed_scale: float, matrix_scale: float) -> None:
    """Give every parameter seeded noise so none is constant, then set the weight scales.

    With transformers' 0.02-std init a tiny model's logits are nearly flat (top-1 margins of
    1e-3 make greedy comparisons flip on rounding). Scaling embeddings and matrices up gives
    logits with a std of 1-2 and a model that neither copies its input token (the residual
    stream is not just the embedding) nor collapses to one token. Random models still have
    some near-ties: compare logits, or argmax only where the reference margin is clear.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1:  # norm weights (around 1, or around 0 for Gemma's 1+w) and biases
                p.add_(0.1 * noise)
                continue
            p.mul_(2.0).add_(0.02 * noise)
            p.mul_(embed_scale if ("embed_tokens" in name or "lm_head" in name) else matrix_scale)


def _build(family: str, out: Path) -> None:
    import torch
    import transformers

    s = _SPECS[family]
    config_cls = getattr(transformers, s["config"])
    config = config_cls(vocab_size=vocab_size(s["tokenizer"]), **s["kwargs"])
    torch.manual_seed(SEED)
    auto = transformers.AutoModelForCausalLM if s["kind"] == "causal" else transformers.AutoModel
    model = auto.from_config(config, dtype=torch.float32)
    _perturb(model, SEED + 1, *s.get("scales", (1.0, 1.0)))
    model.eval()
    model.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(s["legacy"])
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    copy_tokenizer(s["tokenizer"], out)
    if s.get("mtp"):
        _add_mtp_head(out, cfg, SEED + 2)
    if family == "bert":
        _write_sentence_transformers_files(out, config.hidden_size)
    if not (out / "model.safetensors").exists():
        raise RuntimeError(f"transformers did not write model.safetensors for {family}")


def _add_mtp_head(out: Path, cfg: dict, seed: int) -> None:
    """Append a random ``mtp.*`` head shaped like the last full-attention block (Qwen 3.5's layout)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    full = max(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    d = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    shapes = {f"mtp.layers.0.{k.split(f'layers.{full}.', 1)[1]}": v.shape
              for k, v in tensors.items() if f"layers.{full}." in k}
    shapes.update({"mtp.fc.weight": (d, 2 * d), "mtp.pre_fc_norm_embedding.weight": (d,),
                   "mtp.pre_fc_norm_hidden.weight": (d,), "mtp.norm.weight": (d,)})
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
        tensors[name] = (0.1 * noise if len(shape) == 1 else noise / max(1.0, shape[-1] ** 0.5)).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def _write_sentence_transformers_files(out: Path, hidden: int) -> None:
    """MiniLM's pooling setup (mean pooling + normalize), sized for the tiny hidden size."""
    from hf2q.fetch import MINILM, fetch

    src = fetch(MINILM)
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        if (src / name).exists():
            (out / name).write_bytes((src / name).read_bytes())
    pooling = json.loads((src / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = hidden
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")


def multimodal_gemma4() -> Path:
    """The dense tiny Gemma 4 in the layout of a multimodal Hub checkpoint (``Gemma4ForConditionalGeneration``).

    The text weights move under ``model.language_model.``, the config under ``text_config``, and a
    vision tower and its embedding projection appear beside them (a few random matrices: only
    their names matter, a text conversion must leave them out).
    """
    return build_once("tiny-gemma4_multimodal-v1", _build_multimodal_gemma4)


def _build_multimodal_gemma4(out: Path) -> None:
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = checkpoint("gemma4")
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    rng = np.random.default_rng(SEED)
    for name, shape in (("model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight", (32, 32)),
                        ("model.vision_tower.patch_embedder.input_proj.weight", (32, 48)),
                        ("model.embed_vision.embedding_projection.weight", (64, 32))):
        tensors[name] = rng.standard_normal(shape).astype(np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    text.pop("architectures", None)
    cfg = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
           "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32}, "tie_word_embeddings": True,
           "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy2(f, out / f.name)


# nomic-embed-text-v1.5 as nomic-ai publishes it: the Hub checkpoint runs custom code (``NomicBertModel``,
# ``auto_map``) whose config keys are GPT-2 style (n_embd, n_head, n_inner, n_positions, rotary_emb_base …)
# and whose tensors are fused (``encoder.layers.N.attn.Wqkv``, ``mlp.fc11`` up / ``fc12`` gate / ``fc2``,
# ``norm1``/``norm2``, ``emb_ln``). transformers' own ``nomic_bert`` saves other names (split q/k/v,
# ``layers.N.self_attn``, hidden_size …) and reads the Hub tensors only through its load-time renaming;
# llama.cpp's converter reads the Hub tensors. So the fixture is the Hub layout: transformers' initialisation
# of a small ``NomicBertConfig`` (+ ``_perturb``) saved under the Hub names, the Hub config's keys and values
# (n_positions 8192 with max_trained_positions 2048, as v1.5), MiniLM's WordPiece files (v1.5 uses
# bert-base-uncased's vocabulary, padded to 30528 rows) and mean pooling. hidden 64 ≠ ff 96 ≠ 2·ff.
# The config also carries transformers' names for the shape (hidden_size …): llama.cpp's converter loads the
# config through transformers' ``NomicBertConfig``, whose defaults (768 wide, 12 layers, 3072 ff) it prefers
# to the Hub keys — right for the real v1.5 by coincidence, a 12-block header over 2 blocks for a tiny one.
NOMIC_VERSION = "v1"
NOMIC_SHAPE = {"n_embd": 64, "n_head": 4, "n_inner": 96, "n_layer": 2, "vocab_size": 30528, "rotary_emb_base": 1000,
               "layer_norm_epsilon": 1e-12}
_NOMIC_TRANSFORMERS_KEYS = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
                            "num_hidden_layers": 2, "max_position_embeddings": 2048, "layer_norm_eps": 1e-12}


def nomic_bert() -> Path:
    """Path of the tiny nomic-embed-text-v1.5-shaped checkpoint (Hub layout; built on first use)."""
    return build_once(f"tiny-nomic_bert-{NOMIC_VERSION}", _build_nomic_bert)


def _build_nomic_bert(out: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    config = transformers.NomicBertConfig(vocab_size=NOMIC_SHAPE["vocab_size"], hidden_act="silu", type_vocab_size=2,
                                          pad_token_id=0, **_NOMIC_TRANSFORMERS_KEYS,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": float(NOMIC_SHAPE["rotary_emb_base"])})
    model = transformers.NomicBertModel(config).eval()
    _perturb(model, SEED + 1, 1.0, 2.0)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    hub = {"embeddings.word_embeddings.weight": sd["embeddings.word_embeddings.weight"],
           "embeddings.token_type_embeddings.weight": sd["embeddings.token_type_embeddings.weight"],
           "emb_ln.weight": sd["embeddings.LayerNorm.weight"], "emb_ln.bias": sd["embeddings.LayerNorm.bias"]}
    for i in range(NOMIC_SHAPE["n_layer"]):
        src, dst = f"layers.{i}.", f"encoder.layers.{i}."
        hub[dst + "attn.Wqkv.weight"] = torch.cat([sd[src + f"self_attn.{p}_proj.weight"] for p in "qkv"]).contiguous()
        hub[dst + "attn.out_proj.weight"] = sd[src + "self_attn.o_proj.weight"]
        hub[dst + "mlp.fc11.weight"] = sd[src + "mlp.up_proj.weight"]
        hub[dst + "mlp.fc12.weight"] = sd[src + "mlp.gate_proj.weight"]
        hub[dst + "mlp.fc2.weight"] = sd[src + "mlp.down_proj.weight"]
        for norm, ours in (("norm1", "post_attention_layernorm"), ("norm2", "post_mlp_layernorm")):
            hub[dst + norm + ".weight"] = sd[src + ours + ".weight"]
            hub[dst + norm + ".bias"] = sd[src + ours + ".bias"]
    save_file(hub, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", **NOMIC_SHAPE, **_NOMIC_TRANSFORMERS_KEYS,
           "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                        "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
           "activation_function": "swiglu", "attn_pdrop": 0.0, "bos_token_id": None, "causal": False,
           "dense_seq_output": True, "embd_pdrop": 0.0, "eos_token_id": None, "fused_bias_fc": True,
           "fused_dropout_add_ln": True, "initializer_range": 0.02, "max_trained_positions": 2048,
           "mlp_fc1_bias": False, "mlp_fc2_bias": False, "n_positions": 8192, "pad_vocab_size_multiple": 64,
           "parallel_block": False, "parallel_block_tied_norm": False, "prenorm": False, "qkv_proj_bias": False,
           "reorder_and_upcast_attn": False, "resid_pdrop": 0.0, "rotary_emb_fraction": 1.0,
           "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
           "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True, "torch_dtype": "float32",
           "type_vocab_size": 2, "use_cache": True, "use_flash_attn": True, "use_rms_norm": False,
           "use_xentropy": True}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    copy_tokenizer("bert", out)
    _write_sentence_transformers_files(out, NOMIC_SHAPE["n_embd"])
