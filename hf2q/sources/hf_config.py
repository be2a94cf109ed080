"""Reading and validating an HF model directory's ``config.json``.

Multimodal wrappers (Gemma 3 ``ForConditionalGeneration`` …) keep the language model's
hyper-parameters under ``text_config``; like llama.cpp's converter we lift them to the top
level so an architecture module sees one flat dict.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hf2q.errors import InputError


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object; any problem is a one-line ``InputError``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object")
    return data


def load_config(src: Path) -> dict[str, Any]:
    """Parse ``src/config.json`` into a flat dict; any problem is a one-line ``InputError``."""
    src = Path(src)
    if not src.exists():
        raise InputError(f"{src}: no such directory")
    if not src.is_dir():
        raise InputError(f"{src}: expected an HF model directory (config.json + *.safetensors)")
    path = src / "config.json"
    if not path.is_file():
        raise InputError(f"{src}: missing config.json (not an HF model directory?)")
    cfg = read_json_object(path)
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    return cfg


def architecture_name(cfg: dict[str, Any]) -> str:
    """The first entry of ``architectures`` (what HF uses to pick the model class)."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise InputError("config.json has no 'architectures' list; cannot tell which model family this is")
    return archs[0]


def require(cfg: dict[str, Any], *keys: str, kind: type | tuple = (int, float)) -> Any:
    """The first present key among ``keys`` (HF spells some hyper-parameters several ways)."""
    for k in keys:
        if k in cfg and cfg[k] is not None:
            v = cfg[k]
            if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
                raise InputError(f"config.json: {k} has type {type(v).__name__}, expected a number")
            return v
    raise InputError(f"config.json: missing {' / '.join(keys)}")


def optional(cfg: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


# --------------------------------------------------------------------------- value checks
# sizes and counts: a whole number ≥ 1 (GGUF stores them as u32); the first group also ≥ 0 where 0 means "none"
_COUNTS = ("num_hidden_layers", "n_layers", "n_layer", "num_layers", "hidden_size", "n_embd", "intermediate_size",
           "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "n_kv_heads", "head_dim",
           "global_head_dim", "num_global_key_value_heads", "vocab_size", "max_position_embeddings",
           "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "sliding_window",
           "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim", "full_attention_interval")
_COUNTS_OR_ZERO = ("num_local_experts", "num_experts", "n_routed_experts", "num_kv_shared_layers",
                   "hidden_size_per_layer_input", "mtp_num_hidden_layers", "type_vocab_size")
# real numbers > 0 (rope bases, scaling factors) and ≥ 0 (epsilons, soft caps)
_POSITIVE_REALS = ("rope_theta", "rope_local_base_freq", "rope_global_theta", "rotary_emb_base", "local_rope_theta",
                   "swa_rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
                   "high_freq_factor", "partial_rotary_factor")
_REALS = ("rms_norm_eps", "norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon",
          "final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar")
_U32_MAX = 2**32 - 1


def check_values(cfg: dict[str, Any]) -> None:
    """Refuse hyper-parameters of the wrong type or range before any of them sizes a tensor or a loop.

    Families read sizes with ``int(…)``, which would turn ``"64"`` into 64 and let 0 or -64 reach
    a reshape; one line naming the key is the useful answer instead."""
    for key in _COUNTS + _COUNTS_OR_ZERO:
        v = cfg.get(key)
        if v is None:
            continue
        low = 1 if key in _COUNTS else 0
        if not _is_int(v) or not low <= v <= _U32_MAX:
            raise InputError(f"config.json: {key} is {_shown(v)}; expected a whole number ≥ {low}")
    _check_reals(cfg, "")
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise InputError(f"config.json: {key} is {_shown(rope)}; expected an object")
        _check_reals(rope, f"{key}.")
        for sub in ("full_attention", "sliding_attention"):
            if sub in rope:
                if not isinstance(rope[sub], dict):
                    raise InputError(f"config.json: {key}.{sub} is {_shown(rope[sub])}; expected an object")
                _check_reals(rope[sub], f"{key}.{sub}.")


def _check_reals(d: dict[str, Any], where: str) -> None:
    for key in _POSITIVE_REALS + _REALS:
        v = d.get(key)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or (v <= 0 if key in _POSITIVE_REALS else v < 0):
            want = "a number > 0" if key in _POSITIVE_REALS else "a number ≥ 0"
            raise InputError(f"config.json: {where}{key} is {_shown(v)}; expected {want}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (str, int, float, bool, type(None))) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."
