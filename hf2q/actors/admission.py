"""The admission actor: the runtime's front door, and the one owner of the ledger, reservations and budget.

``submit`` answers at once: refused (``AdmissionRejected``: not serving, can never fit, or
429 when the queue is full) or queued. The actor's loop hands queued requests, in arrival
order, to the slot chosen by the pure ``KvBudget.decide`` (longest cached prefix, KV
budget, LRU eviction of idle caches) whenever something changed: a new request, a slot's
``Released`` message on its inbox, a drain. A request whose client left while queued ends
there. It also keeps the live request handles (so a poisoned engine or a shutdown fails
each exactly once) and the request counters.
"""

from __future__ import annotations

import collections
import math
from typing import Callable

import attrs
import trio

from hf2q.actors.handle import RequestHandle
from hf2q.actors.messages import Assignment, Evict, Released
from hf2q.sched.budget import Admit, KvBudget, Never, Wait
from hf2q.sched.contracts import AdmissionRejected, Failed, Finished, GenerationRequest, ModelFacts, RuntimeConfig
from hf2q.sched.decoding import DecodeLimits
from hf2q.sched.intake import check_generation
from hf2q.sched.ledger import SlotLedger
from hf2q.sched.transactions import transaction_tokens
from hf2q.statemachines.admission import ADMISSION
from hf2q.statemachines.base import Lifecycle


class QueueFull(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@attrs.frozen
class Wake:
    """Inbox marker: look at the queue again (a request was queued, a drain began)."""


class Admission:
    def __init__(self, config: RuntimeConfig, slot_inboxes: list[trio.MemorySendChannel],
                 refusal: Callable[[], AdmissionRejected | None]):
        self.fsm = Lifecycle(ADMISSION)
        self.config = config
        self.capacity = config.queue_capacity
        self._slots = slot_inboxes
        self._refusal = refusal  # the supervisor's 503 while the engine does not serve
        self.queue: collections.deque[RequestHandle] = collections.deque()
        self.ledger = SlotLedger(len(slot_inboxes))
        self.reservations: dict[int, int] = {}
        self.assigned: dict[int, RequestHandle] = {}  # slot → the request it runs
        self.budget: KvBudget | None = None
        self.facts: ModelFacts | None = None
        self.prefill_chunk: int | None = None  # the family's transaction size, set by configure
        self.counters: collections.Counter[str] = collections.Counter()
        self.hooks: list[Callable] = [self._count] + ([config.on_event] if config.on_event else [])
        self.live: list[RequestHandle] = []
        self.inbox_send, self._inbox = trio.open_memory_channel(math.inf)  # Released | Wake
        self.activity = trio.Event()  # set whenever a slot was released (drain waits on it)

    @property
    def state(self) -> str:
        """The current state of this actor's machine."""
        return self.fsm.state

    @property
    def accepting(self) -> bool:
        return self.fsm.state == "accepting"

    @property
    def quiet(self) -> bool:
        """Nothing queued and nothing running."""
        return not self.queue and not self.ledger.busy_slots()

    def configure(self, facts: ModelFacts) -> None:
        """The model is loaded: the per-slot context and the KV budget are known."""
        self.facts = facts
        self.ledger.whole_history_only = not facts.trims_prefix
        self.budget = KvBudget(facts.kv_bytes_per_token, facts.budget_bytes(self.config), facts.ctx)
        self.prefill_chunk = transaction_tokens(facts.arch, self.config.prefill_chunk)

    # ---- the front door -------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> trio.MemoryReceiveChannel:
        """Queue ``req`` and return its event channel, or raise ``AdmissionRejected``."""
        self.counters["requests"] += 1
        try:
            refused = self._refusal() or (None if self.accepting else AdmissionRejected(
                503, "not_ready", "draining: not accepting new requests", 1))
            if refused is not None:
                raise refused
            check_generation(req, self.facts, self.budget)
            h = RequestHandle(req, self.config.token_buffer, self.hooks, trio.current_time())
            try:
                self._offer(h)
            except QueueFull as e:
                raise AdmissionRejected(429, e.code, str(e), 1) from None
        except AdmissionRejected as e:
            raise self.reject(req.request_id, e) from None
        self.live = [x for x in self.live if not x.done]
        self.live.append(h)
        self.counters["prompt_tokens"] += len(req.prompt_tokens)
        return h.receive

    def reject(self, request_id: str, err: AdmissionRejected) -> AdmissionRejected:
        """Count a refusal and tell the event hooks; returns ``err`` for the caller to raise."""
        self.counters[f"rejected_{err.code}"] += 1
        for hook in self.hooks:
            try:
                hook(request_id, err)
            except Exception:  # noqa: BLE001 — a metrics bug must not break serving
                pass
        return err

    def _count(self, request_id: str, event) -> None:
        if isinstance(event, Finished):
            self.counters["cancelled" if event.reason == "cancelled" else "finished"] += 1
            self.counters["completion_tokens"] += event.completion_tokens
            self.counters["cached_tokens"] += event.cached_tokens
        elif isinstance(event, Failed):
            self.counters["failed"] += 1
            self.counters[f"failed_{event.code}"] += 1

    def _offer(self, h: RequestHandle) -> None:
        """Queue ``h`` or raise ``QueueFull``; the caller already checked it can ever fit."""
        self._drop_gone()
        waiting = Wait("slots") if self.queue else self._decide(h)
        if isinstance(waiting, Wait) and len(self.queue) >= self.capacity:
            if waiting.reason == "kv":
                raise QueueFull("slot_budget_exceeded",
                                "the KV budget is held by running requests and the queue is full; retry later")
            raise QueueFull("queue_full", f"all slots are busy and {len(self.queue)} requests are queued")
        self.queue.append(h)
        self.admit_ready()  # assign at once when possible, so the next offer sees the true state

    def _decide(self, h: RequestHandle):
        for slot, running in self.assigned.items():  # ended or stopped by its client, not yet released:
            if running.gone:                           # worth waiting for?
                self.ledger.mark_finishing(slot, running.req.prompt_tokens)
        return self.budget.decide(self.ledger, self.reservations, h.req.prompt_tokens, h.req.params.max_tokens)

    def _drop_gone(self) -> None:
        kept = collections.deque()
        for h in self.queue:
            if h.gone:
                h.finish(Finished("cancelled", len(h.req.prompt_tokens), 0, 0, 0.0, 0.0, 0.0))
            else:
                kept.append(h)
        self.queue = kept

    # ---- the actor ------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            self.admit_ready()
            if self.fsm.state == "draining" and not self.queue:
                self.fsm.fire("queue_emptied")
            self._take(await self._inbox.receive())
            while True:
                try:
                    self._take(self._inbox.receive_nowait())
                except trio.WouldBlock:
                    break

    def _take(self, msg) -> None:
        if isinstance(msg, Released):
            self.ledger.replace(msg.slot, msg.tokens, msg.points)
            self.ledger.release(msg.slot)
            self.reservations.pop(msg.slot, None)
            self.assigned.pop(msg.slot, None)
            self.activity.set()
            self.activity = trio.Event()
        elif not isinstance(msg, Wake):
            raise TypeError(f"unexpected message {msg!r}")

    def wake(self) -> None:
        self.inbox_send.send_nowait(Wake())

    def admit_ready(self) -> None:
        """Assign queued requests to slots while the head of the queue fits."""
        self._drop_gone()
        while self.queue and self.fsm.state in ("accepting", "draining"):
            h = self.queue[0]
            decision = self._decide(h)
            if isinstance(decision, Wait):
                return
            self.queue.popleft()
            if isinstance(decision, Never):
                h.finish(Failed(400, decision.code, decision.message))
                continue
            assert isinstance(decision, Admit)
            for victim in decision.evict:
                self.ledger.evict(victim)
                self._slots[victim].send_nowait(Evict())
            params = h.req.params
            self.ledger.acquire(decision.slot, decision.cached_tokens)
            self.reservations[decision.slot] = self.budget.reservation(len(h.req.prompt_tokens), params.max_tokens)
            self.assigned[decision.slot] = h
            self.counters["admitted"] += 1
            limits = DecodeLimits(self.facts.eos_token_ids, params.stop_token_ids, params.max_tokens, self.facts.ctx)
            self._slots[decision.slot].send_nowait(Assignment(h, decision.cached_tokens, limits,
                                                                      self.prefill_chunk))

    def drain_requested(self) -> None:
        if self.fsm.state == "accepting":
            self.fsm.fire("drain_requested")
        self.wake()

    def close(self, trigger: str, terminal: Failed | None = None) -> None:
        """Stop admitting for good; queued requests end with ``terminal`` if given."""
        if self.fsm.state in ("accepting", "draining"):
            self.fsm.fire(trigger)
        while self.queue:
            h = self.queue.popleft()
            if terminal is not None:
                h.finish(terminal)

    def fail_all(self, trigger: str, terminal: Failed) -> None:
        """Stop admitting; every queued and running request ends with ``terminal`` (once)."""
        self.close(trigger, terminal)
        for h in self.live:
            h.finish(terminal)
        self.live.clear()
        self.activity.set()
