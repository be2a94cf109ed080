"""``hf2q quality`` and ``convert --quality`` end to end on the tiny llama (SmolLM2's tokenizer).

The reference figure is checked against transformers' own forward pass over the same windows;
the converted figures against each other (the two commands are one computation) and against
what a quantization must do (q8_0 close to the source, mlx-4 farther).
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from hf2q.quality import scores
from hf2q.quality.corpus import load_corpus

N_CTX = 64


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def converted(tiny_llama, tmp_path_factory):
    """q8_0 GGUF written with ``convert --quality`` (its report holds the scores), and an mlx-4 dir."""
    from hf2q.cli import main

    d = tmp_path_factory.mktemp("quality-cli")
    gguf = d / "tiny-q8_0.gguf"
    assert main(["convert", str(tiny_llama), "-q", "q8_0", "-o", str(gguf), "--threads", "1", "--no-integrity",
                 "--quality", "--quality-n-ctx", str(N_CTX)]) == 0
    mlx = d / "tiny-mlx-4"
    assert main(["convert", str(tiny_llama), "--format", "mlx", "-q", "mlx-4", "-o", str(mlx),
                 "--no-integrity"]) == 0
    return {"gguf": gguf, "mlx": mlx, "dir": d}


def _transformers_ppl(src, n_ctx: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    ids = tok(load_corpus(None).text, add_special_tokens=False)["input_ids"]  # SmolLM2 adds no BOS
    wins = scores.windows(ids, n_ctx)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(wins.astype(np.int64))).logits.double()
    first = n_ctx // 2
    lp = torch.log_softmax(logits[:, first:-1], -1)
    target = torch.from_numpy(wins[:, first + 1:].astype(np.int64))
    nll = -lp.gather(-1, target[..., None])[..., 0]
    return math.exp(float(nll.mean()))


@pytest.mark.slow
def test_quality_json_against_transformers_and_convert_report(cli, tiny_llama, converted):
    r = cli("quality", converted["gguf"], "--reference", tiny_llama, "--n-ctx", str(N_CTX), "--json")
    assert r.code == 0, r.err
    res = json.loads(r.out)
    s = res["scores"]
    assert s["converted_kind"] == "gguf" and s["n_ctx"] == N_CTX and s["corpus"] == "calibration"
    assert s["tokens"] == s["chunks"] * (N_CTX - 1 - N_CTX // 2)
    # the reference ran as a temporary F16 GGUF on our engine; transformers runs the fp32 checkpoint
    assert s["ppl_ref"] == pytest.approx(_transformers_ppl(tiny_llama, N_CTX), rel=2e-3)
    assert 0 < s["kld_mean"] < 1e-2 and s["kld_max"] >= s["kld_p99"] >= s["kld_median"] >= 0
    assert s["same_top"] > 0.9
    assert s["ppl"] == pytest.approx(s["ppl_ref"], rel=0.02)
    te = res["tensor_errors"]
    assert te["report"] == str(converted["gguf"]) + ".report.json"
    assert te["tensors"] and all(t["cosine"] > 0.999 for t in te["tensors"])
    # convert --quality wrote the same figures into the report
    rep = json.loads((converted["dir"] / "tiny-q8_0.gguf.report.json").read_text())
    q = rep["quality"]
    assert q["reference"] == str(tiny_llama)
    for key in ("ppl", "ppl_ref", "kld_mean", "kld_p99", "same_top"):
        assert q[key] == pytest.approx(s[key], rel=1e-9), key


#: windows the mlx-directory test scores for its comparisons (one reference run the same way twice, 4 bits against
#: 8): they hold on a few hundred tokens; the whole corpus is the test above's and the KL-0 run's
FEW_CHUNKS = ("--chunks", "12")


@pytest.mark.slow
def test_quality_text_of_an_mlx_directory_and_a_missing_report(cli, tiny_llama, converted):
    gguf_ref = converted["dir"] / "tiny-f16.gguf"
    assert cli("convert", tiny_llama, "-q", "f16", "-o", gguf_ref, "--no-integrity").code == 0
    r = cli("quality", converted["mlx"], "--reference", gguf_ref, "--n-ctx", str(N_CTX), "--json", *FEW_CHUNKS)
    assert r.code == 0, r.err
    mlx = json.loads(r.out)["scores"]
    r8 = cli("quality", converted["gguf"], "--reference", gguf_ref, "--n-ctx", str(N_CTX), "--json", *FEW_CHUNKS)
    q8 = json.loads(r8.out)["scores"]
    assert mlx["chunks"] == q8["chunks"] == 12
    assert mlx["converted_kind"] == "mlx"
    assert mlx["ppl_ref"] == pytest.approx(q8["ppl_ref"], rel=1e-9)  # one reference, run the same way
    assert q8["kld_mean"] < mlx["kld_mean"] < 0.5  # 4 bits cost more than 8, and stay a model of the source
    # the reference itself as CONVERTED: KL 0, and its report (written by convert) read
    (converted["dir"] / "tiny-f16.gguf.report.json").unlink()
    r = cli("quality", gguf_ref, "--reference", gguf_ref, "--n-ctx", str(N_CTX))
    assert r.code == 0, r.err
    assert "KL divergence    mean 0.000000" in r.out and "top-1 agreement  100.000" in r.out
    assert "no convert report" in r.out


@pytest.mark.parametrize("argv, code, message", [
    (["--reference", "/nonexistent/ref"], 3, "--reference /nonexistent/ref: no such file"),
    (["--reference", "{gguf}", "--n-ctx", "8192"], 3, "needs at least 16384"),
    (["--reference", "{gguf}", "--corpus", "no-such-corpus"], 3, "no corpus file or shipped corpus"),
    (["--reference", "{gguf}", "--n-ctx", "2"], 2, "must be at least 4"),
    ([], 2, "--reference"),
])
def test_quality_errors_are_one_line(cli, converted, argv, code, message):
    argv = [a.replace("{gguf}", str(converted["gguf"])) for a in argv]
    r = cli("quality", converted["gguf"], *argv)
    assert r.code == code
    assert message in r.err and len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err


def test_convert_quality_is_for_gguf_output(cli, tiny_llama, tmp_path):
    r = cli("convert", tiny_llama, "--format", "mlx", "-q", "mlx-4", "-o", tmp_path / "m", "--quality")
    assert r.code == 2 and "hf2q quality DIR --reference SRC" in r.err
    assert not (tmp_path / "m").exists()
    r = cli("convert", tiny_llama, "-q", "q8_0", "-o", tmp_path / "m.gguf", "--quality", "--quality-corpus", "nope")
    assert r.code == 3 and "no corpus file or shipped corpus named 'nope'" in r.err
    assert not (tmp_path / "m.gguf").exists()  # the corpus is checked before the conversion


def test_quality_refuses_what_is_not_a_model(cli, converted, tmp_path):
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    r = cli("quality", junk, "--reference", converted["gguf"])
    assert r.code == 3 and "neither a GGUF file nor an mlx-lm directory" in r.err


def test_quality_of_an_mlx_directory_without_mlx_lm_says_how_to_install_it(cli, converted, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # import mlx_lm → ImportError
    r = cli("quality", converted["mlx"], "--reference", converted["gguf"], "--n-ctx", str(N_CTX))
    assert r.code == 3 and "pip install 'hf2q[mlx-lm]'" in r.err
