"""OpenAI response shapes: output deltas, the message they assemble into, and the JSON built from them.

The chat pipeline turns generated tokens into ``OutputDelta`` records (content, reasoning,
tool-call start, tool-call arguments). The same deltas feed both answers: streamed one by
one as ``chat.completion.chunk`` objects, or folded by ``MessageAssembler`` into one
``chat.completion``. Keeping one source for both is what makes a streamed tool call
reassemble to exactly the non-streamed one.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import attrs


@attrs.frozen
class ContentDelta:
    text: str


@attrs.frozen
class ReasoningDelta:
    text: str


@attrs.frozen
class ToolCallStart:
    index: int
    call_id: str
    name: str


@attrs.frozen
class ToolCallArgs:
    index: int
    text: str


@attrs.frozen
class ToolCallEnd:
    """The call at ``index`` is syntactically complete (its arguments are a whole JSON value)."""

    index: int


OutputDelta = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArgs | ToolCallEnd


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def new_tool_call_id() -> str:
    """Fresh per response: clients key tool results by it."""
    return "call_" + secrets.token_hex(12)


@attrs.define
class _Call:
    call_id: str
    name: str
    arguments: list[str] = attrs.field(factory=list)
    complete: bool = False


@attrs.define
class MessageAssembler:
    """Folds deltas into the final assistant message."""

    content: list[str] = attrs.field(factory=list)
    reasoning: list[str] = attrs.field(factory=list)
    calls: dict[int, _Call] = attrs.field(factory=dict)

    def add(self, d: OutputDelta) -> None:
        if isinstance(d, ContentDelta):
            self.content.append(d.text)
        elif isinstance(d, ReasoningDelta):
            self.reasoning.append(d.text)
        elif isinstance(d, ToolCallStart):
            self.calls[d.index] = _Call(d.call_id, d.name)
        elif isinstance(d, ToolCallArgs):
            self.calls[d.index].arguments.append(d.text)
        elif isinstance(d, ToolCallEnd):
            self.calls[d.index].complete = True

    @property
    def has_open_call(self) -> bool:
        return any(not c.complete for c in self.calls.values())

    @property
    def complete_calls(self) -> list[dict]:
        return [{"id": c.call_id, "type": "function",
                 "function": {"name": c.name, "arguments": "".join(c.arguments)}}
                for _, c in sorted(self.calls.items()) if c.complete]

    def message(self, finish_reason: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        calls = self.complete_calls
        if calls:
            msg["tool_calls"] = calls
        elif msg["content"] is None:
            msg["content"] = ""
        return msg


def finish_reason_for(runtime_reason: str, asm: MessageAssembler) -> str:
    """``length`` wins over tool calls: a call cut by max_tokens is never reported as ``tool_calls``."""
    if runtime_reason == "length":
        return "length"
    if asm.complete_calls:
        return "tool_calls"
    return "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(cid: str, model: str, created: int, message: dict, finish_reason: str, usage_: dict,
               timing: dict, logprobs: list | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason}
    choice["logprobs"] = {"content": logprobs} if logprobs is not None else None
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage_, "x_hf2q_timing": timing}


def chunk(cid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
          **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
    obj.update(extra)
    return obj


def delta_json(d: OutputDelta) -> dict[str, Any] | None:
    """The ``delta`` object of one streamed chunk (None: nothing to send for this delta)."""
    if isinstance(d, ContentDelta):
        return {"content": d.text} if d.text else None
    if isinstance(d, ReasoningDelta):
        return {"reasoning_content": d.text} if d.text else None
    if isinstance(d, ToolCallStart):
        return {"tool_calls": [{"index": d.index, "id": d.call_id, "type": "function",
                                "function": {"name": d.name, "arguments": ""}}]}
    if isinstance(d, ToolCallArgs):
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]} if d.text else None
    return None


def now() -> int:
    return int(time.time())
