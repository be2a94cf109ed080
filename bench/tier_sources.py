"""Checkpoints for the tier measurements (bench/tiers.py), built from the SmolLM2 test checkpoint.

The test checkpoint is a dequantised Q4_1 GGUF, so every weight already lies on a Q4_1 grid and
any plan that keeps Q4_1 looks lossless. Two derived checkpoints make the comparison fair:

* ``off_grid``: every 2-D weight plus Gaussian noise of ``noise`` × the tensor's standard deviation
  (fixed seed), which takes the weights off every quantization grid while keeping a trained model's
  statistics (outlier columns, per-layer scales).
* ``upcycled_moe``: the model as a ``qwen3_moe`` — no real mixture-of-experts checkpoint is at hand.
  Each layer's dense FFN becomes ``n_expert`` experts, each a copy of it with its own noise (as
  ``off_grid``), and a random router picks ``top_k`` of them per token (normalised weights), so the
  output stays near the dense one. The experts are trained weights, routing is real and each expert
  sees only part of the tokens, but the experts are near-copies rather than specialists: what it
  measures is how a tier spends bits between routed experts, attention and embeddings, not how a
  real MoE's rarely used experts behave. (Cutting the FFN into slices instead, one per expert, loses
  too much when a token skips some: perplexity in the tens of thousands.) Qwen3's attention
  normalises q and k per head; the norms' weights are set to the mean per-head RMS the dense model
  produces on calibration text, which keeps the attention logits' scale on average (perplexity on an
  English text 18.8 → 126 from that alone; each model is scored against its own F16).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

ROUTER_LOGIT_STD = 0.5
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _noised(tensors: dict[str, np.ndarray], noise: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(tensors):
        x = tensors[name]
        if x.ndim == 2 and noise > 0:
            x = (x + rng.standard_normal(x.shape, dtype=np.float32) * (noise * float(x.std()))).astype(np.float32)
        out[name] = x
    return out


def _load(src: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(str(src / "model.safetensors")).items()}


def _copy_side_files(src: Path, out: Path) -> None:
    for name in COPIED:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


def off_grid(src: Path, out: Path, noise: float = 0.1, seed: int = 0) -> Path:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(_noised(_load(src), noise, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", out / "config.json")
    _copy_side_files(src, out)
    return out


def _qk_rms(src: Path, text: str, n_tokens: int = 512) -> list[tuple[float, float]]:
    """Per layer, the mean RMS of one head's query and key vector on ``text`` (the dense model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    head_dim = model.config.head_dim
    ids = tok(text, return_tensors="pt").input_ids[:, :n_tokens]
    seen: dict[tuple[int, str], float] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for key in ("q_proj", "k_proj"):
            def hook(_m, _inp, y, i=i, key=key):
                h = y.reshape(-1, head_dim)
                seen[(i, key)] = float(h.pow(2).mean(-1).sqrt().mean())
            hooks.append(getattr(layer.self_attn, key).register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return [(seen[(i, "q_proj")], seen[(i, "k_proj")]) for i in range(len(model.model.layers))]


def upcycled_moe(src: Path, out: Path, calibration_text: str, n_expert: int = 4, top_k: int = 2,
                 noise: float = 0.1, seed: int = 0) -> Path:
    from safetensors.numpy import save_file

    cfg = json.loads((src / "config.json").read_text())
    hidden, n_layer = cfg["hidden_size"], cfg["num_hidden_layers"]
    qk = _qk_rms(src, calibration_text)
    dense = _load(src)
    w = _noised(dense, noise, seed)
    rng = np.random.default_rng(seed + 1)
    t = {name: x for name, x in w.items() if ".mlp." not in name}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        copies = [_noised({k: dense[f"{p}mlp.{k}_proj.weight"] for k in ("gate", "up", "down")}, noise, seed + 2 + e)
                  for e in range(n_expert)]
        t[f"{p}mlp.experts.gate_up_proj"] = np.stack([np.concatenate([c["gate"], c["up"]], 0) for c in copies])
        t[f"{p}mlp.experts.down_proj"] = np.stack([c["down"] for c in copies])
        # router logits of standard deviation ~ROUTER_LOGIT_STD: which experts a token takes varies by token
        g = w[f"{p}post_attention_layernorm.weight"]
        scale = ROUTER_LOGIT_STD / (np.sqrt(hidden) * float(np.sqrt((g ** 2).mean())))
        router = rng.standard_normal((n_expert, hidden), dtype=np.float32) * scale
        t[f"{p}mlp.gate.weight"] = router.astype(np.float32)
        q_rms, k_rms = qk[i]
        t[f"{p}self_attn.q_norm.weight"] = np.full(cfg["head_dim"], q_rms, np.float32)
        t[f"{p}self_attn.k_norm.weight"] = np.full(cfg["head_dim"], k_rms, np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    moe = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                               "head_dim", "max_position_embeddings", "rms_norm_eps", "vocab_size",
                               "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_parameters",
                               "rope_theta")}
    moe.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
                "intermediate_size": cfg["intermediate_size"], "moe_intermediate_size": cfg["intermediate_size"],
                "num_experts": n_expert, "num_local_experts": n_expert, "num_experts_per_tok": top_k,
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
                "dtype": "float32"})
    (out / "config.json").write_text(json.dumps(moe, indent=2))
    _copy_side_files(src, out)
    return out
