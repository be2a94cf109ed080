"""Lifecycle of the KV-persist writer actor: ``idle → writing → syncing → idle``.

``writing`` is the temp-file write of one block, ``syncing`` its fsync → rename →
directory fsync. An I/O error in either moves to ``failed``; the actor logs and counts it,
then fires ``recovered`` and waits for the next block — a full disk never stops the
server. ``closed`` is terminal: the input channel ended and the queue was drained.
"""

from __future__ import annotations

import enum

from hf2q.statemachines.base import MachineSpec


class WriterState(enum.Enum):
    idle = "idle"
    writing = "writing"
    syncing = "syncing"
    failed = "failed"
    closed = "closed"


S = WriterState

SPEC = MachineSpec.declare(
    "kv_writer",
    WriterState,
    S.idle,
    [
        ("block_dequeued", S.idle, S.writing),
        ("block_written", S.writing, S.syncing),
        ("block_synced", S.syncing, S.idle),
        ("block_already_stored", S.writing, S.idle),
        ("io_failed", [S.writing, S.syncing], S.failed),
        ("recovered", S.failed, S.idle),
        ("input_closed", [S.idle, S.failed], S.closed),
    ],
    description="KV-persist writer: one block at a time, temp → fsync → rename → dir fsync; "
                "I/O errors are counted and survived.",
)
