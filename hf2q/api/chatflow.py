"""One chat completion from runtime events to the HTTP answer: a JSON body or an SSE stream.

``ChatFlow`` reads the per-request channel (``Admitted``, ``PrefillProgress``, ``Token``…,
then one ``Finished``/``Failed``), pushes tokens through the model's ``OutputDecoder`` and
keeps the bookkeeping (usage, timing, logprobs). ``collect()`` answers a non-streamed
request; ``sse()`` is an async generator of ``data:`` frames.

Cancellation (trio: no yield inside a cancel scope or nursery): the generator never yields from inside a cancel
scope — it waits for an event inside ``move_on_after`` (a cancel-safe receive) and yields
outside it. Whatever ends the stream (client disconnect → Quart cancels the sender, a stop
string, an error) goes through ``finally``, which closes the channel; the runtime sees the
closed channel and cancels the request at its next step boundary, freeing the slot once.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
import trio

from hf2q.api.chatmodel import OutputDecoder
from hf2q.api.errors import ApiError, error_body
from hf2q.api.shapes import (
    MessageAssembler,
    chunk,
    completion,
    delta_json,
    finish_reason_for,
    new_completion_id,
    now,
    usage,
)
from hf2q.sched.contracts import Admitted, Failed, Finished, PrefillProgress, Token

log = logging.getLogger("hf2q.api")

KEEPALIVE = b": keep-alive\n\n"


def sse_frame(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


@attrs.define
class FlowResult:
    """What the flow learned, for metrics and logs once it ends."""

    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    decode_tps: float = 0.0
    cancelled: str | None = None  # "client" | the decoder's stop_cause | None
    error_code: str | None = None


@attrs.define
class ChatFlow:
    events: trio.MemoryReceiveChannel
    decoder: OutputDecoder
    model_id: str
    prompt_len: int
    want_logprobs: bool = False
    include_usage: bool = False
    keepalive_s: float = 15.0
    token_text: Any = None  # callable(ids) -> str, for logprobs
    started: float = attrs.field(factory=time.perf_counter)
    cid: str = attrs.field(factory=new_completion_id)
    created: int = attrs.field(factory=now)
    asm: MessageAssembler = attrs.field(factory=MessageAssembler)
    result: FlowResult = attrs.field(factory=FlowResult)
    logprobs: list = attrs.field(factory=list)
    _first_token_at: float | None = None
    _prefill_started: float | None = None
    _finished: Finished | None = None
    _runtime_reason: str = "stop"

    def __attrs_post_init__(self) -> None:
        self.result.prompt_tokens = self.prompt_len

    # ---- event handling shared by both answers ---------------------------------------------

    def _on_event(self, ev) -> list | None:
        """Returns deltas for a token, [] for bookkeeping events, None when the request has ended."""
        if isinstance(ev, Admitted):
            self.result.cached_tokens = ev.cached_tokens
            self.result.prompt_tokens = ev.prompt_tokens
            self._prefill_started = time.perf_counter()
            return []
        if isinstance(ev, PrefillProgress):
            return []
        if isinstance(ev, Token):
            if self._first_token_at is None:
                self._first_token_at = time.perf_counter()
            self.result.completion_tokens += 1
            if self.want_logprobs and ev.logprob is not None:
                self.logprobs.append(self._logprob_entry(ev))
            deltas = self.decoder.feed(ev.token_id)
            for d in deltas:
                self.asm.add(d)
            if self.decoder.stop_hit:
                self._runtime_reason = "stop"
                self.result.cancelled = self.decoder.stop_cause or "stop_string"
                tail = self.decoder.finish()
                for d in tail:
                    self.asm.add(d)
                self.events.close()  # cancels generation at the next step boundary
                return deltas + tail + [None]
            return deltas
        if isinstance(ev, Finished):
            self._finished = ev
            self._runtime_reason = ev.reason
            self.result.cached_tokens = ev.cached_tokens
            tail = self.decoder.finish()
            for d in tail:
                self.asm.add(d)
            return tail + [None]
        if isinstance(ev, Failed):
            self.result.error_code = ev.code
            raise ApiError(ev.status, ev.message, code=ev.code)
        return []

    def _logprob_entry(self, ev: Token) -> dict:
        text = self.token_text((ev.token_id,)) if self.token_text else str(ev.token_id)
        return {"token": text, "logprob": ev.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": self.token_text((t,)) if self.token_text else str(t), "logprob": lp,
                                  "bytes": list((self.token_text((t,)) if self.token_text else str(t)).encode())}
                                 for t, lp in ev.top_logprobs]}

    def _finish_reason(self) -> str:
        reason = finish_reason_for(self._runtime_reason, self.asm)
        self.result.finish_reason = reason
        return reason

    def timing(self) -> dict[str, float]:
        end = time.perf_counter()
        ttft = (self._first_token_at - self.started) if self._first_token_at else None
        self.result.ttft_s = ttft
        f = self._finished
        new_tokens = max(0, self.result.prompt_tokens - self.result.cached_tokens)
        if f is not None:
            prefill_tps, decode_tps = f.prefill_tokens_per_sec, f.decode_tokens_per_sec
        else:
            p0 = self._prefill_started or self.started
            prefill_s = (self._first_token_at - p0) if self._first_token_at else 0.0
            prefill_tps = new_tokens / prefill_s if prefill_s > 0 else 0.0
            decode_s = end - self._first_token_at if self._first_token_at else 0.0
            decode_tps = (self.result.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0
        self.result.decode_tps = decode_tps
        return {"time_to_first_token_ms": round(ttft * 1000, 3) if ttft is not None else None,
                "queue_ms": round(((self._prefill_started or end) - self.started) * 1000, 3),
                "prefill_tokens": new_tokens,
                "prefill_tokens_per_sec": round(prefill_tps, 3) if math.isfinite(prefill_tps) else 0.0,
                "decode_tokens_per_sec": round(decode_tps, 3) if math.isfinite(decode_tps) else 0.0,
                "total_ms": round((end - self.started) * 1000, 3)}

    def usage(self) -> dict:
        r = self.result
        return usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens)

    # ---- non-streamed ----------------------------------------------------------------------

    async def collect(self) -> dict[str, Any]:
        try:
            async for ev in self.events:
                out = self._on_event(ev)
                if out and out[-1] is None:
                    break
            else:
                raise ApiError(503, "the runtime ended the request without an answer", code="engine_unhealthy")
        except trio.ClosedResourceError:
            pass  # we closed it ourselves after a stop string
        finally:
            self.events.close()
        reason = self._finish_reason()
        return completion(self.cid, self.model_id, self.created, self.asm.message(reason), reason, self.usage(),
                          self.timing(), self.logprobs if self.want_logprobs else None)

    # ---- streamed ----------------------------------------------------------------------------

    def _chunk(self, delta: dict, finish_reason: str | None = None, **extra) -> bytes:
        return sse_frame(chunk(self.cid, self.model_id, self.created, delta, finish_reason, **extra))

    async def sse(self) -> AsyncIterator[bytes]:
        """``data:`` frames: role, deltas, final chunk (+usage), ``[DONE]``; errors as one error frame."""
        ended = False
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            while not ended:
                ev = None
                got = False
                with trio.move_on_after(self.keepalive_s):
                    try:
                        ev = await self.events.receive()
                    except trio.EndOfChannel:
                        ev = Failed(503, "engine_unhealthy", "the runtime ended the request without an answer")
                    got = True
                if not got:
                    yield KEEPALIVE
                    continue
                try:
                    out = self._on_event(ev)
                except ApiError as e:
                    yield sse_frame(error_body(e.status, e.message, code=e.code))
                    yield DONE
                    ended = True
                    break
                frames = []
                for d in out or ():
                    if d is None:
                        ended = True
                        continue
                    dj = delta_json(d)
                    if dj is not None:
                        frames.append(self._chunk(dj, **({"usage": None} if self.include_usage else {})))
                if frames:
                    yield b"".join(frames)
                if ended:
                    reason = self._finish_reason()
                    timing = self.timing()
                    final = self._chunk({}, reason, x_hf2q_timing=timing,
                                        **({"usage": None} if self.include_usage else {}))
                    tail = [final]
                    if self.include_usage:
                        tail.append(sse_frame({"id": self.cid, "object": "chat.completion.chunk",
                                               "created": self.created, "model": self.model_id, "choices": [],
                                               "usage": self.usage(), "x_hf2q_timing": timing}))
                    tail.append(DONE)
                    yield b"".join(tail)
        finally:
            if not ended and self.result.cancelled is None and self.result.error_code is None:
                self.result.cancelled = "client"
            self.events.close()
