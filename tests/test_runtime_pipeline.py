"""The decode pipeline of the runtime: the GPU owner keeps every decoding request in every step
and submits the next step before trio streams the last one's tokens.

Fake engine (tests/fakes) with timed steps; references are written independently of the
runtime: ``expected_next_token`` for outputs, the engine's own ``Sampler`` for the vectorised
greedy path, the slot's former stop rules spelled out for ``DecodeLimits``.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import trio

from hf2q.engine.sampling import plain_greedy
from hf2q.engine.sampling.rows import Sampled, SampleError, guarded_sample, sample_rows
from hf2q.sched.contracts import RuntimeConfig
from hf2q.actors.runtime import open_runtime
from hf2q.engine.sampling import Sampler
from hf2q.sched.decoding import DecodeLimits
from hf2q.sched.contracts import GenerationRequest, SamplingParams, Token
from tests.fakes import FakeModelRunner
from tests.test_runtime import collect, greedy, terminal, tokens_of


def old_rule(tok, emitted, resident, eos, stop_ids, max_tokens, ctx):
    """The slot's checks before the pipeline, in their order: stop ids, then (after sending)
    max_tokens and the context."""
    if tok in eos or tok in stop_ids:
        return "stop"
    if emitted + 1 >= max_tokens:
        return "length"
    if resident + 1 > ctx:
        return "length"
    return None


def test_decode_limits_match_the_slot_rules():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        eos, stop = frozenset(rng.integers(0, 6, 2).tolist()), frozenset(rng.integers(0, 6, 1).tolist())
        max_tokens, ctx = int(rng.integers(1, 8)), int(rng.integers(4, 12))
        tok, emitted, resident = int(rng.integers(0, 8)), int(rng.integers(0, 8)), int(rng.integers(0, 12))
        got = DecodeLimits(eos, stop, max_tokens, ctx).after_token(tok, emitted, resident)
        assert got == old_rule(tok, emitted, resident, eos, stop, max_tokens, ctx)


class _Work:
    def __init__(self, sampler, constraint=None):
        self.sampler, self.constraint, self.history, self.slot = sampler, constraint, [], 0


def test_vectorised_greedy_rows_equal_the_sampler():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 500)).astype(np.float32)
    logits[1, [7, 300]] = logits[1].max() + 1.0  # a tie: the lower id wins, as in the sampler
    logits[4, :] = -np.inf  # nothing can be sampled: an error of that request alone
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),  # needs the sampler
              SamplingParams(temperature=0.0, repetition_penalty=1.3),  # needs the sampler
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)]
    works = [_Work(Sampler(p)) for p in params]
    works[3].history = [int(np.argmax(logits[3]))]
    assert [plain_greedy(w.sampler, w.constraint) for w in works] == [True, True, False, False, True, False]
    got = sample_rows(works, logits)
    ref = [guarded_sample(_Work(Sampler(p)) if i != 3 else works[3], logits[i]) for i, p in enumerate(params)]
    for i, (g, r) in enumerate(zip(got, ref)):
        if isinstance(r, SampleError):
            assert g == r
        else:
            assert isinstance(g, Sampled) and g.token_id == r.token_id, i
    assert got[1].token_id == 7
    assert got[0].logprob is None and got[2].logprob is not None and len(got[2].top_logprobs) == 2


async def test_the_next_step_is_submitted_before_trio_streams_the_tokens():
    """Trio-side work per token (here 15 ms in an event hook: JSON, SSE, a slow logger) runs while
    the engine computes the next step; before the pipeline it was added to every step."""
    fake = FakeModelRunner(step_latency_s=0.025)

    def slow_hook(request_id, event):
        if isinstance(event, Token):
            time.sleep(0.015)

    async with open_runtime(fake.factory(), RuntimeConfig(slots=1, gpu_deadline_s=None,
                                                          on_event=slow_hook)) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(GenerationRequest("a", (5, 6, 7), SamplingParams(max_tokens=24))))
    assert tokens_of(ev) == greedy(fake, [5, 6, 7], 24)
    decodes = [(s, e) for kind, s, e in fake.spans if kind == "decode"]
    assert len(decodes) == 23
    gaps = sorted(b[0] - a[1] for a, b in itertools.pairwise(decodes))
    assert gaps[len(gaps) // 2] < 0.008, gaps  # the engine does not wait for the 15 ms per token


async def test_every_decoding_request_is_in_every_step_and_none_runs_past_its_end():
    fake = FakeModelRunner(step_latency_s=0.002)
    n = 20
    prompts = [[10 + i, 20, 30, 40] for i in range(4)]
    async with open_runtime(fake.factory(), RuntimeConfig(slots=4, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        results: list = [None] * 4

        async def one(i):
            results[i] = await collect(await rt.submit(GenerationRequest(f"r{i}", tuple(prompts[i]),
                                                                         SamplingParams(max_tokens=n))))
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        counters = rt.snapshot().counters
    for i in range(4):
        assert tokens_of(results[i]) == greedy(fake, prompts[i], n)
        assert terminal(results[i]).reason == "length"
    sizes = fake.decode_batch_sizes
    assert sum(sizes) == 4 * (n - 1)  # the first token comes from the prefill; no step after max_tokens
    assert sizes.count(4) >= n - 4  # joined one by one (one prefill per step), then always all four
    assert max(sizes) == 4 and counters["decode_batch_tokens"] == sum(sizes)


async def test_end_of_sequence_stops_the_run_without_an_extra_step():
    fake = FakeModelRunner(eos_at_length=12)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(GenerationRequest("a", (3, 4, 5), SamplingParams(max_tokens=50))))
    emitted = tokens_of(ev)
    assert emitted == greedy(fake, [3, 4, 5], 50) and len(emitted) == 12 - 3
    assert terminal(ev).reason == "stop"
    assert len(fake.decode_batch_sizes) == len(emitted)  # the last decode produced the end-of-sequence


@pytest.mark.parametrize("read", [1, 4])
async def test_a_client_leaving_mid_decode_leaves_a_slot_that_reuses_correctly(read):
    """The engine may already run one more step for a request whose client just left; the extra
    position in its KV must never leak into the next request on that slot."""
    fake = FakeModelRunner(step_latency_s=0.003)
    prompt = [11, 12, 13, 14, 15]
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        got = []
        ch = await rt.submit(GenerationRequest("a", tuple(prompt), SamplingParams(max_tokens=200)))
        async with ch:
            async for e in ch:
                if isinstance(e, Token):
                    got.append(e.token_id)
                    if len(got) == read:
                        break
        with trio.fail_after(10):
            while rt.snapshot().slots[0].phase != "idle":
                await trio.sleep(0.01)
        assert rt.snapshot().counters["cancelled"] == 1
        follow = prompt + got + [42, 43]
        ev = await collect(await rt.submit(GenerationRequest("b", tuple(follow), SamplingParams(max_tokens=6))))
    assert ev[0].cached_tokens >= len(prompt) + read - 1
    assert tokens_of(ev) == greedy(fake, follow, 6)
