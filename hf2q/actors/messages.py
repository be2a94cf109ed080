"""Messages between the slot actors, prefill transactions and the GPU owner (attrs records).

A slot posts at most one piece of work at a time and waits for its ``Reply``; after every
reply it posts either its next piece of work or ``Leave`` — the GPU owner relies on that
to batch every decoding slot into each step.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio


@attrs.define(eq=False)
class Reply:
    """Filled in by the GPU owner; ``ready`` is set when ``result`` or ``error`` is valid."""

    ready: trio.Event = attrs.Factory(trio.Event)
    result: Any = None
    error: "SampleError | None" = None  # a failure of this request alone (its sampler); engine healthy
    skipped: bool = False  # the work was dropped unexecuted (client gone before the step)

    def set(self, result=None, *, error: "SampleError | None" = None, skipped: bool = False) -> None:
        self.result, self.error, self.skipped = result, error, skipped
        self.ready.set()


@attrs.frozen
class SampleError:
    """Sampling failed for one request: bad input (400) or a sampler bug (500)."""

    status: int
    code: str
    message: str


@attrs.frozen
class Sampled:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]


@attrs.define(eq=False)
class DecodeWork:
    slot: int
    seq: Any
    token: int  # fed to the model (the slot's last sampled token)
    history: list[int]  # generated ids so far: the penalty window (read in the GPU thread)
    sampler: Any
    constraint: Any
    is_gone: Any  # callable: the client left → drop from the batch
    reply: Reply = attrs.Factory(Reply)


@attrs.define(eq=False)
class PrefillWork:
    """One prefill transaction: trim ``seq`` to ``keep`` tokens, then append ``tokens``."""

    slot: int
    seq: Any
    keep: int | None  # trim before appending (first transaction of a request); None = append
    tokens: list[int]
    final: bool  # the prompt's last transaction: sample the first token from its logits
    history: list[int]
    sampler: Any
    constraint: Any
    is_gone: Any
    on_picked: Any = None  # called (in trio) when the GPU owner takes it into a step
    reply: Reply = attrs.Factory(Reply)


@attrs.frozen
class Leave:
    """The slot has no more GPU work for now (its request ended)."""

    slot: int
