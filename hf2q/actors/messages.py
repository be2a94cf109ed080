"""Messages between the slot actors, prefill transactions and the GPU owner (attrs records).

A slot posts one ``PrefillWork`` per prompt chunk and waits for its ``Reply``. Its last
chunk carries the request's ``DecodeRun``: when the first sampled token lets the request
go on, the GPU owner keeps the run in every following batched decode step by itself —
feeding each sampled token back, deciding with the same pure ``DecodeLimits`` rule the slot
uses whether there is a next step — and posts every step's outcome to the run's outbox,
which the slot reads. The GPU thread therefore never idles while trio tasks stream tokens
to clients. ``Leave`` tells the GPU owner that the slot's request ended (any run of it still
held is dropped before the slot can post new work).
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


@attrs.frozen
class RunSkipped:
    """Outbox marker: the run was dropped before its next step (client gone); no GPU work was done."""


SKIPPED = RunSkipped()


@attrs.frozen
class RunEnded:
    """Outbox marker after a run's last outcome (its stop rule ended it, or sampling failed). The
    slot reaches the same verdict from that outcome and never reads this; reading it would be
    a bug, which the slot then reports as an error instead of waiting forever."""


ENDED = RunEnded()


@attrs.define(eq=False)
class DecodeRun:
    """One request's decoding, held by the GPU owner across steps (see the module docstring).

    ``emitted`` / ``resident`` are the counts ``DecodeLimits.after_token`` needs; the GPU
    owner advances them, appends each fed token to ``history`` (the sampler's penalty
    window) and sets ``token`` to the next token to feed. Only the GPU owner's trio task
    touches these fields, and only between steps, when the engine thread is not reading them.
    """

    slot: int
    seq: Any
    history: list[int]  # generated ids so far (read by the sampler in the GPU thread)
    sampler: Any
    constraint: Any
    is_gone: Any  # callable: the client left → drop at the next step boundary
    limits: Any  # hf2q.sched.decoding.DecodeLimits
    resident: int  # tokens in the slot's KV (the prompt, once prefilled)
    outbox: trio.MemorySendChannel  # Sampled | SampleError per step, then SKIPPED or ENDED (unbounded)
    emitted: int = 0
    token: int | None = None  # fed to the model by the next step


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
    run: DecodeRun | None = None  # on the final chunk: started by the GPU owner when decoding goes on
    reply: Reply = attrs.Factory(Reply)


@attrs.frozen
class Leave:
    """The slot's request ended: drop any decode run of it still held."""

    slot: int
