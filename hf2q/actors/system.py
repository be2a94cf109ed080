"""Wiring of the actor system behind ``Runtime``: who is started, who is told what.

``ActorSystem.run`` starts the GPU owner (which loads the model in its thread), then the
step loop, one actor per slot and the admission actor, all in one nursery whose cancel
scope is the "work" scope. Poisoning (SPEC §6) fails every live request exactly once —
queued or running — and cancels that scope, so nothing submits GPU work again, while
``submit``/``readiness`` keep answering 503 / ``(False, detail)`` from plain state.
"""

from __future__ import annotations

import collections
import logging

import trio

from hf2q.actors.admission import Admission, QueueFull
from hf2q.actors.gpu_owner import EnginePoisoned, GpuOwner
from hf2q.actors.handle import RequestHandle
from hf2q.actors.slot import SlotActor
from hf2q.sched.budget import KvBudget
from hf2q.sched.ledger import SlotLedger
from hf2q.sched.contracts import (AdmissionRejected, EmbeddingRequest, Failed, Finished, GenerationRequest,
                                  RuntimeSnapshot, SlotSnapshot)

log = logging.getLogger("hf2q.runtime")

SHUTDOWN = Failed(503, "not_ready", "server shutting down")


def default_sampler(params):
    """The engine's ``hf2q.engine.sampler.Sampler`` (pure numpy); ``GreedySampler`` only while
    that module is not installed."""
    try:
        from hf2q.engine.sampler import Sampler
    except ImportError:
        return GreedySampler(params)
    return Sampler(params)


class GreedySampler:
    """Fallback: argmax over the (masked) logits with its log-probability. Temperature is ignored."""

    def __init__(self, params):
        self.top = params.top_logprobs if params.logprobs else 0

    def sample(self, logits, history, mask=None):
        import numpy as np

        x = np.asarray(logits, dtype=np.float64)
        if mask is not None:
            x = np.where(mask, x, -np.inf)
        logp = x - (np.max(x) + np.log(np.sum(np.exp(x - np.max(x)))))
        token = int(np.argmax(x))
        top = [(int(i), float(logp[i])) for i in np.argsort(-logp)[: self.top]] if self.top else []
        return token, float(logp[token]), top


class ActorSystem:
    def __init__(self, runner_factory, config, *, kv_store=None, kv_store_opener=None, sampler_factory=None):
        if config.slots < 1:
            raise ValueError("RuntimeConfig.slots must be at least 1")
        if config.prefill_chunk < 1 or config.token_buffer < 1 or config.queue_capacity < 0:
            raise ValueError("prefill_chunk and token_buffer must be positive, queue_capacity non-negative")
        from hf2q.actors.supervisor import Supervisor

        self.config = config
        self.hooks = [self._count] + ([config.on_event] if config.on_event else [])
        self.stats: collections.Counter[str] = collections.Counter()
        self.supervisor = Supervisor(config.gpu_deadline_s)
        self.supervisor.on_poisoned = self._poisoned
        self.gpu = GpuOwner(runner_factory, self.supervisor, config.slots, self.stats)
        self.ledger = SlotLedger(config.slots)
        self.reservations: dict[int, int] = {}
        self.slots = [SlotActor(i, self) for i in range(config.slots)]
        self.admission = Admission(self, config.queue_capacity)
        self.kv_store = kv_store
        self._kv_store_opener = kv_store_opener  # (runner's kv_identity) -> store, called once loaded
        self.make_sampler = sampler_factory or default_sampler
        self.prefill_chunk = config.prefill_chunk
        self.runner_info: dict = {}
        self.budget: KvBudget | None = None
        self.ctx = 0
        self.eos_token_ids: frozenset[int] = frozenset()
        self._live: list[RequestHandle] = []
        self._activity = trio.Event()
        self._work_scope: trio.CancelScope | None = None
        self.kv_writer = None

    def _count(self, request_id: str, event) -> None:
        if isinstance(event, Finished):
            self.stats["cancelled" if event.reason == "cancelled" else "finished"] += 1
            self.stats["completion_tokens"] += event.completion_tokens
            self.stats["cached_tokens"] += event.cached_tokens
        elif isinstance(event, Failed):
            self.stats["failed"] += 1
            self.stats[f"failed_{event.code}"] += 1

    # ---- lifecycle -----------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        opened_store = None
        try:
            async with trio.open_nursery() as outer:
                if self.kv_store is not None:  # outside the work scope: poisoning does not cut a write short
                    await outer.start(self._run_kv_writer)
                async with trio.open_nursery() as nursery:
                    self._work_scope = nursery.cancel_scope
                    task_status.started()
                    try:
                        runner = await self.gpu.load()
                        self._configure(runner)
                        if self._kv_store_opener is not None:
                            opened_store = await self._open_kv_store()
                            if opened_store is None:
                                return
                            await outer.start(self._run_kv_writer)
                    except EnginePoisoned:
                        return
                    self.supervisor.loaded()
                    nursery.start_soon(self._guarded, "gpu owner", self.gpu.run_steps)
                    for slot in self.slots:
                        nursery.start_soon(self._guarded, f"slot {slot.index}", slot.run)
                    nursery.start_soon(self._guarded, "admission", self.admission.run)
                outer.cancel_scope.cancel()
        finally:
            if opened_store is not None:
                opened_store.close()

    async def _open_kv_store(self):
        """Open the persistent KV store keyed by the loaded engine's ``kv_identity`` (KV values
        depend on backend, device and dtype, not only on the model file). A store that cannot
        be opened stops serving like a model that failed to load; returns None then."""
        identity = await self.gpu.transact(lambda runner: str(getattr(runner, "kv_identity", "")), "kv identity")
        try:  # file I/O only (recovery scans the directory): a worker thread is fine
            self.kv_store = await trio.to_thread.run_sync(self._kv_store_opener, identity)
        except Exception as e:  # noqa: BLE001 — reported through /readyz and the serve command
            self.supervisor.poison(f"persistent KV store failed to open: {e}")
            return None
        return self.kv_store

    async def _run_kv_writer(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from hf2q.actors.kv_writer import open_kv_writer

        async with open_kv_writer(self.kv_store, capacity=8) as writer:
            self.kv_writer = writer
            task_status.started()
            await trio.sleep_forever()

    def _configure(self, runner) -> None:
        cfg = self.config
        self.ctx = int(cfg.ctx or runner.n_ctx_train)
        hard = getattr(runner, "n_ctx", None)  # a runner built for a fixed context refuses more
        if hard:
            self.ctx = min(self.ctx, int(hard))
        bpt = int(runner.kv_bytes_per_token)
        budget = cfg.kv_budget_bytes if cfg.kv_budget_bytes is not None else cfg.slots * self.ctx * bpt
        self.budget = KvBudget(bpt, int(budget), self.ctx)
        self.eos_token_ids = frozenset(int(t) for t in runner.eos_token_ids)
        self.runner_info = dict(vocab_size=int(runner.vocab_size), n_ctx_train=int(runner.n_ctx_train),
                                kv_bytes_per_token=bpt, eos_token_ids=self.eos_token_ids,
                                is_embedding_model=bool(runner.is_embedding_model), ctx=self.ctx)

    async def _guarded(self, name: str, actor) -> None:
        """Run one actor; a bug that escapes it fails every request once and stops serving
        (the same one-way path as an engine fault) instead of tearing the process down."""
        try:
            await actor()
        except EnginePoisoned:
            pass
        except Exception as e:  # noqa: BLE001 — the actor boundary (STYLE.md #5)
            log.exception("actor %s crashed", name)
            self.supervisor.poison(f"internal error in the {name} actor: {type(e).__name__}: {e}")

    def _poisoned(self, detail: str) -> None:
        failure = Failed(503, "engine_unhealthy", detail)
        self.admission.close("engine_poisoned", failure)
        for h in self._live:
            h.finish(failure)
        for slot in self.slots:
            slot.engine_failed()
        self._live.clear()
        if self._work_scope is not None:
            self._work_scope.cancel()
        self._activity.set()

    async def shutdown(self) -> None:
        """Context exit: end what is still running, stop the thread (never waits for a hung one)."""
        self.admission.close("shut_down", SHUTDOWN)
        for h in self._live:
            h.finish(SHUTDOWN)
        self._live.clear()
        self.gpu.stop()
        if self._work_scope is not None:
            self._work_scope.cancel()

    # ---- called by actors --------------------------------------------------------------

    def slot_released(self, slot: int) -> None:
        self.ledger.release(slot)
        self.reservations.pop(slot, None)
        self.admission.wake()
        self._activity.set()

    def plan_restore(self, slot: int, prompt, cached: int):
        """The KV store's ``RestorePlan`` for ``prompt`` when disk blocks reach further than the
        ``cached`` tokens the slot holds, else None. Index lookups only (no disk reads)."""
        if self.kv_store is None:
            return None
        from hf2q.kvstore.hydrate import plan_restore

        return plan_restore(self.kv_store, prompt, cached)

    async def restore_prefix(self, slot_actor, plan, cached: int, prompt) -> int:
        """Read the planned blocks and import them into the slot's sequence when they reach
        further than ``cached``; returns the prompt tokens now cached. A block that vanished or
        fails verification ends the restore at the blocks before it."""
        blocks = []
        for imp in plan.imports:
            try:  # file I/O only (no MLX): a worker thread is fine here
                blocks.append((await trio.to_thread.run_sync(self.kv_store.read, imp.meta), imp.n_tokens))
            except Exception as e:  # noqa: BLE001 — BlockUnavailable or an I/O error: stop here
                log.warning("kv restore stopped early: %s", e)
                break
        covered = plan.keep_tokens + sum(n for _, n in blocks)
        if covered <= cached:
            return cached
        seq = slot_actor.seq
        keep = plan.keep_tokens

        def import_blocks(runner):
            seq.trim(keep)
            for arrays, n in blocks:
                runner.import_kv(seq, arrays, n)

        await self.gpu.transact(import_blocks, "kv import")
        self.ledger.replace(slot_actor.index, list(prompt[:covered]))
        self.stats["kv_blocks_restored"] += len(blocks)
        self.stats["kv_tokens_restored"] += covered - keep
        return covered

    async def persist_prompt(self, slot_actor, prompt) -> None:
        """``prompt``'s KV is in the slot: export every full block not yet on disk and hand it to
        the writer (a full writer skips it — persistence never stalls serving)."""
        if self.kv_store is None or self.kv_writer is None:
            return
        spans = self.kv_store.missing_spans(prompt)
        if not spans:
            return
        seq = slot_actor.seq
        exported = await self.gpu.transact(
            lambda runner: [runner.export_kv(seq, sp.start, sp.end) for sp in spans], "kv export")
        from hf2q.kvstore import KVBlock

        for span, arrays in zip(spans, exported):
            if self.kv_writer.submit_nowait(KVBlock.from_span(span, prompt, arrays)):
                self.stats["kv_blocks_saved"] += 1
            else:
                self.stats["kv_blocks_skipped"] += 1

    # ---- the Runtime API ------------------------------------------------------------------

    def _refuse_if_not_serving(self) -> None:
        sup = self.supervisor
        if sup.poisoned:
            raise AdmissionRejected(503, "engine_unhealthy", sup.detail, 1)
        if not sup.ready or not self.admission.accepting:
            raise AdmissionRejected(503, "not_ready", sup.detail, 1)

    def _reject(self, request_id: str, err: AdmissionRejected) -> AdmissionRejected:
        self.stats[f"rejected_{err.code}"] += 1
        for hook in self.hooks:
            try:
                hook(request_id, err)
            except Exception:  # noqa: BLE001
                pass
        return err

    async def submit(self, req: GenerationRequest) -> trio.MemoryReceiveChannel:
        await trio.lowlevel.checkpoint()
        self.stats["requests"] += 1
        try:
            self._refuse_if_not_serving()
            self._validate(req)
            h = RequestHandle(req, self.config.token_buffer, self.hooks, trio.current_time())
            try:
                self.admission.offer(h)
            except QueueFull as e:
                raise AdmissionRejected(429, e.code, str(e), 1) from None
        except AdmissionRejected as e:
            raise self._reject(req.request_id, e) from None
        self._live = [x for x in self._live if not x.done]
        self._live.append(h)
        self.stats["prompt_tokens"] += len(req.prompt_tokens)
        return h.receive

    def _validate(self, req: GenerationRequest) -> None:
        prompt = req.prompt_tokens
        vocab = self.runner_info["vocab_size"]
        if req.params.max_tokens < 1:
            raise AdmissionRejected(400, "invalid_request", "max_tokens must be at least 1")
        never = self.budget.never_fits(len(prompt), req.params.max_tokens)
        if never is not None:
            raise AdmissionRejected(400, never.code, never.message)
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:  # caught here: an out-of-range id would fault (and poison) the engine
            raise AdmissionRejected(400, "invalid_request", f"token id {bad} is outside the vocabulary ({vocab})")

    async def embed(self, req: EmbeddingRequest):
        await trio.lowlevel.checkpoint()
        try:
            self._refuse_if_not_serving()
            if not self.runner_info["is_embedding_model"]:
                raise AdmissionRejected(400, "invalid_request", "this model does not produce embeddings")
            if not req.inputs or any(len(x) == 0 for x in req.inputs):
                raise AdmissionRejected(400, "invalid_request", "embedding inputs must be non-empty")
            longest, limit = max(len(x) for x in req.inputs), self.runner_info["n_ctx_train"]
            if longest > limit:
                raise AdmissionRejected(400, "context_length_exceeded",
                                        f"input has {longest} tokens; the model accepts {limit}")
        except AdmissionRejected as e:
            raise self._reject(req.request_id, e) from None
        inputs = [list(x) for x in req.inputs]
        try:
            return await self.gpu.transact(lambda runner: runner.embed(inputs), "embed")
        except EnginePoisoned:
            raise self._reject(req.request_id, AdmissionRejected(503, "engine_unhealthy",
                                                                 self.supervisor.detail, 1)) from None

    def readiness(self) -> tuple[bool, str]:
        return self.supervisor.readiness()

    async def wait_ready(self) -> bool:
        await self.supervisor.settled.wait()
        return self.supervisor.ready

    def _quiet(self) -> bool:
        return not self.admission.queue and not self.ledger.busy_slots()

    async def drain(self, timeout: float) -> bool:
        self.supervisor.drain_requested()
        self.admission.drain_requested()
        deadline = trio.current_time() + timeout
        with trio.move_on_at(deadline):
            while not self._quiet() and not self.supervisor.poisoned:
                self._activity = trio.Event()
                await self._activity.wait()
        if self.supervisor.poisoned:
            return False
        quiet = self._quiet()
        if not quiet:
            self.admission.close("shut_down", SHUTDOWN)
            for h in self._live:
                h.finish(SHUTDOWN)
        elif self.admission.state == "draining":
            self.admission.close("queue_emptied")
        if quiet and self.kv_writer is not None:  # let queued blocks reach the disk
            with trio.move_on_after(max(deadline - trio.current_time(), 0)):
                await self.kv_writer.wait_idle()
        self.supervisor.drained()
        return quiet

    def snapshot(self) -> RuntimeSnapshot:
        slots = []
        for a in self.slots:
            p = a.progress
            active = a.state != "idle"
            rate = p.prefill_rate()
            remaining = max(p.new_tokens - p.prefilled_tokens, 0)
            slots.append(SlotSnapshot(
                slot=a.index, phase=a.state, request_id=p.request_id if active else None,
                cached_tokens=p.cached_tokens if active else 0, new_tokens=p.new_tokens if active else 0,
                prefilled_tokens=p.prefilled_tokens if active else 0,
                prefill_percent=(100.0 * p.prefilled_tokens / p.new_tokens) if active and p.new_tokens else 0.0,
                prefill_eta_s=(remaining / rate) if active and rate > 0 and remaining else None,
                generated_tokens=p.generated_tokens if active else 0,
                decode_tokens_per_sec=p.decode_rate() if active else 0.0,
                resident_tokens=self.ledger.resident_tokens(a.index)))
        bpt = self.budget.bytes_per_token if self.budget else 0
        resident = sum(s.resident_tokens for s in slots) * bpt
        ready, detail = self.readiness()
        return RuntimeSnapshot(ready=ready, state=self.supervisor.state, detail=detail, slots=tuple(slots),
                               queue_depth=len(self.admission.queue), kv_bytes_resident=resident,
                               kv_budget_bytes=self.budget.budget_bytes if self.budget else 0,
                               ctx=self.ctx, counters={**self.stats, "gpu_busy_s": self.gpu.busy_s})
