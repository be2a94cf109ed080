"""Follow strict JSON one character at a time, saying where values begin and end.

A tool call written as JSON (``{"name": …, "arguments": {…}}``) arrives a token at a time;
to pass its arguments on as they are written, the reader must know, at each character,
whether the text so far can still be valid JSON and which value that character belongs
to. :class:`JsonScanner` is that state machine (RFC 8259, no extensions): it reports each
value's start and end with the number of containers open around it, and each object key.
It never looks back at text already taken, so a chunk costs its length.
"""

from __future__ import annotations

import json
from typing import NamedTuple

__all__ = ["JsonEvent", "JsonScanner"]

_WS = " \t\n\r"
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_ESCAPES = set('"\\/bfnrtu')
_HEX = set("0123456789abcdefABCDEF")
# number states after which the number may end
_NUMBER_ENDS = {"zero", "int", "frac", "exp"}


class JsonEvent(NamedTuple):
    kind: str  # "start" | "end" | "key"
    depth: int  # containers open around the value (0: the top-level value)
    pos: int  # start: the value's first character; end: one past its last; key: where the key ended
    text: str = ""  # start: the first character; key: the decoded key


class JsonScanner:
    """Strict incremental JSON; ``push`` one character, read the events it completed.

    After an error (:attr:`error`) every further character is refused. After the top-level
    value (:attr:`done`) only whitespace is accepted.
    """

    def __init__(self) -> None:
        self.pos = 0
        self.error = False
        self.done = False
        self._stack: list[str] = []
        self._state = "value"
        self._key: list[str] | None = None  # the raw characters of the object key being read
        self._literal = ""
        self._hex = 0

    def push(self, ch: str) -> list[JsonEvent]:
        """The events ``ch`` completes (empty when it completes none); sets :attr:`error` on bad input."""
        if self.error:
            return []
        events: list[JsonEvent] = []
        if not self._step(ch, events):
            self.error = True
        self.pos += 1
        return events

    # the state machine: True when ch is accepted
    def _step(self, ch: str, events: list[JsonEvent]) -> bool:
        st = self._state
        if st == "string":
            if ch == '"':
                self._end_string(events)
            elif ch == "\\":
                self._state = "escape"
            elif ch < " ":
                return False
            if self._key is not None and ch != '"':
                self._key.append(ch)
            return True
        if st in ("escape", "hex"):  # after a backslash; the four digits of a \u escape
            if ch not in (_ESCAPES if st == "escape" else _HEX):
                return False
            if self._key is not None:
                self._key.append(ch)
            self._hex = (4 if ch == "u" else 0) if st == "escape" else self._hex - 1
            self._state = "hex" if self._hex else "string"
            return True
        if st == "literal":
            if ch != self._literal[0]:
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self._end_value(events, self.pos + 1)
            return True
        if st in ("minus", "zero", "int", "dot", "frac", "e", "esign", "exp"):
            nxt = self._number(st, ch)
            if nxt is not None:
                self._state = nxt
                return True
            if st not in _NUMBER_ENDS:
                return False
            self._end_value(events, self.pos)  # ch is the first character after the number
            return self._step(ch, events)
        if ch in _WS:
            return True
        if st == "after":
            if self.done or not self._stack:
                return False
            top = self._stack[-1]
            if ch == ",":
                self._state = "key" if top == "{" else "value"
                return True
            if ch == ("}" if top == "{" else "]"):
                self._stack.pop()
                self._end_value(events, self.pos + 1)
                return True
            return False
        if st == "colon":
            if ch != ":":
                return False
            self._state = "value"
            return True
        if st in ("key", "key_or_close"):
            if ch == "}" and st == "key_or_close":
                self._stack.pop()
                self._end_value(events, self.pos + 1)
                return True
            if ch != '"':
                return False
            self._state, self._key = "string", []
            return True
        if st == "value_or_close" and ch == "]":
            self._stack.pop()
            self._end_value(events, self.pos + 1)
            return True
        return self._start_value(ch, events)  # "value", "value_or_close"

    def _start_value(self, ch: str, events: list[JsonEvent]) -> bool:
        if self.done:
            return False
        depth = len(self._stack)
        if ch == "{":
            self._stack.append("{")
            self._state = "key_or_close"
        elif ch == "[":
            self._stack.append("[")
            self._state = "value_or_close"
        elif ch == '"':
            self._state = "string"
        elif ch == "-":
            self._state = "minus"
        elif ch.isascii() and ch.isdigit():
            self._state = "zero" if ch == "0" else "int"
        elif ch in _LITERALS:
            self._state, self._literal = "literal", _LITERALS[ch]
        else:
            return False
        events.append(JsonEvent("start", depth, self.pos, ch))
        return True

    @staticmethod
    def _number(st: str, ch: str) -> str | None:
        digit = ch.isascii() and ch.isdigit()
        if st == "minus":
            return ("zero" if ch == "0" else "int") if digit else None
        if st in ("zero", "int"):
            if digit:
                return "int" if st == "int" else None
            return "dot" if ch == "." else "e" if ch in "eE" else None
        if st in ("dot", "frac"):
            if digit:
                return "frac"
            return "e" if st == "frac" and ch in "eE" else None
        if st == "e":
            return "exp" if digit else "esign" if ch in "+-" else None
        return "exp" if digit else None  # "esign", "exp"

    def _end_string(self, events: list[JsonEvent]) -> None:
        if self._key is not None:
            key = json.loads('"' + "".join(self._key) + '"')
            self._key = None
            self._state = "colon"
            events.append(JsonEvent("key", len(self._stack), self.pos + 1, key))
        else:
            self._end_value(events, self.pos + 1)

    def _end_value(self, events: list[JsonEvent], end: int) -> None:
        events.append(JsonEvent("end", len(self._stack), end))
        self._state = "after"
        if not self._stack:
            self.done = True
