"""``hf2q gguf-patch --chat-template-name``: llama.cpp's official templates by name, embedded byte for byte."""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFReader, Keys

from hf2q.fetch import LLAMA_CPP_SDIST, fetch
from tests.test_gguf_patch import _small_gguf


def _template(path: Path) -> str:
    f = GGUFReader(path).fields[Keys.Tokenizer.CHAT_TEMPLATE]
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def test_an_official_template_by_name_is_embedded_as_llama_cpp_ships_it(tmp_path, cli):
    src = tmp_path / "m.gguf"
    _small_gguf(src)
    shipped = fetch(LLAMA_CPP_SDIST) / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"
    r = cli("gguf-patch", src, "-o", tmp_path / "out.gguf", "--chat-template-name", "Qwen-Qwen3-0.6B")
    assert r.code == 0, r.err
    assert _template(tmp_path / "out.gguf") == shipped.read_text(encoding="utf-8")
    listed = cli("gguf-patch", "--list-chat-templates")
    assert listed.code == 0 and "Qwen-Qwen3-0.6B" in listed.out.split() and len(listed.out.split()) > 20


def test_an_unknown_name_is_one_line_exit_3_with_a_suggestion(tmp_path, cli):
    src = tmp_path / "m.gguf"
    _small_gguf(src)
    r = cli("gguf-patch", src, "--chat-template-name", "Qwen-Qwen3-0.6")
    assert r.code == 3 and "Qwen-Qwen3-0.6B" in r.err and len(r.err.strip().splitlines()) == 1
    assert cli("gguf-patch", src, "--chat-template-name", "x", "--chat-template", "t.jinja").code == 2
    assert cli("gguf-patch").code == 2
