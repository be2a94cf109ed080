"""Nomic-BERT MoE (nomic-embed-text-v2-moe layout): conversion, engine embeddings, preflight, serving.

References: llama.cpp's ``convert_hf_to_gguf.py`` (+ ``llama-quantize``) bytes on the tiny Hub-layout
checkpoint (``tests/models/nomic_moe.py``); a numpy encoder written from llama.cpp's graph
(``tests/nomic_moe_ref.py``); stock ``llama-embedding`` on the same GGUF; ``llama-tokenize`` for the
converted Unigram vocabulary; a real HTTP client for ``/v1/embeddings``.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess

import httpx
import numpy as np
import pytest

from tests.models.nomic_moe import nomic_moe
from tests.test_nomic_bert import assert_close_to_llama_embedding, converted_per_quant, cosines

TEXTS = ["search_query: What is TSNE?",
         "search_document: t-distributed stochastic neighbor embedding (t-SNE) is a statistical method for "
         "visualizing high-dimensional data.", "café naïve ｈｅｌｌｏ <mask> ①", "x"]
COS_TOL = 1e-4


@pytest.fixture(scope="module")
def moe_hf():
    return nomic_moe()


@pytest.fixture(scope="module")
def moe_gguf(moe_hf, tmp_path_factory):
    return converted_per_quant(moe_hf, tmp_path_factory, "nomic-moe")


@functools.cache
def _tokenizer(path):
    from hf2q.text.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(path)


@functools.cache
def _runner(path):
    from hf2q.engine.runner import MlxModelRunner

    return MlxModelRunner.load(path)


def _engine(path, texts, parse_special=True):
    ids = [_tokenizer(path).encode(t, parse_special=parse_special) for t in texts]
    return ids, np.asarray(_runner(path).embed(ids))


def _llamacpp_reference(src, quant, out_dir):
    """llama.cpp's GGUF: its converter's f16 (cached by test_llamacpp_parity), then ``llama-quantize``
    (run here: it prints the vocabulary's pieces cut mid-character, which a text pipe cannot decode)."""
    from tests.test_llamacpp_parity import llamacpp_reference
    from tests.tools import llama_cpp

    f16 = llamacpp_reference(src, "f16")
    if quant == "f16":
        return f16
    out = out_dir / f"llamacpp-{quant}.gguf"
    r = subprocess.run([str(llama_cpp.tool("llama-quantize")), str(f16), str(out), quant, "2"],
                       env=llama_cpp.env(), capture_output=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:].decode(errors="replace")
    return out


@pytest.mark.llamacpp
@pytest.mark.parametrize("quant", ["f16", "q8_0", "q4_k_m"])
def test_conversion_matches_llamacpp(quant, moe_hf, moe_gguf, llama_cpp_bin, tmp_path):
    from tests.test_llamacpp_parity import compare_gguf

    assert compare_gguf(moe_gguf(quant), _llamacpp_reference(moe_hf, quant, tmp_path)) == []


@pytest.mark.llamacpp
def test_converted_vocabulary_tokenizes_as_llama_cpp(moe_gguf, llama_cpp_bin):
    """The trained charsmap and pieces as written: our ids are llama-tokenize's on the same GGUF."""
    from tests.test_nomic_ugm import EXTRA_TEXTS, llama_tokenize_each

    path = moe_gguf("f16")
    tok = _tokenizer(path)
    texts = TEXTS[:3] + EXTRA_TEXTS[:8]
    for text, theirs in zip(texts, llama_tokenize_each(path, texts)):
        assert tok.encode(text, add_special=False) == theirs, repr(text)
    assert tok.encode("a <mask>")[-2] == 250001  # the nomic <mask>, stripping the space before it


@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_embeddings_match_the_graph_reference(quant, moe_gguf):
    from tests.nomic_moe_ref import NomicMoeReference

    ids, got = _engine(moe_gguf(quant), TEXTS)  # one padded batch of four lengths
    ref = NomicMoeReference(moe_gguf(quant))
    refs = np.array([ref.embed(t) for t in ids])
    assert np.all(cosines(got, refs) >= 1 - COS_TOL) and np.abs(got - refs).max() < 1e-4
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert float(got[0] @ got[1]) < 0.99  # different inputs give different vectors: the comparison has teeth
    # the same text alone and inside a padded batch: padding is masked out of attention, routing and the mean
    assert np.abs(_engine(moe_gguf(quant), TEXTS[2:3])[1][0] - got[2]).max() < 1e-5


class _CountingNumpy:
    """numpy, with its ``flatnonzero`` calls (how the MoE blocks read the padding mask back) counted."""

    def __init__(self):
        self.mask_reads = 0

    def __getattr__(self, name):
        return getattr(np, name)

    def flatnonzero(self, a):
        self.mask_reads += 1
        return np.flatnonzero(a)


@pytest.mark.parametrize("grouped", [True, False], ids=["cpu-grouped", "gather"])
def test_the_padding_mask_is_read_once_per_forward_and_only_where_used(grouped, moe_gguf, monkeypatch):
    """Four MoE blocks in one forward read the mask back once when the CPU groups tokens by expert, and not at
    all on the gather path (a GPU's) that has no use for it; the vectors are the unchanged model's."""
    from hf2q.engine.models import nomic_bert_moe

    path = moe_gguf("f16")
    model = _runner(path).model
    ids = [_tokenizer(path).encode(t) for t in TEXTS]
    kept = model.layers
    moe = [layer for layer in kept if isinstance(layer.mlp, nomic_bert_moe.ExpertMLP)]
    assert len(moe) == 1
    twice = np.asarray(_runner(path).embed(ids))
    counting = _CountingNumpy()
    monkeypatch.setattr(nomic_bert_moe, "np", counting)
    if not grouped:
        monkeypatch.setattr(nomic_bert_moe, "on_cpu", lambda: False)
    try:
        model.layers = kept * 4  # the same blocks four times over: four MoE blocks in each forward
        got = np.asarray(_runner(path).embed(ids))
    finally:
        model.layers = kept
    assert counting.mask_reads == (1 if grouped else 0)
    model.layers = kept * 4
    try:
        monkeypatch.undo()
        want = np.asarray(_runner(path).embed(ids))
    finally:
        model.layers = kept
    assert np.abs(got - want).max() < 1e-5 and np.abs(twice - got).max() > 1e-3  # four times over is another model


@pytest.mark.llamacpp
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_embeddings_match_llama_embedding(quant, moe_gguf, llama_cpp_bin):
    assert_close_to_llama_embedding(moe_gguf(quant), TEXTS, _engine(moe_gguf(quant), TEXTS)[1])


def test_info_reports_an_embedding_model(moe_gguf, cli):
    r = cli("info", moe_gguf("q8_0"), "--json")
    assert r.code == 0 and json.loads(r.out)["architecture"] == "nomic-bert-moe", r.err
    assert json.loads(r.out)["serve_support"] == "ready"


@pytest.mark.parametrize("key,value,words", [
    ("moe_top_k", 9, "moe_top_k"),
    ("activation_function", "swiglu", "activation_function"),
    ("n_positions", 8192, "n_positions"),
])
def test_unsupported_settings_are_refused(key, value, words, moe_hf, tmp_path, cli):
    src = tmp_path / "model"
    src.mkdir()
    for f in moe_hf.iterdir():
        if f.is_file():
            (src / f.name).symlink_to(f)
    cfg = json.loads((moe_hf / "config.json").read_text())
    cfg[key] = value
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps(cfg))
    r = cli("convert", src, "-q", "f16", "-o", tmp_path / "out.gguf", "--no-integrity")
    assert r.code == 3 and words in r.err and "Traceback" not in r.err, r.err


def test_a_missing_sentencepiece_model_is_refused(moe_hf, tmp_path, cli):
    """Without the SentencePiece model the fixture's tokenizer.json (transformers 5's Sequence normaliser)
    cannot be read as llama.cpp's converter reads one (tests/test_nomic_moe_tokenizer_json.py)."""
    src = tmp_path / "model"
    shutil.copytree(moe_hf, src, ignore=shutil.ignore_patterns("sentencepiece.bpe.model", "model.safetensors"))
    (src / "model.safetensors").symlink_to(moe_hf / "model.safetensors")
    r = cli("convert", src, "-q", "f16", "-o", tmp_path / "out.gguf", "--no-integrity")
    assert r.code == 3 and "sentencepiece.bpe.model" in r.err and "Precompiled" in r.err, r.err
    assert "Traceback" not in r.err


@pytest.mark.slow
def test_served_on_v1_embeddings(moe_gguf, smollm2_gguf, tmp_path):
    """``serve --embedding-model``: a real HTTP client gets the engine's vectors for the text it sent
    (special-token texts in an input are text, as for every embedding model)."""
    from tests.serve_support import chat_and_embedding_server

    path = moe_gguf("q8_0")
    ids, engine = _engine(path, TEXTS, parse_special=False)
    with chat_and_embedding_server(smollm2_gguf, path, tmp_path) as url:
        r = httpx.post(url + "/v1/embeddings", json={"model": path.stem, "input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    served = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float32)
    assert body["usage"]["prompt_tokens"] == sum(len(t) for t in ids)
    assert served.shape == engine.shape and np.abs(served - engine).max() < 1e-5
