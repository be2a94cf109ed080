"""The actor system end to end over the fake ModelRunner (tests/fakes): trio tasks, the real
GPU-owner thread, real channels. Expected tokens come from ``expected_next_token``, the fake
model's rule written independently of the runtime."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio
import trio.testing

from hf2q.sched.contracts import AdmissionRejected, RuntimeConfig

from hf2q.actors.runtime import open_runtime
from hf2q.sched.contracts import (Admitted, EmbeddingRequest, Failed, Finished, GenerationRequest,
                                 PrefillProgress, SamplingParams, Token)
from tests.fakes import FakeModelRunner, expected_next_token


def greedy(fake: FakeModelRunner, prompt, n: int) -> list[int]:
    hist, out = list(prompt), []
    for _ in range(n):
        t = expected_next_token(hist, fake.vocab_size, fake.eos_token_id, fake.eos_at_length)
        if t == fake.eos_token_id:
            break
        out.append(t)
        hist.append(t)
    return out


def req(rid, prompt, max_tokens=8, **kw) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, **kw))


async def collect(ch, log=None, tag=None) -> list:
    events = []
    async with ch:
        async for ev in ch:
            events.append(ev)
            if log is not None:
                log.append((tag, ev))
    return events


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, Token)]


def terminal(events):
    ends = [e for e in events if isinstance(e, (Finished, Failed))]
    assert len(ends) == 1 and events[-1] is ends[0], events
    return ends[0]


async def started(fake, **cfg):
    cm = open_runtime(fake.factory(), RuntimeConfig(**{"gpu_deadline_s": None, **cfg}))
    rt = await cm.__aenter__()
    assert await rt.wait_ready()
    return cm, rt


async def test_generation_matches_the_model_and_runs_in_one_engine_thread():
    fake = FakeModelRunner()
    prompt = list(range(10, 40))
    async with open_runtime(fake.factory(), RuntimeConfig(slots=2, prefill_chunk=8)) as rt:
        assert rt.readiness()[0] is False or rt.readiness() == (True, "ready")
        assert await rt.wait_ready() and rt.readiness() == (True, "ready")
        events = await collect(await rt.submit(req("a", prompt, max_tokens=12)))
    assert isinstance(events[0], Admitted) and events[0].cached_tokens == 0 and events[0].prompt_tokens == 30
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert [p.done_tokens for p in progress] == [8, 16, 24, 30]
    assert fake.prefill_sizes == [8, 8, 8, 6]
    assert tokens_of(events) == greedy(fake, prompt, 12)
    end = terminal(events)
    assert end.reason == "length" and end.completion_tokens == 12 and end.prompt_tokens == 30
    # the runner was built in, and only ever called from, one thread that is not trio's
    assert fake.threads == {fake.created_in_thread}
    assert fake.created_in_thread != threading.get_ident()


async def test_eos_and_stop_token_ids_end_with_stop_and_are_not_sent():
    fake = FakeModelRunner(eos_at_length=25)
    prompt = list(range(3, 23))  # 20 tokens: eos is due after 5 generated tokens
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1)) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(req("a", prompt, max_tokens=50)))
        expect = greedy(fake, prompt, 50)
        assert tokens_of(ev) == expect and len(expect) == 5
        assert terminal(ev).reason == "stop" and fake.eos_token_id not in tokens_of(ev)
        stop_at = expect[2]
        ev = await collect(await rt.submit(req("b", prompt, max_tokens=50, stop_token_ids=frozenset({stop_at}))))
        assert tokens_of(ev) == expect[:2] and terminal(ev).reason == "stop"


async def test_routing_picks_the_slot_with_the_longest_prefix_and_reuse_is_exact():
    fake = FakeModelRunner()
    a = list(range(10, 60))
    b = list(range(200 % 97, 200 % 97 + 1)) + list(range(60, 90))
    async with open_runtime(fake.factory(), RuntimeConfig(slots=3, prefill_chunk=16)) as rt:
        await rt.wait_ready()
        async with trio.open_nursery() as n:
            res = {}

            async def run(name, p):
                res[name] = await collect(await rt.submit(req(name, p, max_tokens=6)))
            n.start_soon(run, "a", a)
            n.start_soon(run, "b", b)
        slot_a, slot_b = res["a"][0].slot, res["b"][0].slot
        assert slot_a != slot_b
        # a continuation of conversation A: prompt = A + its answer + new user tokens
        cont = a + tokens_of(res["a"]) + [5, 6, 7]
        before = len(fake.prefill_sizes)
        ev = await collect(await rt.submit(req("a2", cont, max_tokens=6)))
        adm = ev[0]
        assert adm.slot == slot_a
        # the slot holds A + all answer tokens but the last (never fed back): that much is reused
        assert adm.cached_tokens == len(a) + len(tokens_of(res["a"])) - 1
        assert sum(fake.prefill_sizes[before:]) == len(cont) - adm.cached_tokens
        assert terminal(ev).cached_tokens == adm.cached_tokens
        assert tokens_of(ev) == greedy(fake, cont, 6)
        # the same prompt again, cold on a fresh runtime with another chunk size: identical T=0 output
    cold = FakeModelRunner()
    async with open_runtime(cold.factory(), RuntimeConfig(slots=1, prefill_chunk=7)) as rt2:
        await rt2.wait_ready()
        ev_cold = await collect(await rt2.submit(req("c", cont, max_tokens=6)))
    assert ev_cold[0].cached_tokens == 0
    assert tokens_of(ev_cold) == tokens_of(ev)


async def test_decode_first_short_request_gets_a_token_before_a_long_prefill_ends():
    fake = FakeModelRunner(step_latency_s=0.002)
    long_prompt = [(i * 7) % 90 + 3 for i in range(1280)]
    short_prompt = [1, 2, 3, 4]
    log: list = []
    async with open_runtime(fake.factory(), RuntimeConfig(slots=2, prefill_chunk=32)) as rt:
        await rt.wait_ready()
        long_ch = await rt.submit(req("long", long_prompt, max_tokens=4))
        async with trio.open_nursery() as n:
            n.start_soon(collect, long_ch, log, "long")
            while not any(t == "long" and isinstance(e, PrefillProgress) for t, e in log):
                await trio.sleep(0.001)
            n.start_soon(collect, await rt.submit(req("short", short_prompt, max_tokens=20)), log, "short")
    first_short_token = next(i for i, (t, e) in enumerate(log) if t == "short" and isinstance(e, Token))
    long_prefill_done = next(i for i, (t, e) in enumerate(log) if t == "long" and isinstance(e, PrefillProgress)
                             and e.done_tokens == e.total_tokens)
    assert first_short_token < long_prefill_done
    # and it kept decoding between the long prompt's transactions: several short tokens before it ended
    short_tokens_before = sum(1 for t, e in log[:long_prefill_done] if t == "short" and isinstance(e, Token))
    assert short_tokens_before >= 5
    assert tokens_of([e for t, e in log if t == "short"]) == greedy(fake, short_prompt, 20)
    assert tokens_of([e for t, e in log if t == "long"]) == greedy(fake, long_prompt, 4)
    assert max(fake.prefill_sizes) == 32


async def test_decoding_slots_share_one_batched_forward():
    fake = FakeModelRunner(step_latency_s=0.001)
    prompts = [[i + 1, i + 2, i + 3] for i in range(4)]
    async with open_runtime(fake.factory(), RuntimeConfig(slots=4)) as rt:
        await rt.wait_ready()
        results = {}
        async with trio.open_nursery() as n:
            for i, p in enumerate(prompts):
                async def run(i=i, p=p):
                    results[i] = await collect(await rt.submit(req(f"r{i}", p, max_tokens=30)))
                n.start_soon(run)
        snap = rt.snapshot()
    for i, p in enumerate(prompts):
        assert tokens_of(results[i]) == greedy(fake, p, 30)
    sizes = fake.decode_batch_sizes
    assert max(sizes) == 4 and sizes.count(4) >= 25, sizes
    assert snap.counters["decode_batch_tokens"] == sum(sizes)


async def test_cancel_mid_prefill_frees_the_slot_once_and_the_next_request_reuses_it():
    fake = FakeModelRunner(step_latency_s=0.002)
    prompt = [(i * 5) % 90 + 3 for i in range(400)]
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1, prefill_chunk=40)) as rt:
        await rt.wait_ready()
        ch = await rt.submit(req("gone", prompt, max_tokens=10))
        seen = []
        async with ch:
            async for ev in ch:
                seen.append(ev)
                if isinstance(ev, PrefillProgress) and ev.done_tokens >= 120:
                    break  # leaving the block closes the channel: the client went away
        slot = rt._system.slots[0]
        with trio.fail_after(5):
            while slot.state != "idle":
                await trio.sleep(0.001)
        done_chunks = len(fake.prefill_sizes)
        assert done_chunks < 10  # it stopped long before the 10 chunks of the prompt
        released = [h for h in slot.fsm.history if h[1] == "released"]
        assert released == [("cancelled", "released", "idle")]
        assert rt.snapshot().counters["cancelled"] == 1
        ev = await collect(await rt.submit(req("next", prompt, max_tokens=3)))
        assert ev[0].slot == 0 and ev[0].cached_tokens == 40 * done_chunks
        assert tokens_of(ev) == greedy(fake, prompt, 3)
        assert [h[1] for h in slot.fsm.history].count("released") == 2


async def test_queue_full_is_429_and_impossible_requests_are_400():
    fake = FakeModelRunner(step_latency_s=0.002, n_ctx_train=256)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1, queue_capacity=1)) as rt:
        await rt.wait_ready()
        with pytest.raises(AdmissionRejected) as e:
            await rt.submit(req("huge", [3] * 256, max_tokens=4))
        assert (e.value.status, e.value.code, e.value.retry_after) == (400, "context_length_exceeded", None)
        running = await rt.submit(req("a", [5, 6, 7], max_tokens=100))
        queued = await rt.submit(req("b", [8, 9], max_tokens=3))
        with pytest.raises(AdmissionRejected) as e:
            await rt.submit(req("c", [10, 11], max_tokens=3))
        assert (e.value.status, e.value.code, e.value.retry_after) == (429, "queue_full", 1)
        assert rt.snapshot().queue_depth == 1
        await running.aclose()
        ev = await collect(queued)
        assert terminal(ev).reason == "length" and tokens_of(ev) == greedy(fake, [8, 9], 3)
        counters = rt.snapshot().counters
        assert counters["rejected_queue_full"] == 1 and counters["rejected_context_length_exceeded"] == 1
    fake2 = FakeModelRunner(n_ctx_train=1024, kv_bytes_per_token=100, vocab_size=512)
    cfg = RuntimeConfig(slots=2, kv_budget_bytes=100 * 300, queue_capacity=0)
    async with open_runtime(fake2.factory(), cfg) as rt:
        await rt.wait_ready()
        with pytest.raises(AdmissionRejected) as e:
            await rt.submit(req("big", range(3, 203), max_tokens=200))  # 400 tokens > budget of 300
        assert (e.value.status, e.value.code) == (400, "kv_budget_unsatisfiable")
        first = await rt.submit(req("a", range(3, 103), max_tokens=150))  # reserves 250 of 300
        with pytest.raises(AdmissionRejected) as e:
            await rt.submit(req("b", range(3, 53), max_tokens=50))  # a slot is free but the KV is not
        assert (e.value.status, e.value.code) == (429, "slot_budget_exceeded")
        await first.aclose()


async def test_request_waits_for_kv_budget_then_runs():
    fake = FakeModelRunner(kv_bytes_per_token=10, vocab_size=512)
    cfg = RuntimeConfig(slots=2, kv_budget_bytes=10 * 120, gpu_deadline_s=None)
    log: list = []
    async with open_runtime(fake.factory(), cfg) as rt:
        await rt.wait_ready()
        a = await rt.submit(req("a", range(3, 53), max_tokens=40))  # reserves 90 of 120
        b = await rt.submit(req("b", range(60, 90), max_tokens=10))  # needs 40: waits for a
        async with trio.open_nursery() as n:
            n.start_soon(collect, a, log, "a")
            n.start_soon(collect, b, log, "b")
        snap = rt.snapshot()
        rt_seq_lengths = [s.seq.length for s in rt._system.slots]  # the engine's view
    a_end = next(i for i, (t, e) in enumerate(log) if t == "a" and isinstance(e, Finished))
    b_admit = next(i for i, (t, e) in enumerate(log) if t == "b" and isinstance(e, Admitted))
    assert a_end < b_admit
    b_events = [e for t, e in log if t == "b"]
    assert tokens_of(b_events) == greedy(fake, list(range(60, 90)), 10)
    # b went to the empty slot; a's idle cache (89 tokens) had to be evicted to fit b's 40
    assert b_events[0].slot == 1
    assert snap.slots[0].resident_tokens == 0 and snap.slots[1].resident_tokens == 39
    assert rt_seq_lengths == [0, 39]


def collect_all(nursery, chans) -> list:
    """Start one collector per channel in ``nursery``; the list fills in as they finish."""
    results: list = [None] * len(chans)
    for i, ch in enumerate(chans):
        async def run(i=i, ch=ch):
            results[i] = await collect(ch)
        nursery.start_soon(run)
    return results


def assert_each_failed_unhealthy(results, mentioning: str) -> None:
    """Every collected request ended once, failed 503 ``engine_unhealthy`` naming the cause."""
    for ev in results:
        end = terminal(ev)
        assert isinstance(end, Failed) and (end.status, end.code) == (503, "engine_unhealthy")
        assert mentioning in end.message, end.message


async def _in_flight(rt, n_requests, prompt_len=30, max_tokens=200):
    chans = [await rt.submit(req(f"r{i}", [(i * 11 + j) % 90 + 3 for j in range(prompt_len)], max_tokens))
             for i in range(n_requests)]
    return chans


async def test_injected_fault_fails_every_request_exactly_once_and_poisons():
    fake = FakeModelRunner(step_latency_s=0.001)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=2, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        chans = await _in_flight(rt, 3)  # 2 running, 1 queued
        async with trio.open_nursery() as n:
            results = collect_all(n, chans)
            await trio.sleep(0.05)
            fake.inject_fault("decode", nth=2)
        assert_each_failed_unhealthy(results, "InjectedFault")
        ready, detail = rt.readiness()
        assert not ready and "InjectedFault" in detail
        calls = len(fake.calls)
        with pytest.raises(AdmissionRejected) as e:
            await rt.submit(req("late", [3, 4, 5]))
        assert (e.value.status, e.value.code, e.value.retry_after) == (503, "engine_unhealthy", 1)
        with pytest.raises(AdmissionRejected):
            await rt.embed(EmbeddingRequest("e", ((3, 4),)))
        await trio.sleep(0.05)
        assert len(fake.calls) == calls  # no GPU work after the fault
        snap = rt.snapshot()
        assert snap.state == "poisoned" and snap.counters["failed_engine_unhealthy"] == 3
        assert rt._system.gpu.state == "faulted"


@pytest.fixture
def slow_autojump_clock():
    # jumps virtual time only after 0.3 s of real idleness: the engine thread's real work never
    # looks like a hang, while a true hang reaches the (virtual) deadline in well under a second
    return trio.testing.MockClock(autojump_threshold=0.3)


async def test_injected_hang_expires_the_deadline_and_fails_everything_once(slow_autojump_clock):
    fake = FakeModelRunner()
    try:
        async with open_runtime(fake.factory(), RuntimeConfig(slots=2, gpu_deadline_s=30.0)) as rt:
            await rt.wait_ready()
            fake.inject_hang("decode", nth=3)
            chans = await _in_flight(rt, 3)
            t0 = trio.current_time()
            async with trio.open_nursery() as n:
                results = collect_all(n, chans)
            assert trio.current_time() - t0 >= 30.0
            assert_each_failed_unhealthy(results, "30 s")
            assert fake.hanging.is_set()
            ready, detail = rt.readiness()
            assert not ready and "hung" in detail
            with pytest.raises(AdmissionRejected) as e:
                await rt.submit(req("late", [3, 4, 5]))
            assert e.value.code == "engine_unhealthy"
            assert rt.snapshot().state == "poisoned"
    finally:
        fake.hang_release.set()


async def test_slow_reader_is_cancelled_alone():
    fake = FakeModelRunner(step_latency_s=0.001)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=2, token_buffer=4)) as rt:
        await rt.wait_ready()
        slow = await rt.submit(req("slow", [3, 4, 5], max_tokens=60))
        fast = await collect(await rt.submit(req("fast", [6, 7, 8], max_tokens=60)))
        assert terminal(fast).reason == "length" and len(tokens_of(fast)) == 60
        slow_events = await collect(slow)
        end = terminal(slow_events)
        assert isinstance(end, Failed) and end.code == "reader_too_slow"
        assert len(slow_events) <= 5  # at most token_buffer events plus the terminal one


async def test_context_limit_ends_with_length():
    fake = FakeModelRunner(n_ctx_train=4096)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1, ctx=24)) as rt:
        await rt.wait_ready()
        assert rt.runner_info["ctx"] == 24
        ev = await collect(await rt.submit(req("a", range(3, 23), max_tokens=50)))
        # 20 prompt tokens + 4 fed answer tokens fill the 24-token context; the 5th is sampled, not fed
        assert terminal(ev).reason == "length" and tokens_of(ev) == greedy(fake, range(3, 23), 5)


async def test_snapshot_during_prefill_and_graceful_drain():
    fake = FakeModelRunner(step_latency_s=0.003)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=2, prefill_chunk=16)) as rt:
        await rt.wait_ready()
        ch = await rt.submit(req("a", [(i % 90) + 3 for i in range(320)], max_tokens=5))
        events = []
        drained = []
        async with ch, trio.open_nursery() as n:
            async for ev in ch:
                events.append(ev)
                if isinstance(ev, PrefillProgress) and ev.done_tokens == 160:
                    snap = rt.snapshot().slots[0]
                    async def drain():
                        drained.append(await rt.drain(10))
                    n.start_soon(drain)
                    await trio.sleep(0.001)
                    with pytest.raises(AdmissionRejected) as e:
                        await rt.submit(req("b", [3, 4]))
                    assert (e.value.status, e.value.code) == (503, "not_ready")
        assert snap.phase == "prefilling" and snap.request_id == "a"
        assert snap.new_tokens == 320 and snap.prefill_percent == 50.0
        assert snap.prefill_eta_s is not None and snap.prefill_eta_s > 0
        # the in-flight request finished normally during the drain
        assert terminal(events).reason == "length" and len(tokens_of(events)) == 5
        assert drained[-1] is True
        assert rt.readiness()[0] is False and rt.snapshot().state == "stopped"


async def test_embeddings_and_load_failure():
    fake = FakeModelRunner(is_embedding_model=True)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1)) as rt:
        await rt.wait_ready()
        inputs = ((3, 4, 5), (9, 8))
        vec = await rt.embed(EmbeddingRequest("e", inputs))
        assert vec.shape == (2, fake.embedding_dim)
        np.testing.assert_allclose(np.linalg.norm(vec, axis=1), 1.0, rtol=1e-6)
        assert np.allclose(vec, fake.embed([list(x) for x in inputs]))

    def broken():
        raise OSError("no such model file")

    async with open_runtime(broken, RuntimeConfig()) as rt:
        assert await rt.wait_ready() is False
        ready, detail = rt.readiness()
        assert not ready and "no such model file" in detail
        with pytest.raises(AdmissionRejected) as e:
            await rt.submit(req("a", [3]))
        assert e.value.code == "engine_unhealthy"


async def test_not_ready_while_loading_and_invalid_tokens():
    gate = threading.Event()
    fake = FakeModelRunner()

    def slow_factory():
        gate.wait(10)
        return fake

    async with open_runtime(slow_factory, RuntimeConfig()) as rt:
        assert rt.readiness() == (False, "loading model")
        with pytest.raises(AdmissionRejected) as e:
            await rt.submit(req("a", [3]))
        assert (e.value.status, e.value.code) == (503, "not_ready")
        gate.set()
        assert await rt.wait_ready()
        with pytest.raises(AdmissionRejected) as e:
            await rt.submit(req("a", [3, fake.vocab_size]))
        assert (e.value.status, e.value.code) == (400, "invalid_request")


async def test_event_hook_sees_every_event():
    fake = FakeModelRunner()
    seen = []
    cfg = RuntimeConfig(slots=1, on_event=lambda rid, ev: seen.append((rid, type(ev).__name__)))
    async with open_runtime(fake.factory(), cfg) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(req("a", [3, 4, 5], max_tokens=3)))
        with pytest.raises(AdmissionRejected):
            await rt.submit(req("z", [3] * 5000))
    assert [n for r, n in seen if r == "a"] == [type(e).__name__ for e in ev]
    assert ("z", "AdmissionRejected") in seen


class OnlyEvenTokens:
    """A constraint in hf2q.text's shape: a boolean mask of allowed ids, advanced per token."""

    def __init__(self, vocab: int):
        self.mask = np.zeros(vocab, dtype=bool)
        self.mask[::2] = True
        self.advanced: list[int] = []
        self.threads: set[int] = set()

    def allowed_mask(self):
        self.threads.add(threading.get_ident())
        return self.mask

    def advance(self, token: int) -> None:
        self.advanced.append(token)


async def test_constraint_mask_is_applied_and_advanced_in_the_engine_thread():
    fake = FakeModelRunner()
    prompt = [11, 13, 15, 17]
    c = OnlyEvenTokens(fake.vocab_size)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1)) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(req("c", prompt, max_tokens=12, constraint=c, logprobs=True,
                                               top_logprobs=2)))
    # reference: the fake puts its top logit on t and the runner-up on t+1; masking odd ids picks
    # whichever of the two is even
    hist, expect = list(prompt), []
    for _ in range(12):
        t = expected_next_token(hist, fake.vocab_size, fake.eos_token_id)
        t = t if t % 2 == 0 else (t + 1) % fake.vocab_size
        if t == fake.eos_token_id:
            break
        expect.append(t)
        hist.append(t)
    assert tokens_of(ev) == expect
    assert c.advanced[:len(expect)] == expect
    assert c.threads == {fake.created_in_thread}
    toks = [e for e in ev if isinstance(e, Token)]
    assert all(e.logprob is not None and e.logprob <= 0 for e in toks)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0][0] == e.token_id for e in toks)


async def test_a_failing_sampler_fails_only_its_request(monkeypatch):
    import hf2q.actors.gpu_owner as gpu_owner_mod

    real = gpu_owner_mod.make_sampler

    def picky(params):
        if params.seed == 666:
            raise ValueError("seed 666 is not supported")
        return real(params)

    monkeypatch.setattr(gpu_owner_mod, "make_sampler", picky)
    fake = FakeModelRunner()
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1)) as rt:
        await rt.wait_ready()
        bad = await collect(await rt.submit(req("bad", [3, 4], seed=666)))
        end = terminal(bad)
        assert (end.status, end.code) == (400, "invalid_request") and "666" in end.message
        good = await collect(await rt.submit(req("good", [3, 4], max_tokens=3)))
        assert tokens_of(good) == greedy(fake, [3, 4], 3)
        assert rt.readiness() == (True, "ready")
        assert [h[1] for h in rt._system.slots[0].fsm.history].count("released") == 2


async def test_a_cancelled_caller_does_not_break_the_next_transaction():
    fake = FakeModelRunner(is_embedding_model=True, step_latency_s=0.05)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1)) as rt:
        await rt.wait_ready()
        with trio.move_on_after(0.01):  # the client gives up while its batch is on the engine
            await rt.embed(EmbeddingRequest("e1", ((3, 4),)))
        vec = await rt.embed(EmbeddingRequest("e2", ((5, 6),)))
        assert vec.shape == (1, fake.embedding_dim)
        assert rt.readiness() == (True, "ready")
        assert rt._system.gpu.state == "idle"


async def test_penalties_see_the_generated_tokens_and_bad_bias_fails_alone():
    fake = FakeModelRunner()
    prompt = [3, 4, 5]
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1)) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(req("p", prompt, max_tokens=40, presence_penalty=100.0)))
        bad = await collect(await rt.submit(req("b", prompt, logit_bias=((fake.vocab_size + 5, 1.0),))))
        assert rt.readiness() == (True, "ready")
    # reference: the fake's documented logits (6 on its token t, 2 on t+1, -4 elsewhere) minus the
    # presence penalty on every token generated so far, then argmax
    hist, generated = list(prompt), []
    for _ in range(40):
        t = expected_next_token(hist, fake.vocab_size, fake.eos_token_id)
        logits = np.full(fake.vocab_size, -4.0)
        logits[(t + 1) % fake.vocab_size] = 2.0
        logits[t] = 6.0
        logits[list(set(generated))] -= 100.0
        choice = int(np.argmax(logits))
        if choice == fake.eos_token_id:
            break
        generated.append(choice)
        hist.append(choice)
    assert tokens_of(ev) == generated
    assert len(set(generated)) == len(generated)  # the penalty made every token new
    end = terminal(bad)
    assert (end.status, end.code) == (400, "invalid_request") and "logit_bias" in end.message


async def test_cold_prompts_take_turns():
    fake = FakeModelRunner()
    prompts = [[(i * k) % 90 + 3 for i in range(96)] for k in (5, 7, 11)]
    async with open_runtime(fake.factory(), RuntimeConfig(slots=3, prefill_chunk=16)) as rt:
        await rt.wait_ready()
        chans = [await rt.submit(req(f"r{k}", p, max_tokens=2)) for k, p in enumerate(prompts)]
        async with trio.open_nursery() as n:
            for ch in chans:
                n.start_soon(collect, ch)
    order = [serial for serial, _ in fake.prefill_log]
    # 3 prompts × 6 transactions each, strictly rotating: no prompt runs two chunks in a row
    assert len(order) == 18 and sorted(set(order)) == sorted(set(order[:3]))
    assert all(a != b for a, b in zip(order, order[1:]))
    assert order[:3] * 6 == order


async def test_drain_timeout_ends_what_is_left(autojump_clock):
    fake = FakeModelRunner()
    try:
        async with open_runtime(fake.factory(), RuntimeConfig(slots=1, gpu_deadline_s=None)) as rt:
            await rt.wait_ready()
            fake.inject_hang("decode", nth=2)
            ch = await rt.submit(req("stuck", [3, 4, 5], max_tokens=50))
            t0 = trio.current_time()
            assert await rt.drain(5.0) is False  # virtual time: the clock jumps while the engine hangs
            assert trio.current_time() - t0 == pytest.approx(5.0)
            ev = await collect(ch)
            end = terminal(ev)
            assert (end.status, end.code) == (503, "not_ready") and "shutting down" in end.message
            assert rt.readiness()[0] is False
    finally:
        fake.hang_release.set()


async def test_dead_peer_fails_closed_before_the_deadline():
    """A rank of a tensor-parallel group dies while a step waits in a collective (NCCL never
    returns): the runtime polls the runner's ``dead_peer`` and poisons at once, not at the deadline."""
    fake = FakeModelRunner()
    died = threading.Event()
    fake.dead_peer = lambda: "tensor-parallel rank 1 exited with status -9" if died.is_set() else None
    try:
        async with open_runtime(fake.factory(), RuntimeConfig(slots=2, gpu_deadline_s=600.0)) as rt:
            await rt.wait_ready()
            fake.inject_hang("decode", nth=2)
            chans = await _in_flight(rt, 2)
            t0 = trio.current_time()
            async with trio.open_nursery() as n:
                results = collect_all(n, chans)
                with trio.fail_after(30):
                    while not fake.hanging.is_set():
                        await trio.sleep(0.01)
                died.set()
            assert trio.current_time() - t0 < 30  # the 600 s deadline played no part
            assert_each_failed_unhealthy(results, "rank 1 exited")
            ready, detail = rt.readiness()
            assert not ready and "rank 1 exited" in detail
            assert rt.snapshot().state == "poisoned"
    finally:
        fake.hang_release.set()


def _cycle4(history) -> int:
    """A model that repeats its last four tokens: what it says next always occurred earlier."""
    return history[-4] if len(history) >= 4 else 5


def _rule_greedy(rule, prompt, n: int) -> list[int]:
    hist = list(prompt)
    for _ in range(n):
        hist.append(rule(hist))
    return hist[len(prompt):]


async def test_a_lone_request_decodes_speculatively_and_exactly():
    fake = FakeModelRunner(next_token=_cycle4)
    prompt = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
    async with open_runtime(fake.factory(), RuntimeConfig(slots=2, draft_tokens=4, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(req("a", prompt, max_tokens=21)))
        counters = rt.snapshot().counters
    assert tokens_of(ev) == _rule_greedy(_cycle4, prompt, 21)
    assert terminal(ev).reason == "length" and terminal(ev).completion_tokens == 21
    verifies = [n for k, n in fake.calls if k == "verify"]
    assert verifies and all(2 <= n <= 5 for n in verifies)
    # every draft of a perfectly repetitive model stands: ~5 tokens per forward instead of one
    assert counters["accepted_draft_tokens"] == counters["drafted_tokens"] > 0
    assert len(verifies) + fake.decode_batch_sizes.count(1) <= 21 // 4 + 2


async def test_speculation_steps_aside_for_batched_decoding_and_stops_where_it_should():
    fake = FakeModelRunner(next_token=lambda h: 2 if len(h) >= 30 else _cycle4(h))  # EOS (2) at length 30
    a = [21, 22, 23, 24] * 3
    b = [31, 32, 33, 34] * 2
    async with open_runtime(fake.factory(), RuntimeConfig(slots=2, draft_tokens=6, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        async with trio.open_nursery() as n:
            res = {}

            async def run(name, p, k):
                res[name] = await collect(await rt.submit(req(name, p, max_tokens=k)))
            n.start_soon(run, "a", a, 40)
            n.start_soon(run, "b", b, 9)
    # a: ends at the model's EOS; nothing after it is sent
    assert tokens_of(res["a"]) == _rule_greedy(_cycle4, a, 30 - len(a))
    assert terminal(res["a"]).reason == "stop"
    assert tokens_of(res["b"]) == _rule_greedy(_cycle4, b, 9) and terminal(res["b"]).reason == "length"
    assert 2 in fake.decode_batch_sizes  # while both decoded, they shared batched steps


async def test_an_eos_inside_a_draft_ends_the_request_there():
    fake = FakeModelRunner(next_token=lambda h: 2 if len(h) >= 30 else _cycle4(h))  # EOS (2) at length 30
    a = [21, 22, 23, 24] * 3
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1, draft_tokens=6, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(req("a", a, max_tokens=40)))
        counters = rt.snapshot().counters
    assert tokens_of(ev) == _rule_greedy(_cycle4, a, 30 - len(a)) and terminal(ev).reason == "stop"
    assert counters["drafted_tokens"] > counters["accepted_draft_tokens"]  # the EOS rejected a draft
