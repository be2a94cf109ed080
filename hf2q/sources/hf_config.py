"""Reading and validating an HF model directory's ``config.json``.

Multimodal wrappers (Gemma 3 ``ForConditionalGeneration`` …) keep the language model's
hyper-parameters under ``text_config``; like llama.cpp's converter we lift them to the top
level so an architecture module sees one flat dict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf2q.errors import InputError


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
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: expected a JSON object")
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
