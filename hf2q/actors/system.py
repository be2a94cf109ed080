"""Wiring of the actor system behind ``Runtime``: which actors exist and which channels join them.

``run`` starts the GPU owner (which loads the model in its thread), then — in one nursery
whose cancel scope is the "work" scope — the step loop, one actor per slot, admission and
the KV prefix actor; the KV writer runs outside it, so poisoning never cuts a write short.
Poisoning fails every live request exactly once, queued or running, and cancels the work
scope, so nothing submits GPU work again, while ``submit``/``readiness`` keep answering
503 / ``(False, detail)`` from plain state. Who sends what to whom: ``messages.py``.
"""

from __future__ import annotations

import logging

import trio

from hf2q.actors.admission import Admission
from hf2q.actors.gpu_owner import PEER_POLL_S, GpuOwner
from hf2q.actors.kv_prefix import KvPrefixActor
from hf2q.actors.slot import SlotActor, SlotEnv
from hf2q.actors.snapshot import runtime_snapshot
from hf2q.actors.supervisor import EnginePoisoned, Supervisor
from hf2q.sched.contracts import AdmissionRejected, EmbeddingRequest, Failed, GenerationRequest, ModelFacts
from hf2q.sched.intake import check_embedding

log = logging.getLogger("hf2q.runtime")

SHUTDOWN = Failed(503, "not_ready", "server shutting down")

#: the longest shutdown waits for the engine thread's running job (a healthy job is one step or chunk)
ENGINE_STOP_WAIT_S = 30.0

#: blocks the KV writer's queue holds (exported host copies); a finished request's further
#: blocks wait in the KV prefix actor's record until the queue has emptied
KV_WRITER_QUEUE = 8


class ActorSystem:
    def __init__(self, runner_factory, config, *, kv_store=None, kv_store_opener=None, engine_thread=None):
        config.check()
        self.config = config
        self.supervisor = Supervisor(config.gpu_deadline_s)
        self.supervisor.on_poisoned = self._poisoned
        self.gpu = GpuOwner(runner_factory, self.supervisor, config.slots, config.draft_tokens,
                            make_thread=engine_thread)
        self.kv_prefix = KvPrefixActor(self.gpu.transact, kv_store)
        inboxes = [trio.open_memory_channel(float("inf")) for _ in range(config.slots)]
        self.admission = Admission(config, [send for send, _ in inboxes], self.supervisor.refusal)
        env = SlotEnv(self.gpu.transact, self.gpu.inbox_send, self.kv_prefix, self.admission.inbox_send)
        self.slots = [SlotActor(i, env, inbox) for i, (_, inbox) in enumerate(inboxes)]
        self.hooks = self.admission.hooks
        self._kv_store_opener = kv_store_opener  # (runner's kv_identity) -> store, called once loaded
        self._work_scope: trio.CancelScope | None = None

    @property
    def kv_store(self):
        return self.kv_prefix.store

    @property
    def runner_info(self) -> dict:
        facts = self.admission.facts
        return facts.as_dict() if facts is not None else {}

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        opened_store = None
        try:
            async with trio.open_nursery() as outer:
                if self.kv_store is not None:
                    await outer.start(self._run_kv_writer)
                async with trio.open_nursery() as nursery:
                    self._work_scope = nursery.cancel_scope
                    task_status.started()
                    try:
                        runner = await self.gpu.load()
                        facts = ModelFacts.of(runner, self.config)
                        self.admission.configure(facts)
                        if not getattr(runner, "persists_kv", facts.trims_prefix) \
                                and (self.kv_store is not None or self._kv_store_opener):
                            # its blocks cannot rebuild this cache (docs/KVSTORE.md)
                            log.warning("persistent KV store disabled: saved blocks cannot restore this model's "
                                        "cache here")
                            self.kv_prefix.store, self._kv_store_opener = None, None
                        if self._kv_store_opener is not None:
                            opened_store = await self._open_kv_store()
                            if opened_store is None:
                                return
                            await outer.start(self._run_kv_writer)
                    except EnginePoisoned:
                        return
                    self.supervisor.loaded()
                    if self.gpu.dead_peer is not None:  # a tensor-parallel group: a rank may die while idle
                        nursery.start_soon(self._guarded, "peer watch", self._watch_peers)
                    nursery.start_soon(self._guarded, "gpu owner", self.gpu.run_steps)
                    for slot in self.slots:
                        nursery.start_soon(self._guarded, f"slot {slot.index}", slot.run)
                    nursery.start_soon(self._guarded, "admission", self.admission.run)
                    if self.kv_store is not None:
                        nursery.start_soon(self._guarded, "kv prefix", self.kv_prefix.run)
                outer.cancel_scope.cancel()
        finally:
            if self.kv_prefix.writer is not None:
                self._report_kv_persist()
            if opened_store is not None:
                opened_store.close()

    def _report_kv_persist(self) -> None:
        """One line at shutdown: what the persistent store was promised and what became of it."""
        left = self.kv_prefix.abandon() + self.kv_prefix.writer.statistics().abandoned
        if self.kv_store is None:
            return
        st = self.kv_store.stats()
        logging.getLogger("hf2q.kvstore").info("kv persist: stopped", extra={
            "blocks_written": st.written, "blocks_pending_at_stop": left, "blocks_not_written": st.not_written,
            "write_errors": st.errors})

    async def _open_kv_store(self):
        """Open the persistent KV store keyed by the loaded engine's ``kv_identity`` (KV values
        depend on backend, device and dtype, not only on the model file). A store that cannot
        be opened stops serving like a model that failed to load; returns None then."""
        identity = await self.gpu.transact(lambda runner: str(getattr(runner, "kv_identity", "")), "kv identity")
        try:  # file I/O only (recovery scans the directory): a worker thread is fine
            self.kv_prefix.store = await trio.to_thread.run_sync(self._kv_store_opener, identity)
        except Exception as e:  # noqa: BLE001 — reported through /readyz and the serve command
            self.supervisor.poison(f"persistent KV store failed to open: {e}")
            return None
        return self.kv_prefix.store

    async def _run_kv_writer(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from hf2q.actors.kv_writer import open_kv_writer

        async with open_kv_writer(self.kv_store, capacity=KV_WRITER_QUEUE) as writer:
            self.kv_prefix.writer = writer
            task_status.started()
            await trio.sleep_forever()

    async def _guarded(self, name: str, actor) -> None:
        """Run one actor; a bug that escapes it fails every request once and stops serving
        (the same one-way path as an engine fault) instead of tearing the process down."""
        try:
            await actor()
        except EnginePoisoned:
            pass
        except Exception as e:  # noqa: BLE001 — the actor boundary
            log.exception("actor %s crashed", name)
            self.supervisor.poison(f"internal error in the {name} actor: {type(e).__name__}: {e}")

    async def _watch_peers(self) -> None:
        """Poison once a rank of the group is gone even with nothing running, so ``/readyz`` turns 503
        before a request finds out (a step waiting on the rank is the GPU owner's own poll)."""
        while not self.supervisor.poisoned:
            await trio.sleep(PEER_POLL_S)
            dead = self.gpu.dead_peer()
            if dead is not None:
                self.supervisor.poison(f"tensor-parallel group lost a rank: {dead}")

    def _poisoned(self, detail: str) -> None:
        self.admission.fail_all("engine_poisoned", Failed(503, "engine_unhealthy", detail))
        for slot in self.slots:
            slot.engine_failed()
        if self._work_scope is not None:
            self._work_scope.cancel()

    async def shutdown(self) -> None:
        """Context exit: end what is still running, stop the thread and wait for the job it runs
        (bounded; never for a hung one, nor for a load) — the interpreter must not finalize under a
        running engine call (``engine_thread.py``)."""
        self.admission.fail_all("shut_down", SHUTDOWN)
        self.gpu.stop()
        if self._work_scope is not None:
            self._work_scope.cancel()
        limit = min(ENGINE_STOP_WAIT_S, self.supervisor.deadline_s or ENGINE_STOP_WAIT_S)
        if not await self.gpu.wait_stopped(limit):
            log.warning("the engine thread is still busy at shutdown (loading, or a stuck GPU job)")

    # ---- the Runtime API ------------------------------------------------------------------

    async def submit(self, req: GenerationRequest) -> trio.MemoryReceiveChannel:
        await trio.lowlevel.checkpoint()
        return self.admission.submit(req)

    async def embed(self, req: EmbeddingRequest):
        await trio.lowlevel.checkpoint()
        try:
            refused = self.supervisor.refusal()
            if refused is not None:
                raise refused
            check_embedding(req, self.admission.facts)
        except AdmissionRejected as e:
            raise self.admission.reject(req.request_id, e) from None
        inputs = [list(x) for x in req.inputs]
        try:
            return await self.gpu.transact(lambda runner: runner.embed(inputs), "embed")
        except EnginePoisoned:
            raise self.admission.reject(req.request_id, self.supervisor.refusal()) from None

    def readiness(self) -> tuple[bool, str]:
        return self.supervisor.readiness()

    async def wait_ready(self) -> bool:
        await self.supervisor.settled.wait()
        return self.supervisor.ready

    async def drain(self, timeout: float) -> bool:
        self.supervisor.drain_requested()
        self.admission.drain_requested()
        deadline = trio.current_time() + timeout
        with trio.move_on_at(deadline):
            while not self.admission.quiet and not self.supervisor.poisoned:
                await self.admission.activity.wait()
        if self.supervisor.poisoned:
            return False
        quiet = self.admission.quiet
        if not quiet:
            self.admission.fail_all("shut_down", SHUTDOWN)
        elif self.admission.state == "draining":
            self.admission.close("queue_emptied")
        if quiet and self.kv_prefix.writer is not None:  # finished requests' blocks reach the disk
            with trio.move_on_at(deadline):
                await self.kv_prefix.wait_flushed()
        self.supervisor.drained()
        return quiet

    def snapshot(self):
        return runtime_snapshot(self.supervisor, self.admission, self.slots, self.gpu, self.kv_prefix)
