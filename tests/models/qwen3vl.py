"""Tiny random Qwen3-VL checkpoints (dense ``Qwen3VLForConditionalGeneration`` and the MoE variant).

Shaped like Qwen3-VL-2B/-30B-A3B as the Hub publishes them: the language model under
``model.language_model.``, the vision tower under ``model.visual.`` (Conv3D patch embedding with a
temporal patch of 2, learned position embedding on a square grid, blocks, a 2×2 merger and
deepstack mergers), ``lm_head`` untied, interleaved M-RoPE sections in ``rope_parameters`` (and the
Hub's older ``rope_scaling`` + ``rope_theta`` keys), a ``preprocessor_config.json`` with the image
mean/std, and Qwen3's real tokenizer (its vision marker tokens included).

MoE experts: transformers keeps them as ``gate_up_proj [E, 2·ff, d]`` / ``down_proj [E, d, ff]``
in memory, but the Hub checkpoints (and so llama.cpp's converter, which transposes on read) hold
``gate_up_proj [E, d, 2·ff]`` / ``down_proj [E, ff, d]``. The fixture is written in the Hub layout,
with d (64) ≠ 2·ff (96) ≠ ff (48) so that reading one layout as the other cannot pass silently.

Weights: transformers' initialisation under a fixed seed, then ``tests.models.tiny._perturb``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.models.cache import build_once
from tests.models.tokenizer_files import copy_tokenizer, vocab_size

VERSION = "v1"
SEED = 0
SHAPES = ("qwen3vl", "qwen3vl_moe")

# 16 rotary pairs per 32-wide head, split t/h/w as the real 24/20/20 of 64 pairs
MROPE_SECTION = [6, 5, 5]
ROPE_THETA = 5000000.0
_TEXT = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
         "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
         "bos_token_id": 151643, "eos_token_id": 151645,
         "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": MROPE_SECTION,
                             "mrope_interleaved": True}}
_MOE = {"moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True}
# depth 3 with deepstack features from blocks 0 and 2; an 8×8 position grid (image_size 128)
_VISION = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "in_channels": 3, "patch_size": 16,
           "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, "num_position_embeddings": 64,
           "deepstack_visual_indexes": [0, 2], "hidden_act": "gelu_pytorch_tanh"}
# Qwen3-VL's preprocessor_config.json, with its values
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                "do_rescale": True, "do_normalize": True, "do_resize": True, "do_convert_rgb": True,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 0.00392156862745098,
                "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                "size": {"longest_edge": 16777216, "shortest_edge": 65536}}


def checkpoint(shape: str = "qwen3vl") -> Path:
    """Path of the tiny ``shape`` checkpoint (built on first use, then reused)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown Qwen3-VL shape {shape!r}; known: {', '.join(SHAPES)}")
    return build_once(f"tiny-{shape}-{VERSION}", lambda out: _build(shape, out))


def text_spec(shape: str = "qwen3vl") -> dict:
    return {**_TEXT, **(_MOE if shape == "qwen3vl_moe" else {}), "vocab_size": vocab_size("qwen3")}


def vision_spec() -> dict:
    return dict(_VISION)


def _build(shape: str, out: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    from tests.models.tiny import _perturb

    moe = shape == "qwen3vl_moe"
    text = text_spec(shape)
    if moe:
        config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=_VISION, tie_word_embeddings=False)
        model_cls = transformers.Qwen3VLMoeForConditionalGeneration
    else:
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=_VISION, tie_word_embeddings=False)
        model_cls = transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(SEED)
    model = model_cls(config).eval()
    _perturb(model, SEED + 1, 5.0, 3.0)
    tensors = {}
    for name, t in model.state_dict().items():
        if moe and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            t = t.transpose(1, 2)  # the Hub layout: [E, d, 2·ff] and [E, ff, d]
        tensors[name] = t.detach().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["architectures"] = [model_cls.__name__]
    cfg["torch_dtype"] = "float32"
    tc = cfg["text_config"]
    for sub in (tc, cfg["vision_config"]):  # to_dict's nulls; the Hub's sub-configs have no architectures
        sub.pop("architectures", None)
    # the Hub configs' spelling (transformers 4.57), read by llama.cpp's converter and older tools
    tc["rope_theta"] = ROPE_THETA
    tc["rope_scaling"] = {"rope_type": "default", "mrope_section": MROPE_SECTION, "mrope_interleaved": True}
    if moe:
        tc["num_experts"] = _MOE["num_experts"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2, sort_keys=True) + "\n")
    copy_tokenizer("qwen3", out)


def f32_gguf(shape: str = "qwen3vl") -> Path:
    """``hf2q convert --quant f32`` of the tiny ``shape`` (the engine tests' model; built once)."""
    return build_once(f"tiny-{shape}-{VERSION}-f32-v1", lambda out: _convert_f32(shape, out)) / "model.gguf"


def _convert_f32(shape: str, out: Path) -> None:
    from hf2q.cli import main

    if main(["convert", str(checkpoint(shape)), "--quant", "f32", "-o", str(out / "model.gguf"), "--no-integrity"]):
        raise RuntimeError(f"hf2q convert of the tiny {shape} checkpoint failed")


def per_expert_checkpoint() -> Path:
    """The MoE checkpoint with one 2-D tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``),
    the other layout llama.cpp's converter reads for this family."""
    return build_once(f"tiny-qwen3vl_moe_per_expert-{VERSION}", _build_per_expert)


def _build_per_expert(out: Path) -> None:
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = checkpoint("qwen3vl_moe")
    tensors = load_file(str(src / "model.safetensors"))
    ff = _MOE["moe_intermediate_size"]
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        gate_up, down = tensors.pop(name), tensors.pop(prefix + "down_proj")  # [E, d, 2ff], [E, ff, d]
        for e in range(gate_up.shape[0]):
            tensors[f"{prefix}{e}.gate_proj.weight"] = np.ascontiguousarray(gate_up[e, :, :ff].T)
            tensors[f"{prefix}{e}.up_proj.weight"] = np.ascontiguousarray(gate_up[e, :, ff:].T)
            tensors[f"{prefix}{e}.down_proj.weight"] = np.ascontiguousarray(down[e].T)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
