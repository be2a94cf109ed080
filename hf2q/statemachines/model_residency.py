"""Lifecycle of one model of a several-model server (``serve --model A --model B …``).

``unloaded → loading`` when a request (or ``POST /v1/models/{id}/load``) needs it and the
memory budget has room; ``loading → ready`` once its engine answered, ``loading → failed``
when it could not load (a later request may try again: ``failed → loading``). A ready model
leaves memory only through ``draining`` (an eviction or an unload: its requests finish
first, and the registry starts one only for a model with no active request), then
``drained`` returns it to ``unloaded``.
"""

from __future__ import annotations

import enum

from hf2q.statemachines.base import MachineSpec


class ResidencyState(enum.Enum):
    unloaded = "unloaded"
    loading = "loading"
    ready = "ready"
    draining = "draining"
    failed = "failed"


R = ResidencyState

MODEL_RESIDENCY = MachineSpec.declare(
    "model_residency", ResidencyState, R.unloaded,
    [
        ("load_requested", (R.unloaded, R.failed), R.loading),
        ("loaded", R.loading, R.ready),
        ("load_failed", R.loading, R.failed),
        ("unload_requested", R.ready, R.draining),
        ("drained", R.draining, R.unloaded),
    ],
    description="one model of a several-model server: loaded on demand, evicted only when idle",
)
