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
from typing import Any

import attrs

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


# ---------------------------------------------------------------------------- body parsers

class _BadCall(ValueError):
    pass


def _schema_types(tools: Sequence[Mapping] | None) -> dict[str, dict[str, Any]]:
    """``{function name: {parameter: JSON-schema type}}`` from an OpenAI ``tools`` list."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        if isinstance(props, Mapping):
            out[str(fn.get("name"))] = {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, Mapping)}
    return out


def _json_call(body: str) -> list[tuple[str, Any]]:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise _BadCall(str(exc)) from None
    objs = obj if isinstance(obj, list) else [obj]
    calls = []
    for o in objs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise _BadCall("a call needs a name")
        args = o.get("arguments", o.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise _BadCall("arguments are not JSON") from None
        calls.append((o["name"], args))
    return calls


def _coerce(value: str, declared: Any) -> Any:
    """A textual parameter value typed by the tool's schema (strings stay verbatim)."""
    types = declared if isinstance(declared, list) else [declared]
    if "string" in types or declared is None:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _qwen_xml_call(body: str, types: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    calls = []
    for fm in _XML_FUNCTION.finditer(body):
        name = fm.group(1).strip()
        declared = types.get(name, {})
        args = {}
        for pm in _XML_PARAM.finditer(fm.group(2)):
            value = pm.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[pm.group(1).strip()] = _coerce(value, declared.get(pm.group(1).strip()))
        calls.append((name, args))
    if not calls:
        raise _BadCall("no <function=…> element")
    return calls


_DSML = "｜DSML｜"
_DSML_INVOKE = re.compile(r"<" + _DSML + r'invoke name="([^"]*)">(.*?)</' + _DSML + r"invoke>", re.S)
_DSML_PARAM = re.compile(r"<" + _DSML + r'parameter name="([^"]*)" string="(true|false)">(.*?)</' + _DSML + r"parameter>", re.S)


def _deepseek_call(body: str) -> list[tuple[str, Any]]:
    calls = []
    for im in _DSML_INVOKE.finditer(body):
        args = {}
        for pm in _DSML_PARAM.finditer(im.group(2)):
            raw = pm.group(3)
            if pm.group(2) == "true":
                args[pm.group(1)] = raw
            else:
                try:
                    args[pm.group(1)] = json.loads(raw)
                except ValueError:
                    raise _BadCall(f"parameter {pm.group(1)} is not JSON") from None
        calls.append((im.group(1), args))
    if not calls:
        raise _BadCall("no invoke element")
    return calls


class _GemmaArgs:
    """Recursive-descent reader of Gemma 4's argument notation."""

    QUOTE = '<|"|>'

    def __init__(self, text: str):
        self.s = text
        self.i = 0

    def value(self) -> Any:
        s = self.s
        if s.startswith(self.QUOTE, self.i):
            end = s.find(self.QUOTE, self.i + len(self.QUOTE))
            if end == -1:
                raise _BadCall("unterminated string")
            out = s[self.i + len(self.QUOTE) : end]
            self.i = end + len(self.QUOTE)
            return out
        if s.startswith("{", self.i):
            return self.mapping()
        if s.startswith("[", self.i):
            self.i += 1
            items = []
            while not s.startswith("]", self.i):
                items.append(self.value())
                if s.startswith(",", self.i):
                    self.i += 1
                elif not s.startswith("]", self.i):
                    raise _BadCall("expected , or ]")
            self.i += 1
            return items
        m = re.compile(r"[^,}\]]*").match(s, self.i)
        token = m.group(0).strip()
        self.i = m.end()
        if token in ("true", "false"):
            return token == "true"
        if token in ("null", "none", "None"):
            return None
        try:
            return json.loads(token)
        except ValueError:
            return token

    def mapping(self) -> dict:
        s = self.s
        if not s.startswith("{", self.i):
            raise _BadCall("expected {")
        self.i += 1
        out = {}
        while not s.startswith("}", self.i):
            if self.i >= len(s):
                raise _BadCall("unterminated object")
            if s.startswith(self.QUOTE, self.i):
                key = self.value()
            else:
                colon = s.find(":", self.i)
                if colon == -1:
                    raise _BadCall("expected key:")
                key = s[self.i : colon].strip()
                self.i = colon
            if not s.startswith(":", self.i):
                raise _BadCall("expected :")
            self.i += 1
            out[key] = self.value()
            if s.startswith(",", self.i):
                self.i += 1
        self.i += 1
        return out


def _gemma4_call(body: str) -> list[tuple[str, Any]]:
    m = re.match(r"\s*call:([^{\s]+)", body)
    if not m:
        raise _BadCall("expected call:NAME{…}")
    reader = _GemmaArgs(body)
    reader.i = m.end()
    args = reader.mapping()
    if body[reader.i :].strip():
        raise _BadCall("text after the arguments")
    return [(m.group(1), args)]


# ---------------------------------------------------------------------------- streaming

def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallParser:
    """Streaming parser for one completion (see module docstring)."""

    def __init__(self, syntax: str, tools: Sequence[Mapping] | None = None):
        if syntax not in SYNTAXES:
            raise ValueError(f"unknown tool-call syntax {syntax!r}")
        self.syntax = syntax
        self._types = _schema_types(tools)
        self.start, self.end = {
            "qwen": ("<tool_call>", "</tool_call>"),
            "generic": ("<tool_call>", "</tool_call>"),
            "qwen_xml": ("<tool_call>", "</tool_call>"),
            "gemma4": ("<|tool_call>", "<tool_call|>"),
            "deepseek": ("<" + _DSML + "tool_calls>", "</" + _DSML + "tool_calls>"),
            "llama3": (None, None),
        }[syntax]
        self._buf = ""
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
            return _json_call(body.strip())
        if self.syntax == "qwen_xml":
            return _qwen_xml_call(body, self._types)
        if self.syntax == "gemma4":
            return _gemma4_call(body)
        return _deepseek_call(body)

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
                i = self._buf.find(self.start)
                if i == -1:
                    keep = _partial_suffix(self._buf, self.start)
                    self._content(self._buf[: len(self._buf) - keep], events)
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._content(self._buf[:i], events)
                self._ws_before_call, self._held_ws = self._held_ws, ""
                self._buf = self._buf[i + len(self.start) :]
                self._inside = True
            else:
                j = self._buf.find(self.end)
                if j == -1:
                    break
                body = self._buf[:j]
                self._buf = self._buf[j + len(self.end) :]
                self._inside = False
                try:
                    self._emit_calls(self._parse_body(body), events)
                except _BadCall:
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
                    calls = [c for p in parts for c in _json_call(p)]
                    self._emit_calls(calls, events)
                except _BadCall:
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
        rest, self._buf = self._buf, ""
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


# ---------------------------------------------------------------------------- generic tools

def generic_tool_instructions(tools: Sequence[Mapping], tool_choice: Any = "auto") -> str:
    """System-prompt text teaching a template-less model our ``<tool_call>`` JSON format."""
    lines = [
        "You can call the following tools. Each tool is described by a JSON schema:",
        "",
    ]
    for tool in tools:
        fn = tool.get("function", tool)
        lines.append(json.dumps({"name": fn.get("name"), "description": fn.get("description", ""),
                                 "parameters": fn.get("parameters", {})}, ensure_ascii=False))
    lines += [
        "",
        "To call a tool, reply with exactly one line per call in this form and nothing else:",
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}</tool_call>',
        "When a tool result is given back to you, use it to answer the user.",
    ]
    if tool_choice == "required":
        lines.append("You must call at least one tool now.")
    elif isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        lines.append(f"You must call the tool {name!r} now.")
    else:
        lines.append("If no tool is needed, answer normally.")
    return "\n".join(lines)


def messages_for_generic_template(messages: Sequence[Mapping], tools: Sequence[Mapping] | None, tool_choice: Any = "auto") -> list[dict]:
    """Rewrite an OpenAI conversation for a template that knows nothing about tools.

    Tool instructions go into the system message; past assistant calls become the
    ``<tool_call>`` text the model would have written; tool results become user turns
    marked as such (ChatML-only templates render any role, but small models follow
    user/assistant turns best).
    """
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            parts = [m.get("content") or ""]
            for call in m["tool_calls"]:
                fn = call.get("function", {})
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                parts.append("<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "</tool_call>")
            m = {"role": "assistant", "content": "\n".join(p for p in parts if p)}
        elif role == "tool":
            content = m.get("content")
            if not isinstance(content, str):
                content = json.dumps(content, ensure_ascii=False)
            m = {"role": "user", "content": f"<tool_response>{content}</tool_response>"}
        elif m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tools:
        text = generic_tool_instructions(tools, tool_choice)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
