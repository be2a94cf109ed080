"""``hf2q serve`` with several ``--model``: what start-up refuses, in one line, before anything loads.

The figures come from the memory plan (``engine.memory_plan.check_model``, what ``hf2q info``
prints), computed here independently of the serve command."""

from __future__ import annotations

import pytest

from hf2q.engine.memory_plan import check_model

CTX, SLOTS = 512, 1


def need(path) -> int:
    return check_model(path, 1, ctx=CTX, slots=SLOTS, kv_budget=None, limit=None).total


def serve(cli, *argv):
    return cli("serve", *argv, "--ctx", str(CTX), "--slots", str(SLOTS), "--port", "0")


def one_line(r) -> str:
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    return lines[0]


def test_a_budget_that_holds_one_model_but_not_the_other_is_refused(cli, smollm2_gguf, gemma3_gguf):
    small, big = need(smollm2_gguf), need(gemma3_gguf)
    assert small < big
    r = serve(cli, "--model", smollm2_gguf, "--model", gemma3_gguf, "--models-memory", str((small + big) // 2))
    assert r.code == 3
    assert "cannot hold gemma-3-270m-q4_k_m" in one_line(r)


@pytest.mark.parametrize("extra, says", [
    (["--model-name", "x"], "--model-name is for a single --model"),
    (["--tensor-parallel", "2"], "--tensor-parallel is for a single --model"),
    (["--hosts", "a,b"], "--hosts is for a single --model"),
])
def test_single_model_flags_are_usage_errors(cli, smollm2_gguf, gemma3_gguf, extra, says):
    r = serve(cli, "--model", smollm2_gguf, "--model", gemma3_gguf, *extra)
    assert r.code == 2 and says in one_line(r)


def test_two_files_with_one_id_are_a_usage_error(cli, smollm2_gguf, tmp_path):
    twin = tmp_path / smollm2_gguf.name
    twin.symlink_to(smollm2_gguf)
    r = serve(cli, "--model", smollm2_gguf, "--model", twin)
    assert r.code == 2 and "both be served as 'SmolLM2-135M-Instruct.Q4_1'" in one_line(r)


def test_a_missing_second_model_is_bad_input(cli, smollm2_gguf, tmp_path):
    r = serve(cli, "--model", smollm2_gguf, "--model", tmp_path / "nope.gguf")
    assert r.code == 3 and "model file not found" in one_line(r)


def test_a_model_memory_below_the_smallest_model_is_refused(cli, smollm2_gguf, gemma3_gguf):
    r = serve(cli, "--model", smollm2_gguf, "--model", gemma3_gguf, "--models-memory", "10M")
    assert r.code == 3
    line = one_line(r)
    assert "smaller than the smallest model" in line and smollm2_gguf.stem in line  # the smallest, named
