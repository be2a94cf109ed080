"""``hf2q convert --batch``: the plan's cross product, byte-identical to single conversions,
resumable through receipts, ``--keep-going``, ``--jobs``, and one-line plan errors."""

from __future__ import annotations

import json
import shutil

import pytest


def _plan(tmp_path, body: str, name="plan.toml"):
    p = tmp_path / name
    p.write_text(body)
    return p


@pytest.fixture
def sources(tiny_checkpoint, tmp_path):
    """Private copies (tests modify them) of two tiny checkpoints."""
    out = {}
    for fam in ("llama", "qwen3"):
        dst = tmp_path / "models" / f"tiny-{fam}"
        shutil.copytree(tiny_checkpoint(fam), dst)
        out[fam] = dst
    return out


def _summary(out_dir):
    return json.loads((out_dir / "batch-summary.json").read_text())


def test_cross_product_matches_single_conversions_and_resumes(sources, tmp_path, cli):
    plan = _plan(tmp_path, 'output_dir = "out"\nsources = ["models/tiny-llama", "models/tiny-qwen3"]\n'
                           'quants = ["q8_0", "mlx-4"]\n')
    r = cli("convert", "--batch", plan)
    assert r.code == 0, r.err
    out = tmp_path / "out"
    s = _summary(out)
    assert (s["jobs"], s["converted"], s["skipped"], s["failed"]) == (4, 4, 0, 0)
    assert "4 converted, 0 skipped, 0 failed" in r.out and "tiny-qwen3" in r.out  # the table
    # a batch output is exactly what the single command writes
    single = tmp_path / "single.gguf"
    assert cli("convert", sources["llama"], "-q", "q8_0", "-o", single).code == 0
    assert (out / "tiny-llama-q8_0.gguf").read_bytes() == single.read_bytes()
    assert json.loads((out / "tiny-qwen3-mlx-4" / "config.json").read_text())["quantization"]["bits"] == 4
    for o in ("tiny-llama-q8_0.gguf", "tiny-llama-mlx-4", "tiny-qwen3-q8_0.gguf", "tiny-qwen3-mlx-4"):
        rec = json.loads((out / f"{o}.receipt.json").read_text())
        assert rec["inputs_sha256"]["model.safetensors"] and rec["quant"] in o

    # rerun: everything is skipped and nothing is rewritten
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("*.gguf")}
    r = cli("convert", "--batch", plan)
    assert r.code == 0 and _summary(out)["skipped"] == 4
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.gguf")} == mtimes

    # a changed input redoes only that source's jobs; a deleted output is redone
    cfg = sources["qwen3"] / "generation_config.json"
    cfg.write_text(cfg.read_text().replace("}", ', "temperature": 0.7}', 1))
    (out / "tiny-llama-q8_0.gguf").unlink()
    assert cli("convert", "--batch", plan).code == 0
    status = {(x["source"], x["quant"]): x["status"] for x in _summary(out)["results"]}
    assert status == {("tiny-llama", "q8_0"): "converted", ("tiny-llama", "mlx-4"): "skipped",
                      ("tiny-qwen3", "q8_0"): "converted", ("tiny-qwen3", "mlx-4"): "converted"}


def test_formats_filter_and_json_plan(sources, tmp_path, cli):
    plan = _plan(tmp_path, json.dumps({"output_dir": "o", "sources": ["models/tiny-llama"],
                                       "quants": ["q8_0", "mlx-8", "q4_0"], "formats": ["gguf"]}), "p.json")
    assert cli("convert", "--batch", plan).code == 0
    assert sorted(p.name for p in (tmp_path / "o").glob("*.gguf")) == ["tiny-llama-q4_0.gguf", "tiny-llama-q8_0.gguf"]
    assert not (tmp_path / "o" / "tiny-llama-mlx-8").exists()


def _break(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 3])


def test_stop_on_first_failure_unless_keep_going(sources, tmp_path, cli):
    _break(sources["llama"])
    plan = _plan(tmp_path, 'output_dir = "out"\nsources = ["models/tiny-llama", "models/tiny-qwen3"]\n'
                           'quants = ["q8_0"]\n')
    r = cli("convert", "--batch", plan)
    assert r.code == 3
    status = {x["source"]: x["status"] for x in _summary(tmp_path / "out")["results"]}
    assert status == {"tiny-llama": "failed", "tiny-qwen3": "not run"}
    assert not (tmp_path / "out" / "tiny-llama-q8_0.gguf").exists()

    r = cli("convert", "--batch", plan, "--keep-going")
    assert r.code == 3
    s = _summary(tmp_path / "out")
    assert {x["source"]: x["status"] for x in s["results"]} == {"tiny-llama": "failed", "tiny-qwen3": "converted"}
    failed = next(x for x in s["results"] if x["status"] == "failed")
    assert failed["error"] and "\n" not in failed["error"]
    assert (tmp_path / "out" / "tiny-qwen3-q8_0.gguf").exists()


@pytest.mark.slow
def test_parallel_jobs_in_worker_processes(sources, tmp_path, cli):
    plan = _plan(tmp_path, 'output_dir = "out"\nsources = ["models/tiny-llama", "models/tiny-qwen3"]\n'
                           'quants = ["q8_0", "q4_0"]\nthreads = 1\n')
    r = cli("convert", "--batch", plan, "--jobs", "2")
    assert r.code == 0, r.out + r.err
    assert _summary(tmp_path / "out")["converted"] == 4
    single = tmp_path / "single.gguf"
    assert cli("convert", sources["qwen3"], "-q", "q4_0", "-o", single).code == 0
    assert (tmp_path / "out" / "tiny-qwen3-q4_0.gguf").read_bytes() == single.read_bytes()


@pytest.mark.parametrize("body,needle", [
    ('sources = ["models/tiny-llama"]\nquants = ["q4_k_n"]\n', "did you mean"),
    ('sources = ["models/tiny-llama"]\nquants = ["mlx-7"]\n', "unknown mlx quantization"),
    ('quants = ["q8_0"]\n', "'sources' must be a non-empty list"),
    ('sources = ["models/nowhere"]\nquants = ["q8_0"]\n', "not an HF model directory"),
    ('sources = ["models/tiny-llama"]\nquants = ["q8_0"]\ncolour = 1\n', "unknown plan key"),
    ('sources = ["models/tiny-llama"]\nquants = ["mlx-4"]\nformats = ["gguf"]\n', "no source × quant"),
    ('sources = [\n', "invalid plan"),
])
def test_bad_plans_are_one_line_input_errors(body, needle, sources, tmp_path, cli):
    r = cli("convert", "--batch", _plan(tmp_path, body))
    assert r.code == 3 and needle in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1


def test_batch_with_src_is_a_usage_error(sources, tmp_path, cli):
    plan = _plan(tmp_path, 'sources = ["models/tiny-llama"]\nquants = ["q8_0"]\n')
    r = cli("convert", sources["llama"], "--batch", plan)
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1
