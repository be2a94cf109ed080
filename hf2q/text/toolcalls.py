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
(text that might begin a call marker is held back), then per call a
:class:`ToolCallStart` (fresh ``call_…`` id, name) and one :class:`ToolCallArgsDelta` with
the arguments as a JSON string. Arguments are parsed and re-serialised with
``ensure_ascii=False``, so every character of every value survives byte for byte and the
client always gets valid JSON. A call the stream ends inside is never emitted: ``finish``
returns :class:`ToolCallIncomplete` and sets ``truncated`` so the API can answer
``finish_reason: "length"``. A closed call that cannot be parsed is given back as content.
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
from hf2q.text.generic_tools import (
    generic_tool_instructions,
    messages_for_generic_template,
)
from hf2q.text.markers import MarkerMatcher

__all__ = [
    "SYNTAXES",
    "ContentDelta",
    "ToolCallArgsDelta",
    "ToolCallIncomplete",
    "ToolCallParser",
    "ToolCallStart",
    "collect",
    "detect_syntax",
    "generic_tool_instructions",
    "make_parser",
    "messages_for_generic_template",
    "new_call_id",
    "parse_complete",
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
class ToolCallIncomplete:
    """The stream ended inside a call; nothing of it was emitted."""

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


# ---------------------------------------------------------------------------- streaming

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
        self._inside = False
        self._held_ws = ""
        self._ws_before_call = ""
        self._n_calls = 0
        self._undecided = syntax == "llama3"  # llama3: a reply that opens with "{" may be a call
        self._whole = False
        self.truncated = False

    @property
    def calls(self) -> int:
        return self._n_calls

    def _emit_calls(self, calls, events) -> None:
        for name, args in calls:
            idx = self._n_calls
            self._n_calls += 1
            events.append(ToolCallStart(idx, new_call_id(), name))
            events.append(ToolCallArgsDelta(idx, json.dumps(args, ensure_ascii=False)))

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
            else:
                inside, end, self._buf = self._closing.scan(self._buf)
                self._body.append(inside)
                if end is None:
                    break
                body = "".join(self._body)
                self._body = []
                self._inside = False
                try:
                    self._emit_calls(self._parse_body(body), events)
                except BadCall:
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
        if not self._whole and self._buf:
            events.append(ContentDelta(self._buf))
            self._buf = ""

    def finish(self) -> list:
        """End of stream: flush held text; report a call the stream ended inside."""
        events: list = []
        if self.syntax == "llama3":
            buf, self._buf = self._buf, ""
            if self._whole:
                try:
                    # one call, or several separated by ";" / newlines
                    parts = [p for p in re.split(r"\s*;\s*|\n+", buf.strip()) if p.strip()]
                    calls = [c for p in parts for c in json_call(p)]
                    self._emit_calls(calls, events)
                except BadCall:
                    if re.match(r'\s*\{\s*"name"\s*:', buf):
                        self.truncated = True
                        events.append(ToolCallIncomplete(self._n_calls))
                    else:
                        events.append(ContentDelta(buf))
            elif buf:
                events.append(ContentDelta(buf))
            return events
        if self._inside:
            self.truncated = True
            events.append(ToolCallIncomplete(self._n_calls))
            self._buf = ""
            return events
        rest, self._buf = self._buf + self._opening.scan("", final=True).text, ""
        if self._n_calls and not (self._held_ws + rest).strip():
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
    """Fold events into OpenAI message parts: content text and the ``tool_calls`` list."""
    content, calls = [], {}
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index]["function"]["arguments"] += e.text
    return "".join(content), [calls[i] for i in sorted(calls)]


