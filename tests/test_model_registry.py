"""The several-model registry over fake runners (tests/fakes): real runtimes, the real shared
engine thread. Expected tokens come from the fake model's own rule, not from the registry."""

from __future__ import annotations

import threading

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf2q.actors.model_registry import Entry, ModelRegistry
from hf2q.sched.contracts import AdmissionRejected, RuntimeConfig
from tests.fakes import FakeModelRunner
from tests.test_runtime import collect, greedy, req, terminal, tokens_of

CONFIG = RuntimeConfig(slots=1, gpu_deadline_s=None)


def entry(name: str, fake: FakeModelRunner, need: int = 10, kind: str = "chat") -> Entry:
    return Entry(name, None, kind, need, None, CONFIG, fake.factory)


async def generate(registry: ModelRegistry, e: Entry, prompt, n: int = 5) -> list[int]:
    await registry.acquire(e)
    try:
        events = await collect(await e.runtime.submit(req(f"r-{e.model_id}", prompt, max_tokens=n)))
    finally:
        registry.release(e)
    assert terminal(events).reason in ("length", "stop")
    return tokens_of(events)


async def test_lru_eviction_reload_and_one_engine_thread_for_every_model():
    fa, fb = FakeModelRunner(vocab_size=97), FakeModelRunner(vocab_size=89)
    a, b = entry("a", fa), entry("b", fb)
    registry = ModelRegistry([a, b], budget_bytes=15, wait_s=1.0)  # room for one of them
    prompt = [5, 6, 7, 8]
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        first = await generate(registry, a, prompt)
        assert (a.state, b.state) == ("ready", "unloaded")
        assert await generate(registry, b, prompt) == greedy(fb, prompt, 5)
        assert (a.state, b.state, a.evictions, b.evictions) == ("unloaded", "ready", 1, 0)
        again = await generate(registry, a, prompt)  # reloaded: same greedy output
        assert (a.loads, b.loads, b.evictions, registry.resident_bytes) == (2, 1, 1, 10)
        nursery.cancel_scope.cancel()
    assert first == again == greedy(fa, prompt, 5)
    # both models were built in, and only ever called from, the one shared engine thread
    assert fa.threads == fb.threads == {fa.created_in_thread} == {fb.created_in_thread}
    assert fa.created_in_thread != threading.get_ident()


async def test_a_busy_model_is_never_evicted_the_other_request_waits_then_429s():
    fa, fb = FakeModelRunner(), FakeModelRunner()
    a, b = entry("a", fa), entry("b", fb)
    registry = ModelRegistry([a, b], budget_bytes=15, wait_s=0.3)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await registry.acquire(a)  # a request holds `a`
        with pytest.raises(AdmissionRejected) as refused:
            await registry.acquire(b)
        assert (refused.value.status, refused.value.code, refused.value.retry_after) == (429, "models_memory_full", 1)
        assert (a.state, a.evictions, b.state, b.active) == ("ready", 0, "unloaded", 0)
        with pytest.raises(AdmissionRejected) as busy:
            await registry.unload(a)
        assert (busy.value.status, busy.value.code) == (409, "model_busy")

        got = []

        async def wait_for_b():
            got.append(await registry.acquire(b))

        nursery.start_soon(wait_for_b)
        await trio.sleep(0.1)
        assert not got and a.state == "ready"  # still waiting: `a` is busy
        registry.release(a)  # the request on `a` ends: now `a` may go
        with trio.fail_after(5):
            while not got:
                await trio.sleep(0.01)
        assert (a.state, a.evictions, b.state) == ("unloaded", 1, "ready")
        registry.release(b)
        await registry.unload(b)  # idle: unloaded on request, not counted as an eviction
        assert (b.state, b.evictions, registry.resident_bytes) == ("unloaded", 0, 0)
        nursery.cancel_scope.cancel()


async def test_two_models_that_fit_stay_resident_and_a_failed_load_is_retried_after_the_back_off():
    fa, fb = FakeModelRunner(), FakeModelRunner()
    calls = []

    def flaky(fails: int):
        def build():
            calls.append(1)
            if len(calls) <= fails:
                raise RuntimeError("disk on fire")
            return fb.factory()()
        return lambda: build

    a = entry("a", fa)
    b = Entry("b", None, "chat", 10, None, CONFIG, flaky(2))
    backoff = 1.5
    registry = ModelRegistry([a, b], budget_bytes=20, wait_s=1.0, load_backoff_s=backoff)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await generate(registry, a, [3, 4])
        with pytest.raises(AdmissionRejected) as failed:
            await registry.acquire(b)
        assert (failed.value.status, failed.value.code) == (503, "model_load_failed")
        assert 1 <= failed.value.retry_after <= 2  # the back-off's seconds left, rounded up
        assert "disk on fire" in failed.value.message and b.state == "failed" and b.active == 0
        while trio.current_time() < b.failed_at + backoff - 0.5:  # within the back-off: refused at once, no load
            with pytest.raises(AdmissionRejected) as again:
                await registry.acquire(b)
            assert again.value.code == "model_load_failed" and "disk on fire" in again.value.message
            assert len(calls) == 1 and b.active == 0
            await trio.sleep(0.1)
        await trio.sleep_until(b.failed_at + backoff + 0.05)
        with pytest.raises(AdmissionRejected):  # past it: tried again (and fails again)
            await registry.acquire(b)
        assert len(calls) == 2
        await registry.load(b)  # the operator's load does not wait out the back-off: loads now
        assert len(calls) == 3 and b.state == "ready"
        assert await generate(registry, b, [3, 4]) == greedy(fb, [3, 4], 5)
        assert (a.state, b.state, a.evictions) == ("ready", "ready", 0)  # both fit: nothing evicted
        nursery.cancel_scope.cancel()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(needs=st.lists(st.integers(1, 10), min_size=2, max_size=4),
       ops=st.lists(st.tuples(st.sampled_from(["hold", "release", "use"]), st.integers(0, 3)), max_size=8),
       spare=st.integers(0, 10))
def test_any_order_of_requests_keeps_the_budget_and_never_evicts_a_held_model(needs, ops, spare):
    budget = max(needs) + spare
    fakes = [FakeModelRunner() for _ in needs]
    entries = [entry(f"m{i}", f, need) for i, (f, need) in enumerate(zip(fakes, needs))]
    registry = ModelRegistry(entries, budget_bytes=budget, wait_s=0.05)

    async def main():
        held: list[Entry] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(registry.run)
            for op, i in ops:
                e = entries[i % len(entries)]
                if op == "release":
                    if held:
                        registry.release(held.pop(i % len(held)))
                    continue
                try:
                    if op == "hold":
                        held.append(await registry.acquire(e))
                    else:
                        assert await generate(registry, e, [4, 5, 6], 2) == greedy(fakes[entries.index(e)],
                                                                                 [4, 5, 6], 2)
                except AdmissionRejected as refused:
                    assert refused.code == "models_memory_full"
                    # refused only when the held models leave no room for it
                    assert sum({id(h): h.need_bytes for h in held}.values()) + e.need_bytes > budget
                assert registry.resident_bytes <= budget
                assert all(h.state == "ready" for h in held)  # a held model is never evicted
            for h in held:
                registry.release(h)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def test_a_step_queued_behind_another_models_load_is_not_declared_hung():
    """The GPU deadline counts from when a model's job begins in the shared thread, not while it
    waits behind another model's slow load."""
    import time

    fa, fb = FakeModelRunner(step_latency_s=0.01), FakeModelRunner()

    def slow_load():
        def build():
            time.sleep(1.0)  # three times the deadline below
            return fb.factory()()
        return build

    deadline = RuntimeConfig(slots=1, gpu_deadline_s=0.3)
    a = Entry("a", None, "chat", 10, None, deadline, fa.factory)
    b = Entry("b", None, "chat", 10, None, deadline, slow_load)
    registry = ModelRegistry([a, b], budget_bytes=20, wait_s=1.0)
    prompt = [9, 8, 7]
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await registry.acquire(a)
        events = await a.runtime.submit(req("long", prompt, max_tokens=60))
        nursery.start_soon(registry.load, b)  # b's load runs in the one thread while `a` decodes
        got = await collect(events)
        registry.release(a)
        with trio.fail_after(10):
            while b.state != "ready":
                await trio.sleep(0.05)
        assert a.runtime.readiness() == (True, "ready")
        nursery.cancel_scope.cancel()
    assert terminal(got).reason == "length" and tokens_of(got) == greedy(fa, prompt, 60)


async def test_a_model_whose_engine_faulted_is_loaded_afresh_by_its_next_request():
    from hf2q.sched.contracts import Failed

    fake = FakeModelRunner()
    a = entry("a", fake)
    registry = ModelRegistry([a], budget_bytes=10, wait_s=1.0)
    prompt = [11, 12, 13]
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        await registry.acquire(a)
        fake.inject_fault("decode")
        events = await collect(await a.runtime.submit(req("boom", prompt, max_tokens=5)))
        registry.release(a)
        failed = terminal(events)
        assert isinstance(failed, Failed) and failed.code == "engine_unhealthy"
        assert await generate(registry, a, prompt) == greedy(fake, prompt, 5)  # a fresh engine
        assert (a.loads, a.evictions, a.state) == (2, 0, "ready")
        nursery.cancel_scope.cancel()


async def test_a_hung_step_fails_the_other_models_in_time_and_is_not_reloaded():
    from hf2q.sched.contracts import Failed

    fa, fb = FakeModelRunner(), FakeModelRunner()
    deadline = RuntimeConfig(slots=1, gpu_deadline_s=0.3)
    a = Entry("a", None, "chat", 10, None, deadline, fa.factory)
    b = Entry("b", None, "chat", 10, None, deadline, fb.factory)
    registry = ModelRegistry([a, b], budget_bytes=20, wait_s=1.0)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(registry.run)
            await registry.acquire(a)
            await registry.acquire(b)
            fa.inject_hang("decode")
            hung = await a.runtime.submit(req("hang", [1, 2, 3], max_tokens=5))
            while not fa.hanging.is_set():
                await trio.sleep(0.01)
            with trio.fail_after(5):  # b's step waits behind the hung one, but not for ever
                events = await collect(await b.runtime.submit(req("behind", [4, 5, 6], max_tokens=5)))
                stuck = await collect(hung)
            for ended in (terminal(events), terminal(stuck)):
                assert isinstance(ended, Failed) and ended.code == "engine_unhealthy"
            registry.release(a)
            with trio.fail_after(1):  # the thread is stuck: no reload is tried, the model stays as it is
                await registry.acquire(a)
            assert a.state == "ready" and a.loads == 1 and not a.runtime.readiness()[0]
            registry.release(a)
            registry.release(b)
            fa.hang_release.set()  # lets the thread free the models' memory at shutdown
            nursery.cancel_scope.cancel()
    finally:
        fa.hang_release.set()
