"""Pass a tool call's name and arguments on while the model is still writing the call.

A call-block reader of :mod:`hf2q.text.call_formats` needs the whole block; these readers
take the same text piece by piece (the streaming parser feeds them what lies between the
block's markers, marker hold-back already done) and say, as soon as they know it, that a
call with this name has begun and which text its arguments' JSON continues with:

* JSON syntaxes (``{"name": …, "arguments": {…}}``, also as a list, or Llama 3's
  ``;``-separated replies) pass the model's own argument text through, character for
  character, as :class:`~hf2q.text.json_scan.JsonScanner` accepts it;
* markup syntaxes (Qwen3.5's ``<parameter=…>``, DeepSeek's DSML, Gemma 4's ``k:v``) build the
  JSON as they read: ``{"k": "`` at a parameter's start, each piece of a string value
  escaped as it comes, a value of another declared type once it is whole.

A reader is an optimist, not the judge: when the block closes, the streaming parser reads
it again with the whole-block reader and keeps what was streamed only when both agree
(:mod:`hf2q.text.toolcalls`). So a reader may stop (``broken``) at anything unusual.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from hf2q.text.call_formats import DSML, gemma_bare_value, typed_value, verbatim
from hf2q.text.json_scan import JsonScanner
from hf2q.text.markers import MarkerMatcher

__all__ = ["CallStream", "gemma4_stream", "json_stream", "tag_stream"]

Event = tuple  # ("start", k, name) | ("args", k, text): k counts the block's calls from 0


def _escaped(text: str) -> str:
    """``text`` as the inside of a JSON string (escaping is per character, so pieces concatenate)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class CallStream:
    """Base of the readers: collects the events of one ``feed``."""

    def __init__(self) -> None:
        self.broken = False
        self._n = 0  # calls started
        self._out: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        if not self.broken:
            self._read(text)
        out, self._out = self._out, []
        return out

    def _read(self, text: str) -> None:
        raise NotImplementedError

    def _start(self, name: str) -> None:
        self._out.append(("start", self._n, name))
        self._n += 1

    def _args(self, text: str) -> None:
        """More of the current call's arguments (one event per ``feed``, not one per piece)."""
        if not text:
            return
        out = self._out
        if out and out[-1][0] == "args" and out[-1][1] == self._n - 1:
            out[-1] = ("args", self._n - 1, out[-1][2] + text)
        else:
            out.append(("args", self._n - 1, text))


# ---------------------------------------------------------------------------- JSON


class _JsonCalls(CallStream):
    """``{"name": …, "arguments": {…}}``, a list of them, or (``several``) Llama 3's ``a; b``."""

    def __init__(self, several: bool) -> None:
        super().__init__()
        self._several = several
        self._scan = JsonScanner()
        self._text: list[str] = []  # the current document, for values read whole
        self._call_depth: int | None = None
        self._new_call()

    def _new_call(self) -> None:
        self._name: str | None = None
        self._key: str | None = None
        self._value_at = 0
        self._streaming = False
        self._args_text: str | None = None  # arguments read whole, waiting for the name
        self._has_args = False

    def _read(self, text: str) -> None:
        for ch in text:
            if self._scan.done and self._several and not ch.isspace():
                if ch == ";":
                    continue
                self._scan, self._text, self._call_depth = JsonScanner(), [], None
            self._text.append(ch)
            events = self._scan.push(ch)
            if self._scan.error:
                self.broken = True
                return
            for ev in events:
                if ev.kind == "start":
                    self._on_start(ev)
                if self.broken:
                    return
            if self._streaming:
                self._args(ch)
            for ev in events:
                if ev.kind == "key" and ev.depth == self._member_depth:
                    self._key = ev.text
                elif ev.kind == "end":
                    self._on_end(ev)
                if self.broken:
                    return

    @property
    def _member_depth(self) -> int:
        return -1 if self._call_depth is None else self._call_depth + 1

    def _on_start(self, ev) -> None:
        if self._call_depth is None:  # the document's top-level value
            if ev.text == "[":
                self._call_depth = 1
            elif ev.text == "{":
                self._call_depth = 0
            else:
                self.broken = True
            return
        if ev.depth == self._call_depth and ev.text != "{":
            self.broken = True  # a list element that is no call object
        elif ev.depth == self._member_depth:
            self._value_at = ev.pos
            if self._key in ("arguments", "parameters") and not self._has_args:
                self._has_args = True
                self._streaming = self._name is not None and ev.text == "{"

    def _on_end(self, ev) -> None:
        if ev.depth == self._member_depth:
            raw = "".join(self._text[self._value_at:ev.pos])
            if self._streaming:
                self._streaming = False
            elif self._key == "name" and self._name is None:
                name = json.loads(raw)
                if not isinstance(name, str):
                    self.broken = True
                    return
                self._name = name
                self._start(name)
                if self._args_text is not None:
                    self._args(self._args_text)
            elif self._key in ("arguments", "parameters") and self._args_text is None:
                self._args_text = self._whole_arguments(raw)
                if self._args_text is None:
                    self.broken = True
                elif self._name is not None:
                    self._args(self._args_text)
        elif ev.depth == self._call_depth:
            if self._name is None:
                self.broken = True
                return
            if not self._has_args:
                self._args("{}")  # a call with no arguments
            self._new_call()

    @staticmethod
    def _whole_arguments(raw: str) -> str | None:
        """Arguments that could not stream (written before the name, or as a string of JSON)."""
        value = json.loads(raw)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return None
        return json.dumps(value, ensure_ascii=False)


def json_stream(several: bool = False) -> CallStream:
    return _JsonCalls(several)


# ---------------------------------------------------------------------------- tagged markup


@attrs.frozen
class TagSyntax:
    """Where a markup syntax puts a call's name, its parameters and their values."""

    invoke: str  # opens a call; its name follows
    invoke_end: str  # ends the name
    param: str  # opens a parameter; its header follows
    param_end: str  # ends the header
    param_close: str
    invoke_close: str
    header: re.Pattern  # the header: (key, "string" flag or None)
    trim_newlines: bool  # one newline after the header and before the close is layout


QWEN_XML = TagSyntax("<function=", ">", "<parameter=", ">", "</parameter>", "</function>",
                     re.compile(r"([^>\n]+)()"), True)
DEEPSEEK = TagSyntax("<" + DSML + 'invoke name="', '">', "<" + DSML + 'parameter name="', '">',
                     "</" + DSML + "parameter>", "</" + DSML + "invoke>",
                     re.compile(r'([^"]*)" string="(true|false)'), False)


class _TagCalls(CallStream):
    def __init__(self, syntax: TagSyntax, types: Mapping[str, Mapping[str, Any]]) -> None:
        super().__init__()
        self._syn = syntax
        self._types = types
        self._find_invoke = MarkerMatcher([syntax.invoke])
        self._find_part = MarkerMatcher([syntax.param, syntax.invoke_close])
        self._find_close = MarkerMatcher([syntax.param_close])
        self._state = "outside"
        self._header = ""
        self._declared: Mapping[str, Any] = {}
        self._first = True

    def _read(self, text: str) -> None:
        syn = self._syn
        while text and not self.broken:
            if self._state == "outside":
                _, marker, text = self._find_invoke.scan(text)
                if marker is None:
                    return
                self._state, self._header = "name", ""
            elif self._state in ("name", "header"):
                end_marker = syn.invoke_end if self._state == "name" else syn.param_end
                self._header += text
                cut = self._header.find(end_marker)
                if cut < 0:
                    return
                text = self._header[cut + len(end_marker):]
                self._header_done(self._header[:cut])
            elif self._state == "body":
                _, marker, text = self._find_part.scan(text)
                if marker is None:
                    return
                if marker == syn.param:
                    self._state, self._header = "header", ""
                else:
                    self._args("}")
                    self._state = "outside"
            else:  # "value"
                piece, marker, text = self._find_close.scan(text)
                self._value_piece(piece)
                if marker is None:
                    return
                self._value_end()
                self._state = "body"

    def _header_done(self, header: str) -> None:
        if self._state == "name":
            name = header.strip()
            self._start(name)
            self._args("{")
            self._declared = self._types.get(name, {})
            self._first, self._state = True, "body"
            return
        m = self._syn.header.fullmatch(header)
        if not m:
            self.broken = True
            return
        key = m.group(1).strip() if self._syn.trim_newlines else m.group(1)
        self._args(("" if self._first else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
        self._first = False
        flag = m.group(2)
        self._key_declared = self._declared.get(key)
        self._as_string = flag == "true" if flag else verbatim(self._key_declared)
        self._whole: list[str] = []
        self._began = not self._syn.trim_newlines  # a leading newline is still to be dropped
        self._held_newline = ""
        if self._as_string:
            self._args('"')
        self._state = "value"

    def _value_piece(self, piece: str) -> None:
        if not self._as_string:
            self._whole.append(piece)
            return
        if not self._began and piece:
            piece, self._began = piece.removeprefix("\n"), True
        if self._syn.trim_newlines:
            piece = self._held_newline + piece
            self._held_newline = "\n" if piece.endswith("\n") else ""
            piece = piece[: len(piece) - len(self._held_newline)]
        self._args(_escaped(piece))

    def _value_end(self) -> None:
        if self._as_string:
            self._args('"')
            return
        raw = "".join(self._whole)
        if self._syn.trim_newlines:
            value = typed_value(raw.removeprefix("\n").removesuffix("\n"), self._key_declared)
        else:
            try:
                value = json.loads(raw)
            except ValueError:
                self.broken = True
                return
        self._args(json.dumps(value, ensure_ascii=False))


def tag_stream(syntax: str, types: Mapping[str, Mapping[str, Any]]) -> CallStream:
    return _TagCalls(QWEN_XML if syntax == "qwen_xml" else DEEPSEEK, types)


# ---------------------------------------------------------------------------- Gemma 4

_QUOTE = '<|"|>'
_GEMMA_HEAD = re.compile(r"\s*call:([^{\s]+)")


class _GemmaCall(CallStream):
    """``call:NAME{key:value,…}`` with ``<|"|>``-quoted strings, nested ``{}`` and ``[]``."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # text not read yet (a bare token, a key, a cut quote marker)
        self._stack: list[str] = []  # "{" / "["
        self._first: list[bool] = []
        self._state = "head"
        self._find_quote = MarkerMatcher([_QUOTE])
        self._is_key = False

    def _read(self, text: str) -> None:
        self._pending += text
        while self._pending and not self.broken:
            if not self._step():
                return

    def _sep(self) -> None:
        if not self._first[-1]:
            self._args(", ")
        self._first[-1] = False

    def _open(self, bracket: str) -> None:
        self._args(bracket)
        self._stack.append(bracket)
        self._first.append(True)
        self._state = "key" if bracket == "{" else "item"

    def _close(self) -> None:
        self._args("}" if self._stack.pop() == "{" else "]")
        self._first.pop()
        self._state = "after" if self._stack else "tail"

    def _step(self) -> bool:
        """Read from ``_pending``; False when more text is needed."""
        s = self._pending
        st = self._state
        if st == "head":
            brace = s.find("{")
            if brace < 0:
                return False
            m = _GEMMA_HEAD.match(s)
            if not m or m.end() != brace:
                self.broken = True
                return False
            self._start(m.group(1))
            self._pending = s[brace + 1:]
            self._open("{")
            return True
        if st == "string":
            piece, marker, rest = self._find_quote.scan(s)
            self._pending = rest if marker else ""
            if self._is_key:
                self._key += piece
                if marker:
                    self._state = "colon"
            else:
                self._args(_escaped(piece))
                if marker:
                    self._args('"')
                    self._state = "after"
            return bool(marker)
        if st == "colon":
            if s[0] != ":":
                self.broken = True
                return False
            self._pending = s[1:]
            self._key_done()
            return True
        if st == "tail":
            if s.strip():
                self.broken = True
            self._pending = ""
            return False
        if st == "after":
            top = self._stack[-1]
            if s[0] == ",":
                self._pending = s[1:]
                self._state = "key" if top == "{" else "item"
            elif s[0] == ("}" if top == "{" else "]"):
                self._pending = s[1:]
                self._close()
            else:
                self.broken = True
            return True
        if st in ("key", "item") and s[0] == ("}" if st == "key" else "]"):
            self._pending = s[1:]
            self._close()
            return True
        if _QUOTE.startswith(s[:len(_QUOTE)]) and len(s) < len(_QUOTE):
            return False  # perhaps a quote marker, cut
        if st == "key":
            if s.startswith(_QUOTE):
                self._pending, self._key, self._is_key, self._state = s[len(_QUOTE):], "", True, "string"
                return True
            colon = s.find(":")
            if colon < 0:
                return False
            self._key, self._pending = s[:colon].strip(), s[colon + 1:]
            self._key_done()
            return True
        # a value: in a mapping after its key ("value"), or a list item ("item")
        if st == "item":
            self._sep()
        self._state = "value"
        if s.startswith(_QUOTE):
            self._pending, self._is_key, self._state = s[len(_QUOTE):], False, "string"
            self._args('"')
        elif s[0] in "{[":
            self._pending = s[1:]
            self._open(s[0])
        else:
            m = re.search(r"[,}\]]", s)
            if not m:
                self._state = "bare"
                return False
            self._pending = s[m.start():]
            self._args(json.dumps(gemma_bare_value(s[:m.start()]), ensure_ascii=False))
            self._state = "after"
        return True

    def _key_done(self) -> None:
        self._sep()
        self._args(json.dumps(self._key, ensure_ascii=False) + ": ")
        self._state = "value"


def gemma4_stream() -> CallStream:
    return _GemmaCall()
