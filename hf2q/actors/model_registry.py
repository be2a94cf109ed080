"""The model registry of a several-model server: which GGUFs are resident under one memory budget.

Every model is an ``Entry`` whose ``model_residency`` machine says where it is; each resident
model is a full runtime of its own (slots, KV budget, admission), opened by a trio task of
the registry's nursery that holds it until it is told to drain. All state is changed on
the event loop with no checkpoint between a decision and its effect, so two requests never
both take the same free memory or both evict the same model.

Rules (docs/API.md, "Several models"):
- a model counts its ``need_bytes`` (the memory plan's weights + KV budget, what ``hf2q info``
  reports) from the moment it starts loading until it has drained and its memory was
  released in the engine thread;
- a request ``acquire``s its model: that pins it (``active``) until ``release``; a model with a
  pin is never evicted — to make room the least recently used *idle* resident model drains;
- when nothing can be evicted the request waits for a change, at most ``wait_s``, then gets
  429 ``models_memory_full``;
- every model's engine runs in one ``SharedEngineThread`` (actors/shared_engine.py);
- a resident model whose engine faulted is drained and loaded afresh by its next request
  (not after a hang: the one thread is still stuck in it);
- a model that failed to load is not tried again for ``load_backoff_s``: a request for it in
  that time gets 503 ``model_load_failed`` at once (a broken file must not cost a load per
  request, nor evict the models that work); the next request after it loads again, and so
  does ``POST /v1/models/{id}/load`` at any time (the operator fixed the file).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable

import attrs
import trio

from hf2q.actors.shared_engine import SharedEngineThread
from hf2q.sched.contracts import AdmissionRejected, RuntimeConfig
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.model_residency import MODEL_RESIDENCY

log = logging.getLogger("hf2q.serve")

#: seconds an evicted or unloaded model's running requests may take to finish
DRAIN_TIMEOUT_S = 30.0
#: seconds the engine thread may take to free a drained model's memory (a hung thread never does)
RELEASE_TIMEOUT_S = 10.0
#: seconds after a failed load before a request may try that model again
LOAD_BACKOFF_S = 30.0


@attrs.define(eq=False)
class Entry:
    """One servable model: fixed facts, its residency machine, and its runtime while resident."""

    model_id: str
    path: Path
    kind: str  # "chat" or "embedding"
    need_bytes: int
    text: Any  # the text side: GGUFChatModel / GGUFEmbeddingModel
    config: RuntimeConfig
    runner_factory: Callable[[], Callable[[], Any]]  # () -> the runtime's runner factory
    fsm: Lifecycle = attrs.Factory(lambda: Lifecycle(MODEL_RESIDENCY))
    runtime: Any = None
    active: int = 0
    last_used: float = -math.inf
    failed_at: float = -math.inf  # trio time of its last failed load
    loads: int = 0
    evictions: int = 0
    detail: str = "not loaded"
    on_loaded: Callable[[Any], None] | None = None  # called with the runtime once it is ready
    _drain: trio.Event = attrs.Factory(trio.Event)
    _settled: trio.Event = attrs.Factory(trio.Event)  # left ``loading``
    _gone: trio.Event = attrs.Factory(trio.Event)  # back to ``unloaded`` (memory released)

    @property
    def state(self) -> str:
        return self.fsm.state

    @property
    def holds_memory(self) -> bool:
        return self.state in ("loading", "ready", "draining")


class ModelRegistry:
    def __init__(self, entries: list[Entry], budget_bytes: int, wait_s: float, *,
                 open_runtime: Callable[..., Any] | None = None, load_backoff_s: float = LOAD_BACKOFF_S):
        if not entries:
            raise ValueError("a model registry needs at least one model")
        self.entries = {e.model_id: e for e in entries}
        self.budget_bytes = budget_bytes
        self.wait_s = wait_s
        self.load_backoff_s = load_backoff_s
        self.engine = SharedEngineThread()
        if open_runtime is None:
            from hf2q.actors.runtime import open_runtime
        self._open_runtime = open_runtime
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self.stopping = False

    # ---- facts the API reads (no checkpoint, no engine) ------------------------------------

    def find(self, model_id: str | None, kind: str) -> Entry | None:
        """The entry named ``model_id`` (None/"default": the first model of ``kind``); None if unknown."""
        if model_id in (None, "", "default"):
            return next((e for e in self.entries.values() if e.kind == kind), None)
        return self.entries.get(model_id)

    @property
    def resident_bytes(self) -> int:
        return sum(e.need_bytes for e in self.entries.values() if e.holds_memory)

    # ---- the actor ---------------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the model tasks; leaving (cancellation) ends every resident model."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self.engine.close()

    async def acquire(self, entry: Entry, *, retry_failed: bool = False) -> Entry:
        """Pin ``entry`` and return it once its runtime is ready; pair with ``release``.

        Raises ``AdmissionRejected``: 429 ``models_memory_full`` when no room could be made
        within ``wait_s``, 503 ``model_load_failed`` when its engine did not load (now, or
        less than ``load_backoff_s`` ago unless ``retry_failed``)."""
        entry.active += 1
        try:
            await self._make_ready(entry, trio.current_time() + self.wait_s, retry_failed)
        except BaseException:
            self.release(entry)
            raise
        entry.last_used = trio.current_time()
        return entry

    def release(self, entry: Entry) -> None:
        entry.active -= 1
        entry.last_used = trio.current_time()
        if entry.active == 0:
            self._touch()  # a waiting request may now evict it

    async def load(self, entry: Entry) -> None:
        """``POST /v1/models/{id}/load``: make it resident (a request's rules, but a model that
        failed to load is tried again at once)."""
        await self.acquire(entry, retry_failed=True)
        self.release(entry)

    async def unload(self, entry: Entry) -> None:
        """``POST /v1/models/{id}/unload``: drain and release it; 409 ``model_busy`` while a
        request uses it (or waits for it)."""
        if entry.active:
            raise AdmissionRejected(409, "model_busy", f"model {entry.model_id!r} has {entry.active} active "
                                                        f"request(s); unload it once they have finished")
        if entry.state == "loading":
            await entry._settled.wait()
        if entry.state == "ready" and not entry.active:
            self._evict(entry, counted=False)
        if entry.state == "draining":
            await entry._gone.wait()

    async def drain(self, timeout: float) -> bool:
        """The server's graceful stop: no more loads; every resident model finishes its requests."""
        self.stopping = True
        self._touch()
        clean = True
        async with trio.open_nursery() as nursery:
            for entry in self.entries.values():
                if entry.runtime is not None:
                    async def one(rt=entry.runtime):
                        nonlocal clean
                        clean = await rt.drain(timeout) and clean
                    nursery.start_soon(one)
        return clean

    # ---- the rules ---------------------------------------------------------------------------

    async def _make_ready(self, entry: Entry, deadline: float, retry_failed: bool) -> None:
        while True:
            if self.stopping:
                raise AdmissionRejected(503, "not_ready", "server shutting down", 1)
            state = entry.state
            if state == "ready":
                if not self._faulted(entry):
                    return
                # its engine faulted: drain it and load it afresh (its requests already failed)
                self._evict(entry, counted=False)
                continue
            if state == "loading":
                await entry._settled.wait()
                if entry.state == "failed":
                    raise self._load_failed(entry)
                continue
            if state == "failed" and not retry_failed and self._backing_off(entry):
                raise self._load_failed(entry)
            if state == "draining":
                await entry._gone.wait()
                continue
            # unloaded or failed: load it if there is room, else make room, else wait for a change
            if self.resident_bytes + entry.need_bytes <= self.budget_bytes:
                self._start_load(entry)
                continue
            victim = self._least_recently_used_idle(entry)
            if victim is not None:
                self._evict(victim, counted=True)
                await victim._gone.wait()
                continue
            changed = self._changed
            with trio.move_on_at(deadline):
                await changed.wait()
                continue
            busy = ", ".join(f"{e.model_id} ({e.active} active)" for e in self.entries.values()
                             if e.holds_memory)
            raise AdmissionRejected(429, "models_memory_full",
                                    f"model {entry.model_id!r} needs {entry.need_bytes} bytes and the "
                                    f"{self.budget_bytes}-byte model memory holds busy models: {busy}", 1)

    def _backing_off(self, entry: Entry) -> bool:
        return trio.current_time() < entry.failed_at + self.load_backoff_s

    def _load_failed(self, entry: Entry) -> AdmissionRejected:
        """503 ``model_load_failed``; ``Retry-After`` says when the next load may be tried."""
        wait = max(1, math.ceil(entry.failed_at + self.load_backoff_s - trio.current_time()))
        return AdmissionRejected(503, "model_load_failed", f"model {entry.model_id!r} failed to load: "
                                                           f"{entry.detail} (tried again in {wait} s)", wait)

    def _faulted(self, entry: Entry) -> bool:
        """A resident model whose engine faulted, with the shared thread free to load it again.
        After a hang the thread is still running the hung job: the model stays as it is and
        its runtime answers 503 ``engine_unhealthy``."""
        if entry.runtime is None or entry.runtime.readiness()[0] or self.engine.running:
            return False
        snap = entry.runtime.snapshot()
        return snap.state == "poisoned"

    def _least_recently_used_idle(self, wanted: Entry) -> Entry | None:
        idle = [e for e in self.entries.values() if e is not wanted and e.state == "ready" and not e.active]
        return min(idle, key=lambda e: e.last_used) if idle else None

    def _start_load(self, entry: Entry) -> None:
        entry.fsm.fire("load_requested")
        entry.detail = "loading"
        entry._drain, entry._settled, entry._gone = trio.Event(), trio.Event(), trio.Event()
        self._nursery.start_soon(self._hold, entry)
        self._touch()

    def _evict(self, entry: Entry, *, counted: bool) -> None:
        entry.fsm.fire("unload_requested")
        entry.detail = "draining"
        if counted:
            entry.evictions += 1
        log.info("model %s: %s", entry.model_id, "evicted (least recently used)" if counted else "unloading")
        entry._drain.set()
        self._touch()

    def _touch(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _hold(self, entry: Entry) -> None:
        """The task that owns one resident model's runtime, from load to release."""
        try:
            async with self._open_runtime(entry.runner_factory(), entry.config,
                                          engine_thread=self.engine.lane) as runtime:
                entry.runtime = runtime
                if not await runtime.wait_ready():
                    entry.detail = runtime.readiness()[1]
                    entry.fsm.fire("load_failed")
                    entry.failed_at = trio.current_time()
                    log.error("model %s failed to load: %s", entry.model_id, entry.detail)
                    return
                entry.loads += 1
                entry.fsm.fire("loaded")
                entry.detail = "ready"
                log.info("model %s loaded (%d bytes of the model memory)", entry.model_id, entry.need_bytes)
                if entry.on_loaded is not None:
                    entry.on_loaded(runtime)
                entry._settled.set()
                self._touch()
                await entry._drain.wait()
                with trio.CancelScope(shield=True):
                    await runtime.drain(DRAIN_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 — one model's bug must not stop the other models
            log.exception("model %s: its runtime failed", entry.model_id)
            entry.detail = f"internal error: {type(e).__name__}: {e}"
        finally:
            entry.runtime = None
            with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_TIMEOUT_S):
                await self.engine.release_memory()  # bounded: a hung engine thread never answers
            if entry.state == "loading":  # cancelled while loading (the server stops), or a bug
                if entry.detail == "loading":
                    entry.detail = "server stopped"
                entry.fsm.fire("load_failed")
                entry.failed_at = trio.current_time()
            elif entry.state in ("ready", "draining"):
                if entry.state == "ready":
                    entry.fsm.fire("unload_requested")
                entry.fsm.fire("drained")
                entry.detail = "not loaded"
            entry._settled.set()
            entry._gone.set()
            self._touch()
