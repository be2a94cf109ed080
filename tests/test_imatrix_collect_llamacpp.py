"""``hf2q imatrix`` against ``llama-imatrix`` on the same GGUF, corpus and chunking.

The oracle runs with exact attention (``-fa off``, float32 K/V cache) so that the only arithmetic
difference left is the one the model file forces: with F32 weights both tools multiply float32
activations and agree to float32 rounding; with F16 weights ggml rounds every product's input
activations to f16 (its F16 dot product), which bounds the agreement at ~1e-3 of a column's sum
(docs/QUALITY.md, "Importance matrices"). Counts are compared exactly, per expert for MoE.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from hf2q.quality.corpus import load_corpus
from hf2q.sources.imatrix import read_imatrix, write_imatrix
from tests.test_imatrix_collect import raw_entries
from tests.test_llamacpp_parity import compare_gguf, llamacpp_reference

pytestmark = pytest.mark.slow
IM = gguf.Keys.IMatrix
N_CTX, CHUNKS = "128", "3"


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> str:
    """The shipped corpus as a file, so both tools read (and record as the dataset) the same path."""
    path = tmp_path_factory.mktemp("corpus") / "calibration.txt"
    path.write_text(load_corpus("calibration").text, encoding="utf-8")
    return str(path)


def llama_imatrix(model: Path, corpus: str, out: Path, n_ctx: str = N_CTX, chunks: str = CHUNKS) -> Path:
    from tests.tools import llama_cpp

    exe = llama_cpp.tool("llama-imatrix")
    if exe is None:
        pytest.skip("llama-imatrix is not built")
    env = {**llama_cpp.env(), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([str(exe), "-m", str(model), "-f", corpus, "-o", str(out), "-c", n_ctx, "--chunks", chunks,
                        "-t", "1", "--no-ppl", "-fa", "off", "-ctk", "f32", "-ctv", "f32"],
                       env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def ours(cli, model: Path, corpus: str, out: Path, n_ctx: str = N_CTX, chunks: str = CHUNKS) -> Path:
    r = cli("imatrix", str(model), "--corpus", corpus, "-o", out, "--n-ctx", n_ctx, "--chunks", chunks)
    assert r.code == 0, r.err
    return out


def relative_errors(a: Path, b: Path) -> dict[str, tuple[float, float]]:
    """Per entry ``(largest per-column relative error, relative error of the whole sum vector)``, after
    checking that both files hold the same entries, shapes, counts and provenance keys."""
    (ta, ka), (tb, kb) = raw_entries(a), raw_entries(b)
    assert sorted(ta) == sorted(tb)
    for key in (IM.DATASETS, IM.CHUNK_COUNT, IM.CHUNK_SIZE, gguf.Keys.General.TYPE):
        assert ka[key] == kb[key], key
    out = {}
    for name in ta:
        (ne_a, x), (ne_b, y) = ta[name], tb[name]
        assert ne_a == ne_b, name
        if name.endswith(".counts"):
            assert x.tolist() == y.tolist(), name
            continue
        col = np.abs(x.astype(np.float64) - y) / np.abs(y)
        out[name] = (float(col.max()), float(np.linalg.norm(x.astype(np.float64) - y) / np.linalg.norm(y)))
    return out


@pytest.fixture(scope="module")
def smollm2_f32_pair(smollm2_hf, llama_cpp_bin, corpus_file, tmp_path_factory):
    d = tmp_path_factory.mktemp("imatrix-smollm2")
    f32 = llamacpp_reference(smollm2_hf, "f32")
    return llama_imatrix(f32, corpus_file, d / "theirs.imatrix.gguf"), d


def test_smollm2_f32_matches_llama_imatrix(smollm2_f32_pair, smollm2_hf, corpus_file, cli):
    theirs, d = smollm2_f32_pair
    mine = ours(cli, llamacpp_reference(smollm2_hf, "f32"), corpus_file, d / "ours.imatrix.gguf")
    errs = relative_errors(mine, theirs)
    assert len(errs) == 30 * 7  # q k v o gate up down of every block
    worst = max(errs, key=lambda n: errs[n][0])
    assert errs[worst][0] < 1e-4, (worst, errs[worst])  # float32 rounding: measured ≤ 3e-5


def test_smollm2_f16_from_the_hf_checkpoint(smollm2_hf, llama_cpp_bin, corpus_file, cli, tmp_path):
    """Ours from the HF directory (our own F16 conversion, temporary) vs llama-imatrix on llama.cpp's F16."""
    theirs = llama_imatrix(llamacpp_reference(smollm2_hf, "f16"), corpus_file, tmp_path / "theirs.gguf")
    errs = relative_errors(ours(cli, smollm2_hf, corpus_file, tmp_path / "ours.gguf"), theirs)
    whole = max(e[1] for e in errs.values())
    columns = np.array([e[0] for e in errs.values()])
    # ggml's f16 rounding of the activations: measured 4e-4 with llama.cpp built for AVX-512, 1.4e-3 for AVX2
    assert whole < 3e-3, whole
    assert columns.max() < 2e-2 and np.median(columns) < 5e-3, (columns.max(), np.median(columns))
    assert not list(tmp_path.glob(".hf2q-imatrix-*"))


def test_their_values_through_our_writer_read_back_bit_for_bit(smollm2_f32_pair):
    """The writer loses nothing: llama-imatrix's sums and counts rewritten by us give llama-quantize's
    weights bit for bit (so a conversion with either file is the same bytes)."""
    theirs, d = smollm2_f32_pair
    tensors, keys = raw_entries(theirs)
    entries = {name.removesuffix(".in_sum2"): (vals.reshape(ne[::-1]), tensors[name.replace(".in_sum2", ".counts")][1])
               for name, (ne, vals) in tensors.items() if name.endswith(".in_sum2")}
    rewritten = write_imatrix(d / "rewritten.gguf", entries, datasets=tuple(keys[IM.DATASETS]),
                              chunk_count=keys[IM.CHUNK_COUNT], chunk_size=keys[IM.CHUNK_SIZE])
    a, b = read_imatrix(rewritten), read_imatrix(theirs)
    assert (a.datasets, a.chunk_count, a.chunk_size) == (b.datasets, b.chunk_count, b.chunk_size)
    assert a.weights.keys() == b.weights.keys()
    for name in a.weights:
        assert a.weights[name].tobytes() == b.weights[name].tobytes(), name
    assert raw_entries(rewritten)[0].keys() == tensors.keys()


def test_convert_imatrix_corpus_equals_llama_quantize_with_our_file(smollm2_hf, llama_cpp_bin, cli, tmp_path):
    """``convert --imatrix-corpus`` end to end; stock llama-quantize takes the matrix it kept and
    quantizes llama.cpp's F16 to the same bytes and metadata."""
    from tests.test_convert_imatrix import llama_quantize

    corpus = tmp_path / "short.txt"
    corpus.write_text(load_corpus("calibration").text[:2500], encoding="utf-8")
    kept, out, ref = tmp_path / "kept.imatrix.gguf", tmp_path / "ours.gguf", tmp_path / "llama.gguf"
    r = cli("convert", smollm2_hf, "--quant", "q4_k_m", "-o", out, "--no-integrity", "--imatrix-corpus", str(corpus),
            "--imatrix-n-ctx", "128", "--imatrix-out", str(kept))
    assert r.code == 0, r.err
    assert read_imatrix(kept).chunk_size == 128 and read_imatrix(kept).datasets == (str(corpus),)
    q = llama_quantize(llamacpp_reference(smollm2_hf, "f16"), ref, "Q4_K_M", kept)
    assert q.returncode == 0, q.stderr[-2000:]
    assert "imatrix" in q.stdout + q.stderr
    assert compare_gguf(out, ref) == []


@pytest.mark.parametrize("family, tolerance", [
    ("qwen3", 1e-4), ("qwen3_moe", 1e-4),
    ("gemma3", 3e-3),  # ggml's GELU reads an f16 table: measured 9e-4
])
def test_tiny_families_match_llama_imatrix(family, tolerance, tiny_checkpoint, llama_cpp_bin, corpus_file, cli,
                                          tmp_path):
    ref = llamacpp_reference(tiny_checkpoint(family), "f32")
    theirs = llama_imatrix(ref, corpus_file, tmp_path / "theirs.gguf", chunks="2")
    mine = ours(cli, ref, corpus_file, tmp_path / "ours.gguf", chunks="2")
    errs = relative_errors(mine, theirs)  # counts equal, per expert for the MoE
    worst = max(errs, key=lambda n: errs[n][0])
    assert errs[worst][0] < tolerance, (worst, errs[worst])
    if family == "qwen3_moe":
        counts = raw_entries(mine)[0]["blk.1.ffn_down_exps.weight.counts"][1]
        assert counts.sum() == 2 * 128 * 2 and len(set(counts.tolist())) > 1  # routing really varies
