"""Lifecycle of one slot actor: one request at a time, from assignment to release.

``idle → admitted → prefilling ⇄ decoding → finishing → idle``; a client that goes away
ends in ``cancelled``; an engine fault (or shutdown) or a failure of this request
alone (e.g. its sampler) ends in ``failed``, both released back
to ``idle`` once the slot's bookkeeping is settled — exactly once per request.
``prefilling`` loops on itself once per prefill transaction committed; a prompt's last
transaction yields the first token, and from there the GPU owner's step loop decodes the
request (no transition per token), so the slot never goes back from ``decoding`` to
``prefilling``.
"""

from __future__ import annotations

import enum

from hf2q.statemachines.base import MachineSpec


class SlotState(enum.Enum):
    idle = "idle"
    admitted = "admitted"
    prefilling = "prefilling"
    decoding = "decoding"
    finishing = "finishing"
    cancelled = "cancelled"
    failed = "failed"


S = SlotState
ACTIVE = (S.admitted, S.prefilling, S.decoding, S.finishing)

SLOT = MachineSpec.declare(
    "slot", SlotState, S.idle,
    [
        ("assigned", S.idle, S.admitted),
        ("prefill_started", S.admitted, S.prefilling),
        ("chunk_prefilled", S.prefilling, S.prefilling),
        ("prefilled", S.prefilling, S.decoding),
        ("stop_reached", (S.prefilling, S.decoding), S.finishing),
        ("client_gone", (S.admitted, S.prefilling, S.decoding), S.cancelled),
        ("engine_failed", ACTIVE, S.failed),
        ("request_failed", (S.admitted, S.prefilling, S.decoding), S.failed),
        ("released", (S.finishing, S.cancelled, S.failed), S.idle),
    ],
    description="one slot actor: a conversation's lifecycle on its slot",
)
