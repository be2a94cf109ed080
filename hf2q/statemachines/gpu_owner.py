"""Lifecycle of the GPU-owner actor and its dedicated engine thread.

``stopped → loading`` when the thread starts and calls the runner factory; ``idle ⇄ busy``
around every GPU transaction (one decode-first mixed step, an embedding batch, a KV
export/import); ``faulted`` on an exception or a deadline expiry — terminal, no further
GPU work is ever submitted; ``stopped`` again on shutdown.
"""

from __future__ import annotations

import enum

from hf2q.statemachines.base import MachineSpec


class GpuOwnerState(enum.Enum):
    stopped = "stopped"
    loading = "loading"
    idle = "idle"
    busy = "busy"
    faulted = "faulted"


G = GpuOwnerState

GPU_OWNER = MachineSpec.declare(
    "gpu_owner", GpuOwnerState, G.stopped,
    [
        ("thread_started", G.stopped, G.loading),
        ("loaded", G.loading, G.idle),
        ("transaction_submitted", G.idle, G.busy),
        ("transaction_completed", G.busy, G.idle),
        ("faulted", (G.loading, G.busy), G.faulted),
        ("deadline_expired", (G.loading, G.busy), G.faulted),
        ("shut_down", (G.loading, G.idle, G.busy), G.stopped),
    ],
    description="the only engine caller: one thread, one transaction at a time",
)
