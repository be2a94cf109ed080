"""``hf2q parity``: captures from transformers and from stock llama.cpp, compared against our engine.

The references are independent of our engine: transformers runs the HF checkpoint in float32, and
llama.cpp's ``llama-server`` runs the GGUF our converter wrote. A conversion that is right agrees with
both; a capture whose numbers were moved must fail with the step where they were moved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf2q.arch.smoke_prompts import PARITY_PROMPTS


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two shared cores: torch's own thread pool fights the other test processes for them."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, one_torch_thread, tmp_path_factory):
    """Factory: family → (tiny checkpoint, our F16 GGUF of it, transformers capture of it), made once."""
    from hf2q.cli import main
    from hf2q.convert.pipeline import convert_gguf
    from hf2q.convert.quant_names import parse_gguf_quant

    made: dict[str, tuple[Path, Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path, Path]:
        if family not in made:
            src = tiny_checkpoint(family)
            d = tmp_path_factory.mktemp(f"parity-{family}")
            gguf, capture = d / f"tiny-{family}-f16.gguf", d / "hf.json"
            convert_gguf(src, gguf, parse_gguf_quant("f16"), integrity=False, report_path=d / "report.json")
            assert main(["parity", "--reference", str(src), "--capture", str(capture), "--tokens", "8"]) == 0
            made[family] = (src, gguf, capture)
        return made[family]

    return get


@pytest.fixture(scope="module")
def tiny_llama(tiny) -> tuple[Path, Path]:
    return tiny("llama")[:2]


@pytest.fixture(scope="module")
def hf_capture(tiny) -> Path:
    return tiny("llama")[2]


def test_capture_from_transformers_records_every_prompt(hf_capture):
    doc = json.loads(hf_capture.read_text())
    assert doc["format"] == "hf2q-parity" and doc["reference"]["kind"] == "transformers"
    assert [p["text"] for p in doc["prompts"]] == list(PARITY_PROMPTS)
    for p in doc["prompts"]:
        assert len(p["tokens"]) == len(p["top_ids"]) == len(p["top_logits"]) == 8
        assert all(len(r) == 10 for r in p["top_ids"])
        assert p["tokens"] == [r[0] for r in p["top_ids"]]  # greedy: each token is its step's argmax


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_our_conversion_matches_the_transformers_capture(cli, tiny, family):
    _, gguf, capture = tiny(family)
    r = cli("parity", gguf, "--compare", capture, "--json")
    assert r.code == 0, r.out + r.err
    report = json.loads(r.out)
    assert report["tokenizer_matches"] == len(PARITY_PROMPTS)
    assert report["top1_agreement"] == 1.0
    assert report["max_logit_diff"] < 0.05  # F16 weights against float32 ones
    assert report["first_divergence"] is None


def test_a_perturbed_capture_fails_at_the_moved_step(cli, tiny_llama, hf_capture, tmp_path):
    doc = json.loads(hf_capture.read_text())
    step = doc["prompts"][2]
    step["top_logprobs"][3] = [v - 2.0 for v in step["top_logprobs"][3]]  # the reference "said" otherwise
    bad = tmp_path / "moved.json"
    bad.write_text(json.dumps(doc))
    r = cli("parity", tiny_llama[1], "--compare", bad, "--json")
    assert r.code == 1
    report = json.loads(r.out)
    assert report["passed"] is False
    assert report["max_logprob_diff"] > 1.9
    div = report["first_divergence"]
    assert (div["prompt"], div["step"]) == (2, 3)
    assert len(div["rows"]) == 10 and div["rows"][0]["reference_id"] == step["top_ids"][3][0]


def test_a_capture_of_another_tokenization_fails(cli, tiny_llama, hf_capture, tmp_path):
    doc = json.loads(hf_capture.read_text())
    doc["prompts"][0]["prompt_tokens"] = doc["prompts"][0]["prompt_tokens"][1:]  # one token fewer
    bad = tmp_path / "tokens.json"
    bad.write_text(json.dumps(doc))
    r = cli("parity", tiny_llama[1], "--compare", bad, "--json")
    assert r.code == 1 and json.loads(r.out)["tokenizer_matches"] == len(PARITY_PROMPTS) - 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_llama_cpp_capture_of_the_same_gguf_compares_clean(cli, tiny, family, llama_cpp_bin, tmp_path):
    gguf = tiny(family)[1]
    out = tmp_path / "lc.json"
    r = cli("parity", gguf, "--reference", "llama.cpp", "--llama-cpp", llama_cpp_bin, "--capture", out,
            "--tokens", "8")
    assert r.code == 0, r.err
    doc = json.loads(out.read_text())
    assert doc["reference"]["kind"] == "llama.cpp" and "top_logits" not in doc["prompts"][0]
    r = cli("parity", gguf, "--compare", out, "--json")
    assert r.code == 0, r.out
    report = json.loads(r.out)
    assert report["top1_agreement"] == 1.0 and report["max_logprob_diff"] < 0.05
    assert report["max_logit_diff"] is None  # llama-server reports log-probabilities only


def test_our_engine_as_reference_is_a_regression_file(cli, tiny_llama, tmp_path):
    """Free-running greedy decode (prefill + decode steps) against one teacher-forced forward."""
    out = tmp_path / "ours.json"
    assert cli("parity", tiny_llama[1], "--reference", "hf2q", "--capture", out, "--tokens", "8").code == 0
    r = cli("parity", tiny_llama[1], "--compare", out, "--json")
    assert r.code == 0, r.out
    report = json.loads(r.out)
    assert report["top1_agreement"] == 1.0 and report["max_logit_diff"] < 1e-3


@pytest.mark.slow
def test_smollm2_gguf_matches_its_hf_checkpoint(cli, smollm2_hf, smollm2_gguf, one_torch_thread, tmp_path):
    """The real model: the HF copy holds the GGUF's dequantised weights, so the two must agree closely."""
    out = tmp_path / "smollm2.json"
    assert cli("parity", "--reference", smollm2_hf, "--capture", out, "--tokens", "6").code == 0
    r = cli("parity", smollm2_gguf, "--compare", out, "--json")
    assert r.code == 0, r.out
    report = json.loads(r.out)
    assert report["top1_agreement"] == 1.0 and report["topk_overlap"] == 1.0
    assert report["max_logit_diff"] < 1e-3


@pytest.mark.parametrize("argv, code, words", [
    (["--compare", "missing.json"], 3, "cannot read --compare"),
    (["--capture", "x.json"], 2, "--capture needs --reference"),
    (["--reference", "nowhere", "--capture", "x.json"], 3, "not llama.cpp, hf2q or an HF checkpoint"),
    (["--reference", "hf2q", "--compare", "x.json"], 2, "--reference is for --capture"),
])
def test_bad_input_is_one_line(cli, tiny_llama, tmp_path, argv, code, words):
    argv = [str(tmp_path / a) if a.endswith(".json") else a for a in argv]
    r = cli("parity", tiny_llama[1], *argv)
    assert r.code == code and words in r.err and "Traceback" not in r.err


def test_a_file_that_is_not_a_capture_is_refused(cli, tiny_llama, tmp_path):
    f = tmp_path / "other.json"
    f.write_text(json.dumps({"prompts": []}))
    r = cli("parity", tiny_llama[1], "--compare", f)
    assert r.code == 3 and "not an hf2q parity capture" in r.err
