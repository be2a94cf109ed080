"""Lifecycle of the engine supervisor, the source of ``/readyz``.

``starting → ready`` once the model loaded; a fault or a GPU deadline expiry moves
``starting`` or ``ready`` (or ``draining``) to ``poisoned`` one way: there is no edge out
of ``poisoned`` — recovery is a process restart. ``ready → draining → stopped``
is the graceful shutdown.
"""

from __future__ import annotations

import enum

from hf2q.statemachines.base import MachineSpec


class SupervisorState(enum.Enum):
    starting = "starting"
    ready = "ready"
    draining = "draining"
    stopped = "stopped"
    poisoned = "poisoned"


V = SupervisorState

SUPERVISOR = MachineSpec.declare(
    "supervisor", SupervisorState, V.starting,
    [
        ("engine_loaded", V.starting, V.ready),
        ("drain_requested", (V.starting, V.ready), V.draining),
        ("drained", V.draining, V.stopped),
        ("engine_faulted", (V.starting, V.ready, V.draining), V.poisoned),
        ("deadline_expired", (V.starting, V.ready, V.draining), V.poisoned),
    ],
    description="engine health: readiness, one-way poisoning, graceful drain",
)
