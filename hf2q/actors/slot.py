"""A slot actor: runs one request at a time on its slot's KV sequence.

It owns the slot's ``transitions`` machine (``idle → admitted → prefilling → decoding →
finishing → idle``, with ``cancelled``/``failed``), the request's event stream, and the
token-level stop rules: end-of-sequence and ``stop_token_ids`` end with ``stop`` (the
token is not sent), ``max_tokens`` or a full per-slot context with ``length``. Text-level
stop strings belong to the API, which closes the channel. The client's presence is
checked at every GPU step boundary; the slot is released exactly once per request.
"""

from __future__ import annotations

import math
import attrs
import trio

from hf2q.actors.gpu_owner import EnginePoisoned
from hf2q.actors.handle import RequestHandle
from hf2q.actors.messages import (
    ENDED,
    SKIPPED,
    DecodeRun,
    Leave,
    PrefillWork,
    SampleError,
)
from hf2q.actors.prefill import PrefillTransaction
from hf2q.sched.decoding import DecodeLimits
from hf2q.sched.planner import prefill_chunks
from hf2q.sched.requests import Admitted, Failed, Finished, PrefillProgress, Token
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.slot import SLOT


@attrs.frozen
class Assignment:
    handle: RequestHandle
    cached_tokens: int  # of the prompt, already in the slot's KV (or restored into it)
    restore: object = None  # persistent-KV blocks to import first (see ActorSystem)


@attrs.frozen
class Evict:
    """Drop the idle slot's cached KV (the budget needs the room)."""


@attrs.define
class SlotProgress:
    """Live numbers for the operator view (never prompt text)."""

    request_id: str | None = None
    cached_tokens: int = 0
    new_tokens: int = 0
    prefilled_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None

    def prefill_rate(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    def decode_rate(self) -> float:
        if self.first_token_at is None or self.last_token_at is None or self.generated_tokens < 2:
            return 0.0
        span = self.last_token_at - self.first_token_at
        return (self.generated_tokens - 1) / span if span > 0 else 0.0


class SlotActor:
    def __init__(self, index: int, system):
        self.index = index
        self.fsm = Lifecycle(SLOT)
        self.system = system
        self.seq = None
        self.inbox_send, self._inbox = trio.open_memory_channel(math.inf)
        self.progress = SlotProgress()
        self.handle: RequestHandle | None = None
        self._txn: PrefillTransaction | None = None

    @property
    def state(self) -> str:
        """The current state of this actor's machine."""
        return self.fsm.state

    async def run(self) -> None:
        try:
            async for msg in self._inbox:
                if isinstance(msg, Evict):
                    if self.seq is not None and self.fsm.state == "idle":
                        seq = self.seq
                        await self.system.gpu.transact(lambda runner: seq.trim(0), "evict")
                elif isinstance(msg, Assignment):
                    await self._serve(msg)
        except EnginePoisoned:
            return  # the supervisor already ended every request

    def engine_failed(self) -> None:
        """The engine was poisoned: settle the machine (the request itself is failed by the system)."""
        if self._txn is not None:
            self._txn.engine_failed()
        if self.fsm.state in ("admitted", "prefilling", "decoding", "finishing"):
            self.fsm.fire("engine_failed")

    # ---- one request ---------------------------------------------------------------------

    async def _serve(self, a: Assignment) -> None:
        h = self.handle = a.handle
        self.fsm.fire("assigned")
        self.progress = SlotProgress(h.request_id, a.cached_tokens, len(h.req.prompt_tokens) - a.cached_tokens)
        terminal = await self._generate(h, a)  # EnginePoisoned propagates: the system fails h
        h.finish(terminal)  # no effect if the handle already ended (reader too slow)
        t = h.terminal
        if isinstance(t, Finished) and t.reason in ("stop", "length"):
            self.fsm.fire("stop_reached")
        elif isinstance(t, Failed):
            self.fsm.fire("request_failed")
        else:
            self.fsm.fire("client_gone")
        self.system.gpu.inbox_send.send_nowait(Leave(self.index))  # the next steps need not wait for us
        # persistent KV: the client has its answer; save the prompt's full blocks still missing on disk
        prompt = h.req.prompt_tokens
        held = self.system.ledger.resident_tokens(self.index)
        await self.system.persist_prompt(self, prompt[:min(len(prompt), held)])
        self.fsm.fire("released")
        self.handle = None
        self.system.slot_released(self.index)

    def _finished(self, h: RequestHandle, reason: str, cached: int) -> Finished:
        p, now = self.progress, trio.current_time()
        ttft = ((p.first_token_at if p.first_token_at is not None else now) - h.submitted_at) * 1000.0
        return Finished(reason, len(h.req.prompt_tokens), p.generated_tokens, cached, ttft,
                        p.prefill_rate(), p.decode_rate())

    async def _generate(self, h: RequestHandle, a: Assignment) -> Finished | Failed:
        sys_ = self.system
        prompt = list(h.req.prompt_tokens)
        params = h.req.params
        cached = a.cached_tokens
        if self.seq is None:
            self.seq = await sys_.gpu.transact(lambda runner: runner.new_sequence(), "new_sequence")
        if a.restore is not None:
            cached = await sys_.restore_prefix(self, a.restore, cached, prompt)
            self.progress.cached_tokens, self.progress.new_tokens = cached, len(prompt) - cached
        h.emit(Admitted(self.index, len(prompt), cached))
        try:
            sampler = sys_.make_sampler(params)
        except Exception as e:  # noqa: BLE001 — bad parameters fail this request only
            return Failed(400, "invalid_request", f"invalid sampling parameters: {e}")
        constraint = params.constraint
        gone = lambda: h.gone  # noqa: E731
        limits = DecodeLimits(sys_.eos_token_ids, params.stop_token_ids, params.max_tokens, sys_.ctx)
        # the request's decoding: the GPU owner starts it from the first token and keeps it in
        # every step; each step's outcome arrives on ``outcomes`` (see hf2q.actors.messages)
        outbox, outcomes = trio.open_memory_channel(math.inf)
        run = DecodeRun(self.index, self.seq, [], sampler, constraint, gone, limits, len(prompt), outbox)
        with outcomes:  # closed when the request ends: a late outcome for it is dropped
            self.fsm.fire("prefill_started")
            sampled = None
            chunks = prefill_chunks(cached, len(prompt), sys_.prefill_chunk)
            for i, (start, end) in enumerate(chunks):
                if h.gone:
                    return self._finished(h, "cancelled", cached)
                final = end == len(prompt)
                work = PrefillWork(self.index, self.seq, cached if i == 0 else None, prompt[start:end], final,
                                   run.history, sampler, constraint, gone, run=run if final else None)
                self._txn = PrefillTransaction(work)
                t0 = trio.current_time()
                await self._txn.run(sys_.gpu.inbox_send)
                self._txn = None
                if work.reply.skipped:
                    return self._finished(h, "cancelled", cached)
                sys_.ledger.extend(self.index, work.tokens)
                self.progress.prefilled_tokens += end - start
                self.progress.prefill_seconds += trio.current_time() - t0
                if work.reply.error:
                    err = work.reply.error
                    return Failed(err.status, err.code, err.message)
                if work.final:
                    sampled = work.reply.result
                    self.fsm.fire("prefilled")
                else:
                    self.fsm.fire("chunk_prefilled")
                h.emit(PrefillProgress(end, len(prompt)))
            while True:
                tok = sampled.token_id
                verdict = limits.after_token(tok, self.progress.generated_tokens,
                                             sys_.ledger.resident_tokens(self.index))
                if verdict == "stop":  # end-of-generation / stop id: not sent
                    return self._finished(h, "stop", cached)
                now = trio.current_time()
                if self.progress.first_token_at is None:
                    self.progress.first_token_at = now
                self.progress.last_token_at = now
                if not h.emit(Token(tok, sampled.logprob, sampled.top_logprobs)):
                    return self._finished(h, "cancelled", cached)
                self.progress.generated_tokens += 1
                if verdict == "length":  # max_tokens, or no room left in the context
                    return self._finished(h, "length", cached)
                if h.gone:
                    return self._finished(h, "cancelled", cached)
                # the GPU owner reached the same verdict and already feeds ``tok`` to the next step
                outcome = await outcomes.receive()
                if outcome is SKIPPED:
                    return self._finished(h, "cancelled", cached)
                if outcome is ENDED:  # the GPU owner's verdict differed from ours: a bug, never a hang
                    return Failed(500, "internal_error", "the decode run ended before the request did")
                sys_.ledger.extend(self.index, [tok])
                if isinstance(outcome, SampleError):
                    return Failed(outcome.status, outcome.code, outcome.message)
                self.fsm.fire("token_decoded")
                sampled = outcome
