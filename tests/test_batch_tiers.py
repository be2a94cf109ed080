"""Mixed-bit tiers in ``hf2q convert --batch`` plans: planned per source inside each job, byte-identical to the
single command; the importance-weighted tiers are refused up front, since a plan carries no imatrix."""

from __future__ import annotations

import json
import shutil


def test_a_tier_in_a_plan_equals_the_single_conversion(tiny_checkpoint, tmp_path, cli):
    src = tmp_path / "models" / "tiny-llama"
    shutil.copytree(tiny_checkpoint("llama"), src)
    plan = tmp_path / "plan.toml"
    plan.write_text('output_dir = "out"\nsources = ["models/tiny-llama"]\nquants = ["dynamic-q4"]\n')
    r = cli("convert", "--batch", plan)
    assert r.code == 0, r.err
    summary = json.loads((tmp_path / "out" / "batch-summary.json").read_text())
    assert (summary["converted"], summary["failed"]) == (1, 0)
    single = tmp_path / "single.gguf"
    assert cli("convert", src, "-q", "dynamic-q4", "-o", single).code == 0
    assert (tmp_path / "out" / "tiny-llama-dynamic-q4.gguf").read_bytes() == single.read_bytes()


def test_importance_weighted_tiers_and_unknown_names_are_refused_up_front(tiny_checkpoint, tmp_path, cli):
    plan = tmp_path / "plan.toml"
    for quant, words in (("apex-i-balanced", "importance matrix"), ("dynamic-q5", "did you mean")):
        plan.write_text(f'sources = ["{tiny_checkpoint("llama")}"]\nquants = ["{quant}"]\n')
        r = cli("convert", "--batch", plan)
        assert r.code == 3 and words in r.err.lower(), (quant, r.err)
        assert len(r.err.strip().splitlines()) == 1
