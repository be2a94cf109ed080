"""The Unigram (``t5``) tokenizer with its precompiled charsmap, against llama.cpp's own tokenizer.

Reference: stock ``llama-tokenize`` on the sdist's ``models/ggml-vocab-nomic-bert-moe.gguf`` (XLM-R's
250k-piece vocabulary and SentencePiece's NMT charsmap, as nomic-embed-text-v2-moe ships them), run on
the texts of llama.cpp's own tokenizer vectors and on generated text; plus hand-made charsmaps
built with the ``sentencepiece`` trainer (tests/models/nomic_moe.py), checked the same way.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf2q.errors import InputError
from hf2q.text.tokenizer import GGUFTokenizer

pytestmark = pytest.mark.llamacpp
VECTOR_SEPARATOR = "\n__ggml_vocab_test__\n"


def _models_dir() -> Path:
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    return fetch(LLAMA_CPP_SDIST) / "models"


def nomic_vocab() -> Path:
    return _models_dir() / "ggml-vocab-nomic-bert-moe.gguf"


@functools.cache
def _tokenizer(path: Path) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(path)


def llama_tokenize(path: Path, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
    """llama.cpp's ids for ``text`` (raw bytes on stdin: no escape processing)."""
    from tests.tools import llama_cpp

    args = [str(llama_cpp.tool("llama-tokenize")), "-m", str(path), "--stdin", "--no-escape", "--ids",
            "--log-disable"]
    args += [] if add_special else ["--no-bos"]
    args += [] if parse_special else ["--no-parse-special"]
    r = subprocess.run(args, input=text.encode(), env=llama_cpp.env(), capture_output=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr[-500:]
    return [int(t) for t in r.stdout.decode().strip().splitlines()[-1].strip("[]").split(",") if t.strip()]


SEPARATOR = "</s>"  # a special token: llama.cpp tokenizes the text on each side of it on its own


def llama_tokenize_each(path: Path, texts: list[str]) -> list[list[int]]:
    """llama.cpp's ids (no BOS/EOS) of each text, from one run over the texts joined by ``SEPARATOR``."""
    assert not any(SEPARATOR in t for t in texts)
    ids = llama_tokenize(path, SEPARATOR.join(texts), add_special=False)
    sep = _tokenizer(path).encode(SEPARATOR, add_special=False)
    assert len(sep) == 1
    out: list[list[int]] = [[]]
    for i in ids:
        if i == sep[0]:
            out.append([])
        else:
            out[-1].append(i)
    assert len(out) == len(texts)
    return out


def _check_each(path: Path, texts: list[str]) -> None:
    tok = _tokenizer(path)
    for text, theirs in zip(texts, llama_tokenize_each(path, texts)):
        assert tok.encode(text, add_special=False) == theirs, repr(text)


def _vector_texts() -> list[str]:
    """Every input of the sdist's tokenizer vectors (whitespace runs, CJK, emoji, accents, code …)."""
    texts = []
    for inp in sorted(_models_dir().glob("ggml-vocab-*.gguf.inp")):
        texts += inp.read_text(encoding="utf-8").split(VECTOR_SEPARATOR)
    return sorted({t for t in texts if t and SEPARATOR not in t})


EXTRA_TEXTS = ["Hello   World! ｈｅｌｌｏ ①②", "tab\there\nnewline\r\n", "<mask> and  <mask>x\t<mask>",
               "Ünïcödé café naïve Å Å", "\u00a0nbsp\u200bzero\u3000ideographic", "<s>special<pad><unk>",
               "[PAD250001] unused", "ﬁ ligature ㍻ ｶﾞ", "search_query: What is TSNE?", "  ", "\x00nul\x01ctl"]


def test_vectors_and_edge_texts_match_llama_tokenize(llama_cpp_bin):
    texts = _vector_texts() + EXTRA_TEXTS
    assert len(texts) > 40
    _check_each(nomic_vocab(), texts)


def test_bos_eos_and_unparsed_special_tokens(llama_cpp_bin):
    path = nomic_vocab()
    tok = _tokenizer(path)
    text = "<s>a</s> <mask> b x<unk>y  <mask>"
    assert tok.encode(text) == llama_tokenize(path, text)
    assert tok.encode(text, add_special=False, parse_special=False) == llama_tokenize(
        path, text, add_special=False, parse_special=False)
    assert 250001 in tok.encode(text) and 250001 not in tok.encode(text, parse_special=False)


_ALPHABET = st.sampled_from(list("aAzZ09 .,!?'-_\t\n") + ["  ", "ｈ", "①", "ﬁ", "é", "e\u0301", "Å", "日本", "中",
                                                          "🦙", "\u200b", "\u00a0", "\u3000", "ß", "İ", "<mask>",
                                                          "<pad>", "ｶﾞ", "\u0000", "Ω", "ǅ"])


_TEXT = st.lists(_ALPHABET | st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                 max_size=24).map("".join).filter(lambda t: SEPARATOR not in t)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_TEXT, min_size=40, max_size=60))
def test_generated_text_matches_llama_tokenize(llama_cpp_bin, texts):
    _check_each(nomic_vocab(), texts)


def test_decode_gives_the_pieces_back():
    tok = _tokenizer(nomic_vocab())
    ids = tok.encode("Hello   World! café", add_special=False)
    assert tok.decode(ids) == "Hello World! café"  # extra whitespace removed by the normaliser
    assert tok.decode(tok.encode("a b")) == "<s> a b</s>"  # after <s> the first word keeps its prefix space
    assert tok.decode(tok.encode("a b"), skip_special=True) == "a b"


def test_a_lone_surrogate_is_input_error():
    with pytest.raises(InputError, match="surrogate"):
        _tokenizer(nomic_vocab()).encode("a\ud800b")


def test_a_broken_charsmap_is_input_error():
    from hf2q.text.ugm import Charsmap

    with pytest.raises(InputError, match="precompiled_charsmap"):
        Charsmap(b"\x01\x00")
    with pytest.raises(InputError, match="precompiled_charsmap"):
        Charsmap((1000).to_bytes(4, "little") + b"\0" * 8)


def test_a_long_document_with_many_special_tokens_matches_llama_tokenize(llama_cpp_bin):
    """A 20 KB document (what a user embeds), cut by hundreds of special tokens: the partition is found in
    one pass over the text, and the ids are still llama.cpp's."""
    from hf2q.quality.corpus import load_corpus

    path = nomic_vocab()
    words = load_corpus("calibration").text[:20000].split(" ")
    doc = " ".join(w + ("<mask>" if i % 37 == 5 else "<pad>" if i % 53 == 7 else "") for i, w in enumerate(words))
    assert len(doc) > 20000 and doc.count("<mask>") > 50
    assert _tokenizer(path).encode(doc) == llama_tokenize(path, doc)


_UNICODE_DOC = st.lists(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
                        | st.sampled_from([" ", "  ", "\n", "<mask>", "<s>", "\u3000", "e\u0301"]),
                        min_size=20, max_size=80).map("".join).filter(lambda t: SEPARATOR not in t)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_UNICODE_DOC, min_size=8, max_size=12))
def test_random_unicode_documents_match_llama_tokenize(llama_cpp_bin, texts):
    """Any code point (not only the curated alphabet above), in documents of a few hundred characters."""
    _check_each(nomic_vocab(), texts)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=4), min_size=1, max_size=12),
       st.lists(st.binary(max_size=5), min_size=1, max_size=30))
def test_the_prefix_index_answers_as_a_scan_does(keys, probes):
    """The remembered answers (kept in a memory small enough to be dropped and refilled here) are the
    search's, and the memory never holds more than its limit."""
    from hf2q.text.ugm import _PrefixIndex

    index = _PrefixIndex(keys, memo_limit=3)
    for probe in probes + probes:
        assert index.extends(probe) == any(k.startswith(probe) for k in keys), probe
        assert index.extends.cache_info().currsize <= 3
    assert not hasattr(index, "_memo")  # the one memory is functools' cache


def test_the_prefix_index_keeps_its_recent_answers():
    """A word asked again after fewer distinct questions than the limit is answered from memory (the hand-rolled
    memory before it was dropped whole when full, so a document's common words were searched again)."""
    from hf2q.text.ugm import _PrefixIndex

    index = _PrefixIndex([b"the", b"cat"], memo_limit=4)
    for probe in (b"th", b"ca", b"x", b"y"):
        index.extends(probe)
    index.extends(b"th")  # recently used: stays
    index.extends(b"z")  # the limit reached: the least recently used answer (b"ca") goes, not all of them
    hits = index.extends.cache_info().hits
    assert index.extends(b"th") and index.extends.cache_info().hits == hits + 1
