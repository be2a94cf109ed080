"""Nomic-BERT (nomic-embed-text v1.5 layout): conversion, engine embeddings, preflight.

References: llama.cpp's ``convert_hf_to_gguf.py`` (+ ``llama-quantize``) bytes on the tiny Hub-layout
checkpoint (``tests/models/tiny.nomic_bert``); transformers' ``NomicBertModel`` (mean pooling, L2 norm,
as sentence-transformers does for v1.5) and its WordPiece tokenizer; stock ``llama-embedding`` on the
same GGUF.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from tests.models.tiny import nomic_bert

TEXTS = ["search_query: What is TSNE?",
         "search_document: t-distributed stochastic neighbor embedding (t-SNE) is a statistical method for "
         "visualizing high-dimensional data by giving each datapoint a location in a two or three-dimensional map.",
         "search_document: A man is eating food.", "x"]
COS_TOL = 1e-4


@pytest.fixture(scope="module")
def nomic_hf():
    return nomic_bert()


def converted_per_quant(src, tmp_path_factory, stem: str):
    """``get(TYPE)``: the path of ``hf2q convert -q TYPE`` of ``src``, converted once per type."""
    from hf2q.cli import main

    made = {}

    def get(quant: str):
        if quant not in made:
            out = tmp_path_factory.mktemp(stem) / f"{stem}-{quant}.gguf"
            assert main(["convert", str(src), "-q", quant, "-o", str(out), "--no-integrity"]) == 0
            made[quant] = out
        return made[quant]

    return get


@pytest.fixture(scope="module")
def nomic_gguf(nomic_hf, tmp_path_factory):
    return converted_per_quant(nomic_hf, tmp_path_factory, "nomic")


def _engine(path, texts):
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.text.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(path)
    ids = [tok.encode(t) for t in texts]
    return ids, np.asarray(MlxModelRunner.load(path).embed(ids))


def cosines(a, b):
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.llamacpp
@pytest.mark.parametrize("quant", ["f32", "f16", "bf16", "q8_0", "q4_k_m"])
def test_conversion_matches_llamacpp(quant, nomic_hf, nomic_gguf, llama_cpp_bin):
    from tests.test_llamacpp_parity import compare_gguf, llamacpp_reference

    assert compare_gguf(nomic_gguf(quant), llamacpp_reference(nomic_hf, quant)) == []


def test_embeddings_match_transformers(nomic_hf, nomic_gguf):
    import torch
    import transformers

    ids, got = _engine(nomic_gguf("f32"), TEXTS)  # one padded batch of four lengths
    hf_tok = transformers.AutoTokenizer.from_pretrained(nomic_hf)
    model = transformers.AutoModel.from_pretrained(nomic_hf, dtype=torch.float32).eval()
    assert type(model).__name__ == "NomicBertModel"
    refs = []
    for text, ours in zip(TEXTS, ids):
        enc = hf_tok(text, return_tensors="pt")
        assert enc["input_ids"][0].tolist() == ours
        with torch.no_grad():
            h = model(**enc).last_hidden_state[0].mean(0)
        refs.append((h / h.norm()).numpy())
    refs = np.array(refs)
    assert np.all(cosines(got, refs) >= 1 - COS_TOL)
    assert np.abs(got - refs).max() < 1e-4
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert float(got[0] @ got[2]) < 0.99  # the inputs give different vectors: the comparison has teeth
    # the same text alone and inside a padded batch: padding is masked out of attention and the mean
    assert np.abs(_engine(nomic_gguf("f32"), TEXTS[2:3])[1][0] - got[2]).max() < 1e-5


def test_a_large_batch_comes_back_in_input_order(nomic_gguf):
    """More inputs than one padded group, lengths interleaved: each vector is its own text's."""
    from hf2q.engine.models.bert import GROUP_ROWS

    texts = [TEXTS[i % len(TEXTS)] + " again" * (i % 7) for i in range(GROUP_ROWS + 9)]
    _, together = _engine(nomic_gguf("f32"), texts)
    _, alone = _engine(nomic_gguf("f32"), texts[:1] + texts[GROUP_ROWS + 8:])
    assert np.abs(together[0] - alone[0]).max() < 1e-5 and np.abs(together[-1] - alone[1]).max() < 1e-5
    distinct = {t: v for t, v in zip(texts, together)}
    for text, vec in zip(texts, together):
        assert np.abs(vec - distinct[text]).max() < 1e-5


def llama_embedding(path, texts) -> np.ndarray:
    """Stock ``llama-embedding``'s L2-normalised vectors of ``texts`` (one per line), one thread."""
    from tests.tools import llama_cpp

    r = subprocess.run([str(llama_cpp.tool("llama-embedding")), "-m", str(path), "-p", "\n".join(texts), "-t", "1",
                        "--embd-normalize", "2", "--embd-output-format", "json"],
                       env={**llama_cpp.env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
                       check=False, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    return np.array([d["embedding"] for d in sorted(json.loads(r.stdout)["data"], key=lambda d: d["index"])])


def assert_close_to_llama_embedding(path, texts, got: np.ndarray) -> None:
    theirs = llama_embedding(path, texts)
    assert theirs.shape == got.shape
    assert np.all(cosines(got, theirs) >= 1 - COS_TOL), cosines(got, theirs)


@pytest.mark.llamacpp
@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_embeddings_match_llama_embedding(quant, nomic_gguf, llama_cpp_bin):
    path = nomic_gguf(quant)
    assert_close_to_llama_embedding(path, TEXTS, _engine(path, TEXTS)[1])


def test_info_reports_an_embedding_model(nomic_gguf, cli):
    r = cli("info", nomic_gguf("f16"), "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    assert info["serve_support"] == "ready" and info["architecture"] == "nomic-bert"


def test_preflight_refuses_a_missing_tensor(nomic_gguf, tmp_path):
    """A nomic-bert GGUF without a block's fused QKV is refused by name, before any weight is read."""
    import gguf as ggufpy

    from hf2q.formats.gguf_check import problem
    from hf2q.formats.gguf_file import open_gguf

    src = ggufpy.GGUFReader(nomic_gguf("f32"))
    out = tmp_path / "broken.gguf"
    w = ggufpy.GGUFWriter(out, "nomic-bert")
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in src.tensors:
        if t.name != "blk.1.attn_qkv.weight":
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert problem(open_gguf(nomic_gguf("f32"))) is None
    why = problem(open_gguf(out))
    assert why is not None and "blk.1.attn_qkv.weight" in why


@pytest.mark.parametrize("key,value,words", [
    ("prenorm", True, "prenorm"),
    ("rotary_emb_fraction", 0.5, "rotary_emb_fraction"),
    ("moe_every_n_layers", 2, "nomic-bert-moe"),
    ("n_positions", 4096, "n_positions"),
])
def test_unsupported_settings_are_refused(key, value, words, nomic_hf, tmp_path, cli):
    src = tmp_path / "model"
    shutil.copytree(nomic_hf, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))
    r = cli("convert", src, "-q", "f16", "-o", tmp_path / "out.gguf", "--no-integrity")
    assert r.code == 3 and words in r.err and "Traceback" not in r.err, r.err


def test_tensor_parallelism_refuses_nomic_as_an_encoder(nomic_gguf):
    from hf2q.engine.tp_launch import plan_split
    from hf2q.errors import InputError

    with pytest.raises(InputError, match="decoder"):
        plan_split(nomic_gguf("f16"), 2)


def test_the_quantized_mlp_is_fused_as_read_and_equals_the_unfused_load(nomic_gguf, monkeypatch):
    """gate and up are one product built from the stored blocks (``layers.load_products``; the second path that
    fused linears already built is gone), and the vectors equal an unfused load's bit for bit, for a few rows (the
    fused product itself) and for many (each part's own product on the host)."""
    from hf2q.engine import layers
    from hf2q.engine.runner import MlxModelRunner
    from tests.engine_support import random_tokens

    path = nomic_gguf("q8_0")
    fused = MlxModelRunner.load(path)
    mlp = fused.model.layers[0].mlp
    assert len(mlp.gate_up) == 1 and mlp.gate_up[0][0].parts == [mlp.gate, mlp.up]
    monkeypatch.setenv("HF2Q_NO_FUSED_PROJ", "1")
    alone = MlxModelRunner.load(path)
    assert len(alone.model.layers[0].mlp.gate_up) == 2
    for batch in ([random_tokens(5, seed=1)], [random_tokens(n, seed=n) for n in (3, 9, 30)]):
        assert np.array_equal(np.asarray(fused.embed(batch)), np.asarray(alone.embed(batch)))
    assert not hasattr(layers, "fused_products") and not hasattr(layers.Linear, "fused")
