"""Lifecycle of the admission actor, which turns queued requests into slot assignments.

``accepting``: requests are checked (400 can-never-fit), queued (429 when full) and
handed to the best slot in arrival order. ``draining``: new work is refused with 503
``not_ready`` but the queue still empties. ``closed``: nothing is admitted any more —
after a drain, a shutdown, or a poisoned engine (queued requests were failed).
"""

from __future__ import annotations

import enum

from hf2q.statemachines.base import MachineSpec


class AdmissionState(enum.Enum):
    accepting = "accepting"
    draining = "draining"
    closed = "closed"


A = AdmissionState

ADMISSION = MachineSpec.declare(
    "admission", AdmissionState, A.accepting,
    [
        ("drain_requested", A.accepting, A.draining),
        ("queue_emptied", A.draining, A.closed),
        ("engine_poisoned", (A.accepting, A.draining), A.closed),
        ("shut_down", (A.accepting, A.draining), A.closed),
    ],
    description="admission: queue, routing, refusals",
)
