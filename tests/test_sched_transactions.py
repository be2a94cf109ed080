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
