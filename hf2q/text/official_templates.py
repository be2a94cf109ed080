"""The official chat templates llama.cpp ships (its ``models/templates/*.jinja``), by name.

They come with the llama.cpp source that hf2q fetches from PyPI (the llama-cpp-python sdist, cached once), so a user
can embed a model vendor's own template into a GGUF (``hf2q gguf-patch --chat-template-name``) and a converter can
fall back to it when a checkpoint carries none. This module is the one reader of that folder.
"""

from __future__ import annotations

from pathlib import Path

from hf2q.errors import InputError, did_you_mean


def templates_dir() -> Path:
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    return fetch(LLAMA_CPP_SDIST) / "models" / "templates"


def template_names() -> list[str]:
    return sorted(p.stem for p in templates_dir().glob("*.jinja"))


def official_template(name: str) -> str:
    """The template text of ``name`` (a file stem such as ``Qwen-Qwen3-0.6B``; ``.jinja`` may be given)."""
    stem = name[:-len(".jinja")] if name.endswith(".jinja") else name
    path = templates_dir() / f"{stem}.jinja"
    if "/" in stem or not path.is_file():
        names = template_names()
        raise InputError(f"no official chat template named {name!r}" + did_you_mean(stem, names)
                         + f" ({len(names)} names: hf2q gguf-patch --list-chat-templates)")
    return path.read_text(encoding="utf-8")
