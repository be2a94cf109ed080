"""Speculative decoding on DeepSeek-V4's compact cache, through the serving runtime.

A verify forward publishes every length inside it as a reuse point (its rows are all held until the
next forward), so a partial accept trims to the accepted length: each verify starts where the last
forward left the sequence, never again at a start an earlier verify already fed (the re-feed a cache
that could only return to the verify's start needed). The reference is plain greedy decoding on the
engine (``tests/test_api_real_deepseek4.py`` shows the runtime gives the same without drafts).

The tiny fixture's weights are random, so its greedy text never repeats itself; the prompt therefore
starts with that text (the greedy continuation of its random tail), which the n-gram drafter then
proposes — the continuation of the whole prompt follows it for a few tokens and then departs from it,
so drafts are accepted in full, in part and not at all.
"""

from __future__ import annotations

import numpy as np
import pytest

from hf2q.actors.runtime import open_runtime
from hf2q.engine.runner import MlxModelRunner
from hf2q.sched.contracts import GenerationRequest, RuntimeConfig, SamplingParams, Token
from tests.engine_support import random_tokens
from tests.test_engine_deepseek4 import deepseek4_gguf

N_NEW = 24
CTX = 512


class CountingRunner:
    """The real runner, recording where each forward starts: ``(kind, length before, tokens fed)``."""

    def __init__(self, runner):
        self._runner, self.forwards = runner, []

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def verify(self, seq, tokens):
        self.forwards.append(("verify", seq.length, len(tokens)))
        return self._runner.verify(seq, tokens)

    def decode(self, seqs, tokens):
        self.forwards.extend(("decode", s.length, 1) for s in seqs)
        return self._runner.decode(seqs, tokens)

    def decode_async(self, seqs, tokens, samplers):
        self.forwards.extend(("decode", s.length, 1) for s in seqs)
        return self._runner.decode_async(seqs, tokens, samplers)


def _greedy(runner, prompt: list[int], n: int) -> list[int]:
    seq = runner.new_sequence()
    logits, out = runner.prefill(seq, prompt), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = runner.decode([seq], [out[-1]])[0]
    return out


@pytest.fixture(scope="module")
def case():
    runner = MlxModelRunner.load(deepseek4_gguf(), ctx=CTX)
    tail = random_tokens(200, low=3, high=49152, seed=5)
    prompt = _greedy(runner, tail, N_NEW) + tail
    return runner, prompt, _greedy(runner, prompt, N_NEW)


def test_a_partial_accept_stops_inside_the_verify(case):
    """After a verify, every length inside it is a reuse point; trimmed to one, the next step gives
    what a cold prefill of that text gives."""
    runner, prompt, reference = case
    seq = runner.new_sequence()
    runner.prefill(seq, prompt)
    start = seq.length
    fed = reference[:5]
    runner.verify(seq, fed)
    assert set(range(start, start + len(fed) + 1)) <= set(seq.published_points)
    seq.trim(start + 2)
    assert seq.reuse_points()[-1] == start + 2
    cold = runner.new_sequence()
    runner.prefill(cold, prompt + fed[:2])
    assert float(np.abs(runner.decode([seq], [fed[2]])[0] - runner.decode([cold], [fed[2]])[0]).max()) < 4e-5


async def test_runtime_speculative_output_is_greedy_without_refeeding(case):
    runner, prompt, reference = case
    counting = CountingRunner(runner)
    async with open_runtime(lambda: counting, RuntimeConfig(slots=1, ctx=CTX, draft_tokens=6,
                                                            gpu_deadline_s=300)) as rt:
        assert await rt.wait_ready(), rt.readiness()
        counting.forwards.clear()  # the warm-up's
        ch = await rt.submit(GenerationRequest("spec", tuple(prompt), SamplingParams(max_tokens=N_NEW)))
        async with ch:
            events = [e async for e in ch]
        counters = rt.snapshot().counters
    assert [e.token_id for e in events if isinstance(e, Token)] == reference
    steps = [f for f in counting.forwards if f[1] >= len(prompt)]  # (the prompt's last chunk may be a verify row)
    verifies = [f for f in steps if f[0] == "verify"]
    starts = [f[1] for f in steps]
    assert starts == sorted(set(starts)), f"a forward fed again from an earlier start: {steps}"
    # some verify kept only part of its tokens: the next forward starts inside it
    partial = [(s, n) for (kind, s, n), nxt in zip(steps, starts[1:]) if kind == "verify" and s + 1 <= nxt < s + n]
    assert partial, steps
    assert 0 < counters["accepted_draft_tokens"] < counters["drafted_tokens"]
    assert verifies and len(steps) < len(reference)  # drafts saved forwards
