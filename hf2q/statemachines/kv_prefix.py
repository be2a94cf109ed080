"""Lifecycle of the KV prefix actor, which moves prompt KV between a slot and the persistent store.

``idle → restoring → idle`` around one restore (plan from the store's index, read the
blocks in a worker thread, import them into the slot's sequence on the GPU);
``idle → exporting → idle`` around one persist (export as many of the prompt's missing
blocks as the writer has room for on the GPU, hand them over, keep a record of the rest);
``idle → flushing → idle`` when the writer's queue emptied and recorded blocks remain
(export the next batch from the slots' resident KV). One message at a time, in arrival order.
"""

from __future__ import annotations

import enum

from hf2q.statemachines.base import MachineSpec


class KvPrefixState(enum.Enum):
    idle = "idle"
    restoring = "restoring"
    exporting = "exporting"
    flushing = "flushing"


K = KvPrefixState

KV_PREFIX = MachineSpec.declare(
    "kv_prefix", KvPrefixState, K.idle,
    [
        ("restore_requested", K.idle, K.restoring),
        ("restored", K.restoring, K.idle),
        ("persist_requested", K.idle, K.exporting),
        ("exported", K.exporting, K.idle),
        ("writer_idle", K.idle, K.flushing),
        ("flushed", K.flushing, K.idle),
    ],
    description="KV prefix actor: restore persisted prompt KV into a slot, export a slot's prompt KV to the "
                "writer, the blocks a full writer could not take once it is idle",
)
