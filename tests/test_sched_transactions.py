"""Prefill transaction plans (``hf2q.sched.transactions``): sizes per family, the stable-prefix cut."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q.sched.contracts import ModelFacts, RuntimeConfig
from hf2q.sched.transactions import plan_transactions, transaction_tokens


def test_family_candidates_and_the_operator_override():
    assert transaction_tokens("gemma4", None) == 4096
    assert transaction_tokens("qwen35", None) == transaction_tokens("llama", None) == 2048
    assert transaction_tokens(None, None) == 2048
    assert transaction_tokens("gemma4", 512) == 512


def test_model_facts_name_the_family():
    class Runner:
        vocab_size, n_ctx_train, kv_bytes_per_token, eos_token_ids, is_embedding_model = 10, 64, 4, (1,), False
        arch = "gemma4"
    assert ModelFacts.of(Runner(), RuntimeConfig()).arch == "gemma4"


def test_a_transaction_ends_at_the_stable_prefix():
    assert plan_transactions(0, 10_000, 4096, 5000) == [(0, 4096), (4096, 5000), (5000, 9096), (9096, 10_000)]
    assert plan_transactions(0, 10, 4096, 7) == [(0, 7), (7, 10)]
    # a boundary already cached, at the end, or absent changes nothing
    for boundary in (0, 3, 10, 12):
        assert plan_transactions(3, 10, 4, boundary) == [(3, 7), (7, 10)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(1, 300), st.integers(1, 64), st.integers(0, 700))
def test_plans_cover_the_range_in_bounded_transactions(start, n, chunk, boundary):
    end = start + n
    plan = plan_transactions(start, end, chunk, boundary)
    assert plan[0][0] == start and plan[-1][1] == end
    assert all(a < b <= a + chunk for a, b in plan)
    assert all(b == c for (_, b), (c, _) in zip(plan, plan[1:]))
    if start < boundary < end:
        assert boundary in {b for _, b in plan}


async def test_the_runtime_prefills_gemma4_in_its_own_transactions_cut_at_the_stable_prefix():
    """Three cold prompts at once on a runner that reports ``gemma4``: every prompt is prefilled in
    transactions of the family's 4,096 rows, one of them ending at its stable prefix, one transaction
    per GPU step (so a step never computes more than 4,096 rows however many prompts wait); the greedy
    tokens are the fake's, whatever the cuts."""
    import trio

    from hf2q.actors.runtime import open_runtime
    from hf2q.sched.contracts import GenerationRequest, SamplingParams, Token
    from tests.fakes import FakeModelRunner, expected_next_token

    class Gemma4Fake(FakeModelRunner):
        arch = "gemma4"

    fake = Gemma4Fake(n_ctx_train=16384)
    prompts = {f"r{k}": ([(i * (k + 3)) % 90 + 3 for i in range(9000 + 500 * k)], 5000 + 301 * k) for k in range(3)}
    async with open_runtime(fake.factory(), RuntimeConfig(slots=3, gpu_deadline_s=None)) as rt:
        assert await rt.wait_ready()
        got: dict[str, list[int]] = {}

        async def run(rid):
            prompt, stable = prompts[rid]
            ch = await rt.submit(GenerationRequest(rid, tuple(prompt), SamplingParams(max_tokens=3), stable))
            async with ch:
                got[rid] = [e.token_id async for e in ch if isinstance(e, Token)]

        async with trio.open_nursery() as n:
            for rid in prompts:
                n.start_soon(run, rid)
        steps = rt.snapshot().counters["gpu_steps"]
    by_sequence: dict[int, list[int]] = {}
    for serial, rows in fake.prefill_log:
        by_sequence.setdefault(serial, []).append(rows)
    expected = {tuple(b - a for a, b in plan_transactions(0, len(p), 4096, s)) for p, s in prompts.values()}
    assert {tuple(rows) for rows in by_sequence.values()} == expected
    assert len(fake.prefill_log) <= steps  # one transaction per step at most
    for rid, (prompt, _) in prompts.items():
        hist, want = list(prompt), []
        for _ in range(3):
            want.append(expected_next_token(hist, fake.vocab_size, fake.eos_token_id, None))
            hist.append(want[-1])
        assert got[rid] == want
