"""HF ``architectures`` name → family class. Adding a family = one module listed in ``FAMILIES``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf2q.arch.base import Family
from hf2q.arch.bert import Bert, NomicBert, NomicBertMoe
from hf2q.arch.deepseek4 import DeepSeek4
from hf2q.arch.gemma3 import Gemma3
from hf2q.arch.gemma4 import Gemma4
from hf2q.arch.llama import Llama
from hf2q.arch.qwen3 import Qwen3
from hf2q.arch.qwen3_moe import Qwen3Moe
from hf2q.arch.qwen35 import Qwen35, Qwen35Moe
from hf2q.arch.qwen3vl import Qwen3VL, Qwen3VLMoe
from hf2q.errors import InputError
from hf2q.sources.hf_config import architecture_name

FAMILIES: tuple[type[Family], ...] = (Llama, Qwen3, Qwen3Moe, Qwen35, Qwen35Moe, Qwen3VL, Qwen3VLMoe, Gemma3, Gemma4,
                                      DeepSeek4, Bert,
                                      NomicBert, NomicBertMoe)


def supported_architectures() -> list[str]:
    return sorted(a for f in FAMILIES for a in f.hf_architectures)


def family_class(hf_arch: str) -> type[Family]:
    for fam in FAMILIES:
        if hf_arch in fam.hf_architectures:
            return fam
    raise InputError(f"unsupported architecture {hf_arch!r}; supported: {', '.join(supported_architectures())}")


def family_for(cfg: dict[str, Any], src: Path, mtp: str = "keep") -> Family:
    return family_class(architecture_name(cfg))(cfg, src, mtp=mtp)
