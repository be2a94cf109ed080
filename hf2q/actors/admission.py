"""The admission actor: the queue between ``Runtime.submit`` and the slot actors.

``offer`` runs synchronously inside ``submit`` so the caller learns at once whether the
request is queued or refused (429 when the queue is full). The actor's loop hands queued
requests, in arrival order, to the slot chosen by the pure ``KvBudget.decide`` (longest
cached prefix, KV budget, LRU eviction of idle caches) whenever something changed: a new
request, a released slot, a drain. A request whose client left while queued ends there.
"""

from __future__ import annotations

import collections
import trio

from hf2q.actors.handle import RequestHandle
from hf2q.actors.slot import Assignment, Evict
from hf2q.sched.budget import Admit, Never, Wait
from hf2q.sched.requests import Failed, Finished
from hf2q.statemachines.admission import ADMISSION
from hf2q.statemachines.base import Lifecycle


class QueueFull(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Admission:
    def __init__(self, system, capacity: int):
        self.fsm = Lifecycle(ADMISSION)
        self.system = system
        self.capacity = capacity
        self.queue: collections.deque[RequestHandle] = collections.deque()
        self._changed = trio.Event()

    @property
    def state(self) -> str:
        """The current state of this actor's machine."""
        return self.fsm.state

    @property
    def accepting(self) -> bool:
        return self.fsm.state == "accepting"

    def wake(self) -> None:
        self._changed.set()

    def offer(self, h: RequestHandle) -> None:
        """Queue ``h`` or raise ``QueueFull``; the caller already checked it can ever fit."""
        self._drop_gone()
        if self.queue:
            waiting = Wait("slots")
        else:
            waiting = self._decide(h)
        if isinstance(waiting, Wait) and len(self.queue) >= self.capacity:
            if waiting.reason == "kv":
                raise QueueFull("slot_budget_exceeded",
                                "the KV budget is held by running requests and the queue is full; retry later")
            raise QueueFull("queue_full", f"all slots are busy and {len(self.queue)} requests are queued")
        self.queue.append(h)
        self.admit_ready()  # assign at once when possible, so the next offer sees the true state

    def _decide(self, h: RequestHandle):
        s = self.system
        return s.budget.decide(s.ledger, s.reservations, h.req.prompt_tokens, h.req.params.max_tokens)

    def _drop_gone(self) -> None:
        kept = collections.deque()
        for h in self.queue:
            if h.gone:
                h.finish(Finished("cancelled", len(h.req.prompt_tokens), 0, 0, 0.0, 0.0, 0.0))
            else:
                kept.append(h)
        self.queue = kept

    async def run(self) -> None:
        while True:
            self.admit_ready()
            if self.fsm.state == "draining" and not self.queue:
                self.fsm.fire("queue_emptied")
            await self._changed.wait()
            self._changed = trio.Event()

    def admit_ready(self) -> None:
        """Assign queued requests to slots while the head of the queue fits."""
        s = self.system
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
                s.ledger.evict(victim)
                s.slots[victim].inbox_send.send_nowait(Evict())
            s.ledger.acquire(decision.slot, decision.cached_tokens)
            s.reservations[decision.slot] = s.budget.reservation(len(h.req.prompt_tokens),
                                                                 h.req.params.max_tokens)
            restore = s.plan_restore(decision.slot, h.req.prompt_tokens, decision.cached_tokens)
            s.stats["admitted"] += 1
            s.slots[decision.slot].inbox_send.send_nowait(Assignment(h, decision.cached_tokens, restore))

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
