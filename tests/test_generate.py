"""``hf2q generate`` end to end on the real default model."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_generate_answers_paris(smollm2_gguf, cli):
    res = cli("generate", "--model", smollm2_gguf, "--prompt", "What is the capital of France?",
              "--max-tokens", "16")
    assert res.code == 0, res.err
    assert "Paris" in res.out


def test_generate_benchmark_json(smollm2_gguf, cli):
    res = cli("generate", "--model", smollm2_gguf, "--prompt", "Count to five.", "--max-tokens", "4",
              "--benchmark", "--json")
    assert res.code == 0, res.err
    last = json.loads(res.out.strip().splitlines()[-1])
    assert set(last) == {"prompt_tokens", "generated_tokens", "prefill_tokens_per_sec", "decode_tokens_per_sec"}
    assert last["prompt_tokens"] > 10 and 1 <= last["generated_tokens"] <= 4
    assert last["prefill_tokens_per_sec"] > 0
    assert "median" in res.out and "p95" in res.out


def test_generate_raw_and_seeded_sampling(smollm2_gguf, cli):
    args = ("generate", "--model", smollm2_gguf, "--prompt", "Once upon a time", "--raw", "--max-tokens", "8",
            "--temperature", "0.8", "--seed", "7")
    a, b = cli(*args), cli(*args)
    assert a.code == 0 and a.out == b.out and a.out.strip()


def test_ignore_eos_runs_the_whole_budget(smollm2_gguf, cli):
    """The model answers in a few tokens and stops; with --ignore-eos it decodes all of --max-tokens."""
    args = ("generate", "--model", smollm2_gguf, "--prompt", "What is the capital of France?", "--max-tokens", "24",
            "--benchmark", "--json")
    stopped, forced = cli(*args), cli(*args, "--ignore-eos")
    assert stopped.code == 0 and forced.code == 0, (stopped.err, forced.err)
    early = json.loads(stopped.out.strip().splitlines()[-1])["generated_tokens"]
    assert early < 24
    assert json.loads(forced.out.strip().splitlines()[-1])["generated_tokens"] == 24
