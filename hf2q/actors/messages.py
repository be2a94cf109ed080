"""Messages between the actors (attrs records), and who sends them to whom.

- admission → slot: ``Assignment`` (a request and how much of its prompt the slot's KV
  already holds), ``Evict`` (drop an idle cache);
- slot → admission: ``Released`` (the request is over; what the slot's KV now holds);
- slot → GPU owner: one ``PrefillWork`` per prompt chunk, answered on its ``Reply``. Every
  chunk names the request's ``Generation``: from the last chunk's logits on, the GPU owner's
  step loop owns the request's tokens — it samples, applies the stop rule, sends ``Token``
  and the terminal event straight to the request's channel, and sets ``Generation.ended``;
- slot → KV prefix actor: ``Restore`` (import persisted blocks), ``Persist`` (export the
  prompt's blocks to the writer) and ``Overwrite`` (the slot is about to drop its KV), each
  answered on its ``Reply``;
- KV writer → KV prefix actor: ``WriterIdle`` (its queue emptied: deferred blocks may follow).
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from hf2q.actors.handle import RequestHandle
from hf2q.actors.progress import SlotProgress
from hf2q.sched.decoding import DecodeLimits


@attrs.define(eq=False)
class Reply:
    """Filled in by the receiving actor; ``ready`` is set when the other fields are valid."""

    ready: trio.Event = attrs.Factory(trio.Event)
    result: Any = None
    error: Any = None  # a failure of this request alone (e.g. its sampling parameters); engine healthy
    skipped: bool = False  # the work was dropped unexecuted (client gone before the step)

    def set(self, result=None, *, error=None, skipped: bool = False) -> None:
        self.result, self.error, self.skipped = result, error, skipped
        self.ready.set()


@attrs.frozen
class Assignment:
    handle: RequestHandle
    cached_tokens: int  # of the prompt, already in the slot's KV
    limits: DecodeLimits  # the request's token-level stop rule
    prefill_chunk: int  # rows per prefill transaction (``sched.transactions.transaction_tokens`` for the model)


@attrs.frozen
class Evict:
    """Drop the idle slot's cached KV (the budget needs the room)."""


@attrs.frozen
class Released:
    """The slot's request ended; its KV keeps ``tokens`` for the next prompt sharing them."""

    slot: int
    tokens: tuple[int, ...]
    #: the lengths the slot's cache can be trimmed back to (hybrid models), None = any
    points: tuple[int, ...] | None = None


@attrs.define(eq=False)
class Generation:
    """One request as the GPU owner sees it, from its first chunk to its terminal event.

    The GPU owner sets ``kv_tail`` (the generated tokens it fed into the slot's KV) and then
    ``ended``, after it sent the terminal event; the slot waits for ``ended`` to release.
    """

    slot: int
    handle: RequestHandle
    limits: DecodeLimits
    progress: SlotProgress
    prompt_len: int
    ended: trio.Event = attrs.Factory(trio.Event)
    kv_tail: list[int] = attrs.Factory(list)


@attrs.define(eq=False)
class PrefillWork:
    """One prefill transaction: trim ``seq`` to ``keep`` tokens, then append ``tokens``."""

    slot: int
    seq: Any
    keep: int | None  # trim before appending (first transaction of a request); None = append
    tokens: list[int]
    final: bool  # the prompt's last transaction: the request's first token comes from its logits
    generation: Generation
    on_picked: Any = None  # called (in trio) when the GPU owner takes it into a step
    posted_at: float = 0.0  # trio time it was posted (its prefill seconds count from here)
    reply: Reply = attrs.Factory(Reply)


@attrs.frozen
class Restore:
    """Import persisted blocks of ``prompt`` into ``seq`` beyond the ``cached`` tokens it holds;
    the reply's result is the prompt tokens now cached."""

    seq: Any
    prompt: tuple[int, ...]
    cached: int
    reply: Reply = attrs.Factory(Reply)


@attrs.frozen
class Persist:
    """``seq`` holds ``prompt``'s KV: export its full blocks not yet on disk (reply once exported)."""

    seq: Any
    prompt: tuple[int, ...]
    reply: Reply = attrs.Factory(Reply)


@attrs.frozen
class Overwrite:
    """``seq`` is about to keep only its first ``keep`` tokens: blocks of it still waiting for the
    writer beyond them can no longer be exported (reply once they are given up)."""

    seq: Any
    keep: int
    reply: Reply = attrs.Factory(Reply)


@attrs.frozen
class WriterIdle:
    """The KV writer's queue is empty (sent once per ``KVWriter.notify_idle``)."""
