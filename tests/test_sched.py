"""The pure scheduler: slot ledger routing, KV budget decisions, step planning (no trio, no MLX)."""

from __future__ import annotations

import pytest

from hf2q.sched.budget import Admit, KvBudget, Never, Wait, cached_after_restore
from hf2q.sched.ledger import SlotLedger, common_prefix, reusable_prefix
from hf2q.sched.planner import StepPlanner, prefill_chunks


def test_common_and_reusable_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    # the last prompt token is always recomputed: it yields the logits of the first new token
    assert reusable_prefix([1, 2, 3, 9], [1, 2, 3]) == 2
    assert reusable_prefix([1, 2, 3], [1, 2, 3, 4, 5]) == 3


def test_whole_history_reuse_for_caches_that_cannot_trim():
    """Hybrid recurrent models: a slot's cache is reused whole (the prompt extends it) or not at all."""
    assert reusable_prefix([1, 2, 3], [1, 2, 3, 4], whole_history_only=True) == 3
    assert reusable_prefix([1, 2, 3, 9], [1, 2, 3, 4], whole_history_only=True) == 0
    assert reusable_prefix([1, 2, 3], [1, 2, 3], whole_history_only=True) == 0  # the last token is recomputed
    led = SlotLedger(2, whole_history_only=True)
    led.acquire(0, 0)
    led.extend(0, [1, 2, 3, 4])
    led.release(0)
    assert led.route([1, 2, 3, 4, 5]).cached_tokens == 4
    assert led.route([1, 2, 3, 7]).cached_tokens == 0


def test_reuse_points_of_hybrid_caches():
    """A hybrid model's cache returns only to its reuse points: the longest one inside the common
    prefix is what a prompt keeps; acquiring forgets the points beyond what was kept."""
    held = list(range(1, 11))
    assert reusable_prefix(held, held[:7] + [99], points=(0, 4, 8, 10)) == 4
    assert reusable_prefix(held, held + [11], points=(0, 4, 8, 10)) == 10
    assert reusable_prefix(held, held[:3], points=(0, 4, 8, 10)) == 0
    led = SlotLedger(1, whole_history_only=True)
    led.acquire(0, 0)
    led.extend(0, held)
    led.replace(0, held, (0, 4, 8, 10, 12))  # a point past the ledger's tokens is not trusted
    led.release(0)
    assert led.entries[0].points == (0, 4, 8, 10)
    assert led.route(held[:9] + [50]).cached_tokens == 8
    led.acquire(0, 8)
    assert led.entries[0].points == (0, 4, 8)
    led.release(0)
    assert led.evict(0) == 8 and led.route(held).cached_tokens == 0


def test_route_prefers_longest_prefix_then_empty_then_lru():
    led = SlotLedger(3)
    for slot, toks in ((0, [1, 2, 3, 4]), (1, [1, 2, 9, 9])):
        led.acquire(slot, 0)
        led.extend(slot, toks)
        led.release(slot)
    r = led.route([1, 2, 3, 4, 5, 6])
    assert (r.slot, r.cached_tokens) == (0, 4)
    r = led.route([1, 2, 9, 7])
    assert (r.slot, r.cached_tokens) == (1, 3)
    # nothing shared: the empty slot 2 rather than evicting a cache
    r = led.route([50, 51])
    assert (r.slot, r.cached_tokens) == (2, 0)
    led.acquire(2, 0)
    led.extend(2, [50, 51])
    # no empty slot left: the least recently used one (slot 0 was released first)
    r = led.route([70, 71])
    assert (r.slot, r.cached_tokens) == (0, 0)
    led.acquire(0, 0)
    led.acquire(1, 0)
    assert led.route([1, 2]) is None  # all busy


def test_ledger_acquire_truncates_and_guards_double_release():
    led = SlotLedger(1)
    led.acquire(0, 0)
    led.extend(0, [5, 6, 7, 8])
    led.release(0)
    led.acquire(0, 2)
    assert led.tokens(0) == [5, 6]
    led.release(0)
    with pytest.raises(RuntimeError):
        led.release(0)
    with pytest.raises(ValueError):
        led.acquire(0, 3)


def _budget(tokens: int, ctx: int = 100, bpt: int = 10) -> KvBudget:
    return KvBudget(bytes_per_token=bpt, budget_bytes=tokens * bpt, ctx=ctx)


def test_never_fits():
    b = _budget(150)
    assert isinstance(b.never_fits(100, 10), Never) and b.never_fits(100, 10).code == "context_length_exceeded"
    assert b.never_fits(99, 10) is None  # reservation is capped at ctx: 100 tokens
    small = _budget(50)
    n = small.never_fits(40, 20)
    assert n.code == "kv_budget_unsatisfiable"
    assert small.never_fits(40, 10) is None


def test_decide_waits_for_budget_and_evicts_idle_caches_lru():
    led = SlotLedger(3)
    b = _budget(100)
    d = b.decide(led, {}, list(range(30)), 30)
    assert d == Admit(0, 0)
    led.acquire(0, 0)
    res = {0: 60}
    # 60 reserved + 60 needed > 100 → wait for the budget, not for a slot
    assert b.decide(led, res, list(range(100, 130)), 30) == Wait("kv")
    assert isinstance(b.decide(led, res, list(range(100, 120)), 20), Admit)
    # idle caches are evicted (LRU first) when the newcomer needs their room
    led.release(0)
    led.extend(0, list(range(30)))  # slot 0 now idle, holding 30 tokens
    led.acquire(1, 0)
    led.extend(1, [7] * 40)
    led.release(1)  # slot 1 idle with 40 tokens, used more recently
    d = b.decide(led, {}, [900] * 40, 20)  # needs 60; with 30 + 40 cached elsewhere → evict the LRU
    assert isinstance(d, Admit) and d.slot == 2 and d.evict == (0,)
    # a prompt sharing slot 1's cache goes there and keeps it
    d = b.decide(led, {}, [7] * 45, 10)
    assert d.slot == 1 and d.cached_tokens == 40 and d.evict == ()


def test_decide_waits_for_slots():
    led = SlotLedger(1)
    led.acquire(0, 0)
    assert _budget(1000).decide(led, {0: 10}, [1, 2, 3], 5) == Wait("slots")


def test_next_turn_waits_for_its_finishing_slot_rather_than_starting_cold():
    """An agent sends turn 2 the moment turn 1's last event arrives, before its slot reports back."""
    led = SlotLedger(2)
    b = _budget(10_000, ctx=1000)
    turn1 = list(range(100, 200))
    led.acquire(0, 0)
    led.extend(0, turn1)
    turn2 = turn1 + [5, 6, 7] * 10
    assert b.decide(led, {0: 120}, turn2, 20) == Admit(1, 0)  # still running: the idle slot it is
    led.mark_finishing(0, turn1)
    assert b.decide(led, {0: 120}, turn2, 20) == Wait("slots")  # ended: wait for the 99 reusable tokens
    assert b.decide(led, {0: 120}, [9] * 50, 20) == Admit(1, 0)  # an unrelated prompt does not wait
    led.mark_finishing(0, [1, 2, 3])  # only the first mark counts
    assert led.entries[0].finishing == tuple(turn1)
    led.release(0)
    assert led.entries[0].finishing is None
    assert b.decide(led, {}, turn2, 20) == Admit(0, 100)
    # a finishing slot that saves less than the threshold over the best idle one is not waited for
    led.acquire(0, 100)
    led.mark_finishing(0, turn1 + [1] * 4)
    assert not led.worth_waiting_for(turn2 + [1], 99, 16)


def test_cached_after_restore_takes_longer_prefix():
    assert cached_after_restore([1, 2], [1, 2, 3, 4, 5], 4) == 4
    assert cached_after_restore([1, 2, 3, 4], [1, 2, 3, 4, 5], 2) == 4
    assert cached_after_restore([], [1, 2, 3], 3) == 2  # one token must remain to compute


def test_prefill_chunks():
    assert prefill_chunks(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert prefill_chunks(3, 4, 2048) == [(3, 4)]
    assert prefill_chunks(5, 5, 4) == []
    with pytest.raises(ValueError):
        prefill_chunks(0, 1, 0)


def test_planner_decode_first_and_round_robin():
    p = StepPlanner(4)
    # every decoding slot is in every step, plus one prefill transaction
    s = p.plan(decode_ready=[3, 1], prefill_ready=[0, 2])
    assert s.decode == (1, 3) and s.prefill == 0
    s = p.plan(decode_ready=[1, 3], prefill_ready=[0, 2])
    assert s.prefill == 2  # the other cold prompt gets the next turn
    s = p.plan(decode_ready=[], prefill_ready=[0, 2])
    assert s.prefill == 0
    s = p.plan(decode_ready=[1], prefill_ready=[])
    assert s.decode == (1,) and s.prefill is None
    assert p.plan([], []).empty
