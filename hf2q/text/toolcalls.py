"""Find tool calls in streamed model output, per the model family's own call syntax.

Each family writes calls differently (the format its chat template teaches):

* ``qwen``     — ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (Qwen3, Hermes);
* ``qwen_xml`` — ``<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>``
  (Qwen3.5, Qwen3-Coder);
* ``llama3``   — the whole reply is ``{"name": …, "parameters": {…}}`` (optionally after
  ``<|python_tag|>``);
* ``gemma4``   — ``<|tool_call>call:NAME{key:value,…}<tool_call|>`` with strings quoted as
  ``<|"|>…<|"|>``;
* ``deepseek`` — DeepSeek-V4's DSML block of ``invoke`` / ``parameter`` elements;
* ``generic``  — for templates with no tool syntax (SmolLM2's ChatML): we describe the
  tools in the system prompt (:func:`generic_tool_instructions`) and ask for the
  ``qwen`` form, which small models imitate well.

A parser is fed decoded text and returns events: :class:`ContentDelta` for plain text
(text that might begin a call marker is held back), and per call a :class:`ToolCallStart`
(fresh ``call_…`` id, name) as soon as the name is read, :class:`ToolCallArgsDelta` pieces
of the arguments' JSON text while the model writes them (their concatenation is the final
arguments; :mod:`hf2q.text.call_streams` reads each syntax piece by piece), and a
:class:`ToolCallEnd` when the call's block closes. JSON arguments pass through as the model
wrote them; markup values are built into JSON with ``ensure_ascii=False``, so every
character of every value survives byte for byte and the client always gets valid JSON.

At the close the block is read again whole (:mod:`hf2q.text.call_formats`), and that reading
decides: streamed calls it disagrees with are withdrawn (:class:`ToolCallMalformed`) and its
own calls go out whole, or, when it finds no call, the block's text is given back as
content. A call the stream ends inside never completes: ``finish`` returns
:class:`ToolCallIncomplete` and sets ``truncated`` so the API can answer
``finish_reason: "length"``. :func:`collect` keeps complete calls only.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence

import attrs

from hf2q.text.call_formats import (
    DSML,
    BadCall,
    deepseek_call,
    gemma4_call,
    json_call,
    qwen_xml_call,
    schema_types,
)
from hf2q.text.call_streams import gemma4_stream, json_stream, tag_stream
from hf2q.text.generic_tools import (
    generic_tool_instructions,
    messages_for_generic_template,
)
from hf2q.text.markers import MarkerMatcher

__all__ = [
    "SYNTAXES",
    "ContentDelta",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallIncomplete",
    "ToolCallMalformed",
    "ToolCallParser",
    "ToolCallStart",
    "collect",
    "detect_syntax",
    "generic_tool_instructions",
    "make_parser",
    "messages_for_generic_template",
    "new_call_id",
    "parse_complete",
    "reasoning_exits",
]

SYNTAXES = ("qwen", "qwen_xml", "llama3", "gemma4", "deepseek", "generic")

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@attrs.frozen
class ContentDelta:
    text: str


@attrs.frozen
class ToolCallStart:
    index: int
    id: str
    name: str


@attrs.frozen
class ToolCallArgsDelta:
    index: int
    text: str


@attrs.frozen
class ToolCallEnd:
    """The call at ``index`` is complete: its block closed and it reads as a call."""

    index: int


@attrs.frozen
class ToolCallIncomplete:
    """The stream ended inside the call at ``index`` (its start and part of its arguments
    may have gone out); it never completes."""

    index: int


@attrs.frozen
class ToolCallMalformed:
    """The call at ``index``, started, turned out not to be a well-formed call; it never
    completes, and what follows (content, or the block's calls read whole) replaces it."""

    index: int


def detect_syntax(template_source: str | None) -> str:
    """Which call syntax a chat template teaches its model."""
    src = template_source or ""
    if "DSML" in src:
        return "deepseek"
    if "<|tool_call>" in src:
        return "gemma4"
    if "<tool_call>" in src and "<function=" in src:
        return "qwen_xml"
    if "<tool_call>" in src:
        return "qwen"
    if "<|python_tag|>" in src or ('"parameters": ' in src and "<|eot_id|>" in src):
        return "llama3"
    return "generic"


def reasoning_exits(syntax: str) -> tuple[str, ...]:
    """Markers that end a reasoning block besides its closing one: DeepSeek-V4 may open its DSML
    block straight from its thoughts, with no ``</think>`` (llama.cpp's parser takes that too)."""
    return ("<" + DSML + "tool_calls>",) if syntax == "deepseek" else ()


# ---------------------------------------------------------------------------- streaming

@attrs.define
class _Streamed:
    """A call of the open block whose start went out: its index, name and arguments so far."""

    index: int
    name: str
    arguments: list[str] = attrs.field(factory=list)

    def agrees_with(self, name: str, args) -> bool:
        try:
            streamed = json.loads("".join(self.arguments))
        except ValueError:
            return False
        return name == self.name and _canonical(streamed) == _canonical(args)


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


class ToolCallParser:
    """Streaming parser for one completion (see module docstring)."""

    def __init__(self, syntax: str, tools: Sequence[Mapping] | None = None):
        if syntax not in SYNTAXES:
            raise ValueError(f"unknown tool-call syntax {syntax!r}")
        self.syntax = syntax
        self._types = schema_types(tools)
        self.start, self.end = {
            "qwen": ("<tool_call>", "</tool_call>"),
            "generic": ("<tool_call>", "</tool_call>"),
            "qwen_xml": ("<tool_call>", "</tool_call>"),
            "gemma4": ("<|tool_call>", "<tool_call|>"),
            "deepseek": ("<" + DSML + "tool_calls>", "</" + DSML + "tool_calls>"),
            "llama3": (None, None),
        }[syntax]
        self._buf = ""
        # a marker cut at a chunk end is held back by its matcher, not re-searched in _buf
        self._opening = MarkerMatcher([self.start] if self.start else [])
        self._closing = MarkerMatcher([self.end] if self.end else [])
        self._body: list[str] = []  # the open call's text so far
        self._stream = None  # the open block's call-stream reader
        self._streamed: list[_Streamed] = []  # the open block's calls whose start went out
        self._inside = False
        self._held_ws = ""
        self._ws_before_call = ""
        self._n_calls = 0  # indexes given out
        self._n_done = 0  # calls complete
        self._undecided = syntax == "llama3"  # llama3: a reply that opens with "{" may be a call
        self._whole = False
        self.truncated = False

    @property
    def calls(self) -> int:
        return self._n_done

    def _new_stream(self):
        if self.syntax in ("qwen", "generic", "llama3"):
            return json_stream(several=self.syntax == "llama3")
        if self.syntax == "gemma4":
            return gemma4_stream()
        return tag_stream(self.syntax, self._types)

    def _stream_body(self, text: str, events) -> None:
        """Pass what the block's reader learnt from ``text`` on as start / arguments events."""
        if not text:
            return
        self._body.append(text)
        for kind, k, value in self._stream.feed(text):
            if kind == "start":
                call = _Streamed(self._n_calls, value)
                self._n_calls += 1
                self._streamed.append(call)
                events.append(ToolCallStart(call.index, new_call_id(), value))
            else:
                call = self._streamed[k]
                call.arguments.append(value)
                events.append(ToolCallArgsDelta(call.index, value))

    def _close_block(self, calls, events) -> bool:
        """The block is whole: keep the streamed calls if the whole-block reader agrees.

        ``calls`` is that reader's answer (None: not a call). Otherwise the streamed calls are
        withdrawn (:class:`ToolCallMalformed`) and the reader's calls, if any, go out whole, so
        the final result is the whole-block reader's. False: no call, the text is content.
        """
        streamed, self._streamed, self._stream = self._streamed, [], None
        if calls is not None and len(calls) == len(streamed) and all(
                s.agrees_with(name, args) for s, (name, args) in zip(streamed, calls, strict=True)):
            for s in streamed:
                events.append(ToolCallEnd(s.index))
            self._n_done += len(streamed)
            return True
        events.extend(ToolCallMalformed(s.index) for s in streamed)
        if calls is None:
            return False
        self._emit_calls(calls, events)
        return True

    def _emit_calls(self, calls, events) -> None:
        for name, args in calls:
            idx = self._n_calls
            self._n_calls += 1
            self._n_done += 1
            events.append(ToolCallStart(idx, new_call_id(), name))
            events.append(ToolCallArgsDelta(idx, json.dumps(args, ensure_ascii=False)))
            events.append(ToolCallEnd(idx))

    def _parse_body(self, body: str):
        if self.syntax in ("qwen", "generic", "llama3"):
            return json_call(body.strip())
        if self.syntax == "qwen_xml":
            return qwen_xml_call(body, self._types)
        if self.syntax == "gemma4":
            return gemma4_call(body)
        return deepseek_call(body)

    def _content(self, text: str, events, final: bool = False) -> None:
        """Emit content, holding trailing whitespace (it is dropped if a call follows)."""
        text = self._held_ws + text
        body = text if final else text.rstrip()
        self._held_ws = text[len(body) :]
        if body:
            events.append(ContentDelta(body))

    def feed(self, text: str) -> list:
        events: list = []
        self._buf += text
        if self.syntax == "llama3":
            self._feed_llama3(events)
            return events
        while self._buf:
            if not self._inside:
                before, start, self._buf = self._opening.scan(self._buf)
                self._content(before, events)
                if start is None:
                    break
                self._ws_before_call, self._held_ws = self._held_ws, ""
                self._inside = True
                self._stream = self._new_stream()
            else:
                inside, end, self._buf = self._closing.scan(self._buf)
                self._stream_body(inside, events)
                if end is None:
                    break
                body = "".join(self._body)
                self._body = []
                self._inside = False
                try:
                    calls = self._parse_body(body)
                except BadCall:
                    calls = None
                if not self._close_block(calls, events):
                    self._content(self._ws_before_call + self.start + body + self.end, events)
        return events

    def _feed_llama3(self, events) -> None:
        if self._undecided:
            stripped = self._buf.lstrip()
            if not stripped or "<|python_tag|>".startswith(stripped):
                return
            self._undecided = False
            if stripped.startswith("<|python_tag|>"):
                self._whole = True
                self._buf = stripped[len("<|python_tag|>") :]
            elif stripped.startswith("{"):
                self._whole = True
                self._buf = stripped
            if self._whole:
                self._stream = self._new_stream()
        if self._whole:
            buf, self._buf = self._buf, ""
            self._stream_body(buf, events)
        elif self._buf:
            events.append(ContentDelta(self._buf))
            self._buf = ""

    def _finish_llama3(self, events) -> None:
        buf, self._buf = "".join(self._body) + self._buf, ""
        self._body = []
        if not self._whole:
            if buf:
                events.append(ContentDelta(buf))
            return
        try:
            # one call, or several separated by ";" / newlines
            parts = [p for p in re.split(r"\s*;\s*|\n+", buf.strip()) if p.strip()]
            calls = [c for p in parts for c in json_call(p)]
        except BadCall:
            calls = None
        if calls is None and re.match(r'\s*\{\s*"name"\s*:', buf):
            self._report_truncated(events)
        elif not self._close_block(calls, events):
            events.append(ContentDelta(buf))

    def _report_truncated(self, events) -> None:
        self.truncated = True
        started, self._streamed, self._stream = self._streamed, [], None
        events.extend(ToolCallIncomplete(s.index) for s in started or [_Streamed(self._n_calls, "")])

    def finish(self) -> list:
        """End of stream: flush held text; report a call the stream ended inside."""
        events: list = []
        if self.syntax == "llama3":
            self._finish_llama3(events)
            return events
        if self._inside:
            self._report_truncated(events)
            self._buf = ""
            return events
        rest, self._buf = self._buf + self._opening.scan("", final=True).text, ""
        if self._n_done and not (self._held_ws + rest).strip():
            self._held_ws = ""
            return events
        self._content(rest, events, final=True)
        return events


def make_parser(syntax: str, tools: Sequence[Mapping] | None = None) -> ToolCallParser:
    """A fresh streaming parser; ``tools`` lets XML syntaxes type their parameter values."""
    return ToolCallParser(syntax, tools)


def parse_complete(syntax: str, text: str, tools: Sequence[Mapping] | None = None):
    """Non-streaming: ``(content, [{"id", "type", "function": {"name", "arguments"}}], truncated)``."""
    p = make_parser(syntax, tools)
    events = p.feed(text) + p.finish()
    return collect(events) + (p.truncated,)


def collect(events) -> tuple[str, list[dict]]:
    """Fold events into OpenAI message parts: content text and the ``tool_calls`` list (complete calls only)."""
    content, calls, complete = [], {}, set()
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index]["function"]["arguments"] += e.text
        elif isinstance(e, ToolCallEnd):
            complete.add(e.index)
    return "".join(content), [calls[i] for i in sorted(complete)]


