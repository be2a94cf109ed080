"""The engine supervisor: readiness, the GPU deadline, and one-way poisoning.

Its ``transitions`` machine is the single source of ``readiness()`` (and so ``/readyz``);
reading it never touches the engine thread. ``poison(detail)`` is
idempotent and one way: the first call moves the machine to ``poisoned`` and runs the
``on_poisoned`` callback, which fails every active and queued request exactly once and
stops all GPU work; later calls only keep the first detail.
"""

from __future__ import annotations

import logging
from typing import Callable

import trio

from hf2q.sched.contracts import AdmissionRejected
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.supervisor import SUPERVISOR

log = logging.getLogger("hf2q.supervisor")


class EnginePoisoned(Exception):
    """The engine faulted or hung; no GPU work will run again."""


class Supervisor:
    def __init__(self, gpu_deadline_s: float | None):
        self.fsm = Lifecycle(SUPERVISOR)
        self.deadline_s = gpu_deadline_s
        self.detail = "loading model"
        self.on_poisoned: Callable[[str], None] | None = None
        self.settled = trio.Event()  # set once ready or poisoned (for wait_ready)

    @property
    def state(self) -> str:
        """The current state of this actor's machine."""
        return self.fsm.state

    @property
    def ready(self) -> bool:
        return self.fsm.state == "ready"

    @property
    def poisoned(self) -> bool:
        return self.fsm.state == "poisoned"

    def readiness(self) -> tuple[bool, str]:
        return (self.ready, "ready" if self.ready else self.detail)

    def refusal(self) -> AdmissionRejected | None:
        """The 503 ``AdmissionRejected`` every new request gets now, or None while the engine serves."""
        if self.poisoned:
            return AdmissionRejected(503, "engine_unhealthy", self.detail, 1)
        if not self.ready:
            return AdmissionRejected(503, "not_ready", self.detail, 1)
        return None

    def loaded(self) -> None:
        if self.fsm.state == "starting":
            self.fsm.fire("engine_loaded")
            self.detail = "ready"
        self.settled.set()

    def poison(self, detail: str, *, hung: bool = False) -> None:
        if self.poisoned or self.fsm.state == "stopped":
            return
        self.fsm.fire("deadline_expired" if hung else "engine_faulted")
        self.detail = f"engine unhealthy: {detail}"
        log.error("engine poisoned: %s", detail)
        self.settled.set()
        if self.on_poisoned is not None:
            self.on_poisoned(self.detail)

    def drain_requested(self) -> None:
        if self.fsm.state in ("starting", "ready"):
            self.fsm.fire("drain_requested")
            self.detail = "draining: not accepting new requests"

    def drained(self) -> None:
        if self.fsm.state == "draining":
            self.fsm.fire("drained")
            self.detail = "stopped"
