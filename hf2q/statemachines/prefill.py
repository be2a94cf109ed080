"""Lifecycle of one prefill transaction: a bounded chunk of prompt tokens on the GPU.

A prefill-transaction actor posts the chunk to the GPU owner (``queued``), the GPU owner
runs it in one step (``running``), and its result is ``committed`` to the slot's KV.
A client that leaves before the chunk is picked, or a request whose sampling parameters
the GPU owner refuses on its first chunk, is ``aborted`` without GPU work; a fault
while running ends it ``failed``. Cancellation is observed only at these boundaries —
a running MLX step cannot be interrupted.
"""

from __future__ import annotations

import enum

from hf2q.statemachines.base import MachineSpec


class PrefillState(enum.Enum):
    queued = "queued"
    running = "running"
    committed = "committed"
    aborted = "aborted"
    failed = "failed"


P = PrefillState

PREFILL_TRANSACTION = MachineSpec.declare(
    "prefill_transaction", PrefillState, P.queued,
    [
        ("picked", P.queued, P.running),
        ("computed", P.running, P.committed),
        ("client_gone", P.queued, P.aborted),
        ("request_refused", P.queued, P.aborted),
        ("engine_failed", (P.queued, P.running), P.failed),
    ],
    description="one bounded prefill chunk, from posting to commit",
)
