"""Tiny Gemma 4 GGUFs that serve like the real ones: the tiny random ``gemma4`` checkpoints (their tokenizer is
Gemma 4's own and their chat template the official ``google-gemma-4-31B-it.jinja``) converted by ``hf2q convert``
to F16. The server reads Gemma 4's tool-call syntax and thought channel from the template. Built once under
``<hf2q cache>/test-models/``.
"""

from __future__ import annotations

from pathlib import Path

from tests.models.cache import build_once
from tests.models.tiny import VERSIONS, checkpoint

FILE = "model.gguf"


def gemma4_chat_gguf(family: str = "gemma4") -> Path:
    """Path of the tiny ``family`` (``gemma4``, ``gemma4_e2b``, ``gemma4_moe``) F16 GGUF."""
    return build_once(f"tiny-{family}-{VERSIONS[family]}-f16-v1", lambda out: _build(family, out)) / FILE


def _build(family: str, out: Path) -> None:
    from hf2q.cli import main

    code = main(["convert", str(checkpoint(family)), "--quant", "f16", "-o", str(out / FILE), "--no-integrity"])
    if code != 0:
        raise RuntimeError(f"hf2q convert of the tiny {family} checkpoint failed ({code})")
