"""Sentence-transformers pooling mode → ``{arch}.pooling_type`` (as llama.cpp's converter reads it).

An embedding model's pooling lives in ``modules.json`` → ``<path>/config.json``; llama.cpp
needs it in the GGUF to pool token states into one vector.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys

_MODES = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS, "lasttoken": gguf.PoolingType.LAST}


def pooling_type(src: Path) -> gguf.PoolingType | None:
    modules = src / "modules.json"
    if not modules.is_file():
        return None
    try:
        mods = json.loads(modules.read_text(encoding="utf-8"))
        path = next((m["path"] for m in mods if str(m.get("type", "")).endswith("Pooling")), None)
        if path is None:
            return None
        pooling = json.loads((src / path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{modules}: cannot read the pooling configuration ({e})") from None
    if pooling.get("pooling_mode_mean_tokens"):
        return gguf.PoolingType.MEAN
    if pooling.get("pooling_mode_cls_token"):
        return gguf.PoolingType.CLS
    if pooling.get("pooling_mode_lasttoken"):
        return gguf.PoolingType.LAST
    if pooling.get("pooling_mode") in _MODES:
        return _MODES[pooling["pooling_mode"]]
    raise InputError(f"{src / path / 'config.json'}: only mean, cls and last-token pooling are supported")


def add_pooling_type(src: Path, cfg: dict[str, Any], md, arch: str) -> None:
    if (p := pooling_type(src)) is not None:
        md.u32(Keys.LLM.POOLING_TYPE.format(arch=arch), int(p))
