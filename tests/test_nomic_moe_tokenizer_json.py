"""nomic-bert-moe from a checkpoint with ``tokenizer.json`` and no ``sentencepiece.bpe.model``.

References: llama.cpp's converter (which reads that file through transformers) and ``llama-quantize`` bytes;
``llama-tokenize`` on the converted vocabulary.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.models.nomic_moe import nomic_moe_tokenizer_json_only
from tests.test_nomic_bert import converted_per_quant


@pytest.fixture(scope="module")
def tokjson_hf():
    """The checkpoint (built once, cached across runs)."""
    return nomic_moe_tokenizer_json_only()


@pytest.fixture(scope="module")
def tokjson_gguf(tmp_path_factory):
    """``get(TYPE)``: our conversion of it, once per type."""
    return converted_per_quant(nomic_moe_tokenizer_json_only(), tmp_path_factory, "nomic-moe-tokjson")


@pytest.mark.llamacpp
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_conversion_matches_llamacpp(quant, tokjson_hf, tokjson_gguf, llama_cpp_bin, tmp_path):
    from tests.test_llamacpp_parity import compare_gguf
    from tests.test_nomic_moe import _llamacpp_reference

    assert compare_gguf(tokjson_gguf(quant), _llamacpp_reference(tokjson_hf, quant, tmp_path)) == []


@pytest.mark.llamacpp
def test_vocabulary_from_tokenizer_json_tokenizes_as_llama_cpp(tokjson_gguf, llama_cpp_bin):
    from hf2q.text.tokenizer import GGUFTokenizer
    from tests.test_nomic_moe import TEXTS
    from tests.test_nomic_ugm import EXTRA_TEXTS, llama_tokenize_each

    path = tokjson_gguf("f16")
    tok = GGUFTokenizer.from_gguf(path)
    texts = TEXTS[:3] + EXTRA_TEXTS[:6]
    for text, theirs in zip(texts, llama_tokenize_each(path, texts)):
        assert tok.encode(text, add_special=False) == theirs, repr(text)
    assert tok.encode("a <mask>")[-2] == 401  # tokenizer.json's own <mask> id, not the sentencepiece layout's


def _variant(src, tmp_path, edit):
    out = tmp_path / "model"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    tj = json.loads((src / "tokenizer.json").read_text())
    edit(tj)
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


@pytest.mark.parametrize("edit,words", [
    (lambda tj: tj.update(normalizer={"type": "Sequence", "normalizers": [tj["normalizer"]]}), "Sequence"),
    (lambda tj: tj.update(normalizer=None), "missing"),
    (lambda tj: tj["normalizer"].update(precompiled_charsmap="not base64!"), "base64"),
    (lambda tj: tj["model"].update(type="BPE"), "Unigram"),
    (lambda tj: tj["model"]["vocab"].__setitem__(5, ["x", "high"]), "[piece, score]"),
])
def test_unreadable_tokenizer_json_is_refused(edit, words, tokjson_hf, tmp_path, cli):
    """llama.cpp's converter reads only a top-level Precompiled normaliser (it fails with a KeyError
    otherwise); we refuse the same files with one line naming the file."""
    src = _variant(tokjson_hf, tmp_path, edit)
    r = cli("convert", src, "-q", "f16", "-o", tmp_path / "out.gguf", "--no-integrity")
    assert r.code == 3 and words in r.err and "tokenizer.json" in r.err and "Traceback" not in r.err, r.err


def test_no_tokenizer_file_at_all_is_refused(tokjson_hf, tmp_path, cli):
    src = tmp_path / "model"
    shutil.copytree(tokjson_hf, src, symlinks=True, ignore=shutil.ignore_patterns("tokenizer.json"))
    r = cli("convert", src, "-q", "f16", "-o", tmp_path / "out.gguf", "--no-integrity")
    assert r.code == 3 and "tokenizer.json" in r.err and "Traceback" not in r.err, r.err
