"""Lifecycle of the KV prefix actor, which moves prompt KV between a slot and the persistent store.

``idle → restoring → idle`` around one restore (plan from the store's index, read the
blocks in a worker thread, import them into the slot's sequence on the GPU);
``idle → exporting → idle`` around one persist (export the prompt's missing blocks on the
GPU, hand them to the writer). One message at a time, in arrival order.
"""

from __future__ import annotations

import enum

from hf2q.statemachines.base import MachineSpec


class KvPrefixState(enum.Enum):
    idle = "idle"
    restoring = "restoring"
    exporting = "exporting"


K = KvPrefixState

KV_PREFIX = MachineSpec.declare(
    "kv_prefix", KvPrefixState, K.idle,
    [
        ("restore_requested", K.idle, K.restoring),
        ("restored", K.restoring, K.idle),
        ("persist_requested", K.idle, K.exporting),
        ("exported", K.exporting, K.idle),
    ],
    description="KV prefix actor: restore persisted prompt KV into a slot, export a slot's prompt KV to the writer",
)
