"""Speculative decoding with n-gram drafts (``hf2q.engine.speculative``, ``runner.verify``, ``generate``).

The drafter is checked against a brute-force search; the acceptance rule against the target
distribution it must preserve (sampled many times); ``runner.verify`` against one decode step per
token; and greedy generation with drafting against plain greedy generation, token for token, on
the real SmolLM2, tiny qwen3 / llama and the hybrid-recurrent tiny qwen35 (whose verify forwards keep
the recurrent state after each token, so a sequence stops at the last accepted one).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hf2q.engine.sampling import Sampler
from hf2q.engine.speculative import NgramDrafter, accept_draft
from hf2q.sched.contracts import SamplingParams

# ---------------------------------------------------------------------------- drafter


def _brute_force(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The longest suffix (max_n..min_n) found earlier with a follower; its latest such start."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 8), st.integers(1, 4), st.integers(0, 3))
def test_drafter_matches_a_brute_force_search(tokens, k, max_n, extra):
    min_n = max(1, max_n - extra)
    d = NgramDrafter(tokens[:len(tokens) // 2], max_n=max_n, min_n=min_n)
    d.extend(tokens[len(tokens) // 2:])  # built incrementally, looked up at the end
    assert d.propose(k) == _brute_force(tokens, k, max_n, min_n)


def test_drafter_prefers_the_longer_match():
    # "7 8" recurs once (→ 1 2); "8" alone recurs later (→ 9 9)
    ctx = [7, 8, 1, 2, 3, 8, 9, 9, 7, 8]
    assert NgramDrafter(ctx, max_n=2).propose(2) == [1, 2]
    assert NgramDrafter(ctx, max_n=1).propose(2) == [9, 9]
    assert NgramDrafter([1, 2, 3], max_n=3).propose(4) == []
    assert NgramDrafter(ctx).propose(0) == []


# ---------------------------------------------------------------------------- acceptance


def _rows(winners: list[int], vocab: int = 16) -> np.ndarray:
    rows = np.random.default_rng(0).normal(0, 0.1, (len(winners), vocab)).astype(np.float32)
    for i, w in enumerate(winners):
        rows[i, w] += 5.0
    return rows


def test_greedy_acceptance_takes_the_model_token_at_the_first_mismatch():
    s = Sampler(SamplingParams(temperature=0.0))
    assert accept_draft(s, [3, 4, 5], _rows([3, 4, 6, 1]), []) == [3, 4, 6]
    assert accept_draft(s, [3, 4, 5], _rows([3, 4, 5, 1]), []) == [3, 4, 5, 1]  # all stand, plus the bonus
    assert accept_draft(s, [3], _rows([2, 9]), []) == [2]


def test_greedy_acceptance_applies_penalties_with_the_accepted_tokens_in_the_history():
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=100.0))
    rows = _rows([3, 3])
    rows[1, 7] += 4.0  # runner-up of row 1: wins once token 3 (accepted at row 0) is penalised
    assert accept_draft(s, [3], rows, []) == [3, 7]


def test_rejection_sampling_keeps_the_target_distribution():
    """The first emitted token of a verify step is distributed as the target's p, whatever the draft."""
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0, seed=1)
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1], dtype=np.float64)).astype(np.float32)
    rows = np.stack([logits, logits])
    p = Sampler(params).truncated_probs(Sampler(params).process(logits))
    n = 20000
    for draft in (0, 3):  # a likely and an unlikely draft token
        s = Sampler(params)
        counts = np.bincount([accept_draft(s, [draft], rows, [])[0] for _ in range(n)], minlength=4) / n
        assert np.abs(counts - p).max() < 0.015, (draft, counts, p)


# ---------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint, tmp_path_factory):
    from tests.engine_support import convert_f32

    d = tmp_path_factory.mktemp("spec")
    return lambda family: convert_f32(tiny_checkpoint(family), d / f"{family}.gguf")


def _runner(path):
    from tests.engine_support import load_runner

    return load_runner(path)


@pytest.mark.parametrize("path", ["host", "graph"])
def test_verify_logits_match_one_decode_step_per_token(tiny_gguf, path):
    from tests.engine_support import random_tokens

    runner = _runner(tiny_gguf("llama"))
    if path == "graph":
        runner.host_decoder = None
    elif runner.host_decoder is None:
        pytest.skip("no host decode step on this machine")
    prompt, extra = random_tokens(20, seed=3), random_tokens(6, seed=4)
    a, b = runner.new_sequence(), runner.new_sequence()
    runner.prefill(a, prompt)
    runner.prefill(b, prompt)
    rows = runner.verify(a, extra)
    steps = np.stack([runner.decode([b], [t])[0] for t in extra])
    assert rows.shape == (6, runner.vocab_size) and a.length == b.length == 26
    np.testing.assert_allclose(rows, steps, atol=1e-4, rtol=1e-4)
    a.trim(22)  # keep two of the six; the next step continues from there
    b.trim(22)
    np.testing.assert_allclose(runner.decode([a], [5])[0], runner.decode([b], [5])[0], atol=1e-4, rtol=1e-4)


def test_a_hybrid_sequence_stops_inside_a_verify_until_the_next_forward(tiny_gguf):
    from hf2q.engine.kv_cache import PrefixNotReusable
    from tests.engine_support import random_tokens

    runner = _runner(tiny_gguf("qwen35"))
    seq = runner.new_sequence()
    runner.prefill(seq, random_tokens(10, seed=1))
    runner.verify(seq, [5, 6, 7, 8])
    seq.trim(12)  # the recurrent state after the verify's second token (kept per position)
    runner.decode([seq], [9])
    with pytest.raises(PrefixNotReusable):
        seq.trim(11)  # that verify's states went with the next forward
    seq.trim(12)  # the state the decode began from
    assert seq.length == 12


def _repetitive_prompt(seed: int = 0) -> list[int]:
    from tests.engine_support import random_tokens

    motif = random_tokens(12, seed=seed)
    return motif * 4 + motif[:5]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_output_is_identical_with_and_without_ngram_drafts(tiny_gguf, family):
    from hf2q.engine.generate import generate_once

    runner = _runner(tiny_gguf(family))
    params = SamplingParams(max_tokens=40, temperature=0.0)
    for seed in (0, 1):
        prompt = _repetitive_prompt(seed)
        plain = generate_once(runner, prompt, params, ignore_eos=True)
        spec = generate_once(runner, prompt, params, ignore_eos=True, draft_tokens=4)
        assert spec["tokens"] == plain["tokens"]
        assert spec["drafted_tokens"] > 0
        assert spec["decode_forwards"] < len(plain["tokens"])


class _Oracle:
    """Drafts the known greedy continuation, spoiled at every third step at a varying depth, so the
    verify steps accept everything, part of the draft, or nothing (a random-weight model rarely
    repeats itself, so n-gram drafts alone would hardly reach these paths)."""

    def __init__(self, prompt_len: int, answer: list[int]):
        self.skip, self.answer, self.seen, self.calls = prompt_len, answer, 0, 0

    def append(self, token: int) -> None:
        self.seen += 1

    def propose(self, k: int) -> list[int]:
        at = self.seen - self.skip
        draft = list(self.answer[at:at + k])
        self.calls += 1
        if draft and self.calls % 3 == 0:
            i = self.calls % len(draft)
            draft[i] = (draft[i] + 1) % 1000
        return draft


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen35"])
def test_greedy_output_is_identical_whatever_the_drafts(tiny_gguf, family):
    from hf2q.engine.generate import generate_once
    from tests.engine_support import random_tokens

    runner = _runner(tiny_gguf(family))
    params = SamplingParams(max_tokens=40, temperature=0.0)
    prompt = random_tokens(30, seed=7)
    plain = generate_once(runner, prompt, params, ignore_eos=True)
    spec = generate_once(runner, prompt, params, ignore_eos=True, draft_tokens=4,
                         drafter=_Oracle(len(prompt), plain["tokens"]))
    assert spec["tokens"] == plain["tokens"]
    assert 0 < spec["accepted_tokens"] < spec["drafted_tokens"]
    assert spec["decode_forwards"] < len(plain["tokens"]) // 2


def test_sampled_generation_with_drafts_is_seeded_and_in_budget(tiny_gguf):
    from hf2q.engine.generate import generate_once

    runner = _runner(tiny_gguf("qwen3"))
    params = SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=3)
    prompt = _repetitive_prompt(2)
    a = generate_once(runner, prompt, params, ignore_eos=True, draft_tokens=4)
    b = generate_once(runner, prompt, params, ignore_eos=True, draft_tokens=4)
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 30


# ---------------------------------------------------------------------------- real model, CLI

EDIT = ("Repeat this code exactly, with `total` renamed to `acc`:\n\n"
        "def add_all(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n")


@pytest.mark.slow
def test_cli_speculative_output_is_byte_identical_on_the_real_model(smollm2_gguf, cli):
    base = ("generate", "--model", smollm2_gguf, "--prompt", EDIT, "--max-tokens", "48")
    plain = cli(*base)
    spec = cli(*base, "--speculative", "ngram", "--draft-tokens", "5")
    assert plain.code == 0 and spec.code == 0, (plain.err, spec.err)
    assert spec.out == plain.out and "def add_all" in plain.out
    bench = cli(*base, "--speculative", "ngram", "--benchmark", "--json")
    assert bench.code == 0, bench.err
    last = json.loads(bench.out.strip().splitlines()[-1])
    assert last["speculative"] == "ngram" and last["draft_tokens"] == 6
    assert 0.0 < last["acceptance_rate"] <= 1.0 and last["tokens_per_forward"] > 1.0


def test_draft_tokens_without_speculative_is_a_usage_error(smollm2_gguf, cli):
    res = cli("generate", "--model", smollm2_gguf, "--prompt", "hi", "--draft-tokens", "4")
    assert res.code == 2 and "--speculative ngram" in res.err
    res = cli("generate", "--model", smollm2_gguf, "--prompt", "hi", "--speculative", "mtp")
    assert res.code == 3 and "multi-token-prediction" in res.err  # a llama file has no MTP head
