"""Readers for the body of one tool-call block, per family syntax.

Each reader takes the text between a call's opening and closing markers and returns
``[(name, arguments), ...]`` with arguments as Python values, or raises
:class:`BadCall` (the streaming parser then gives the text back as content). Parameter
values written as bare text (Qwen3.5's XML form) are typed by the tool's JSON schema:
declared strings stay verbatim, anything else is read as JSON when it parses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any


class BadCall(ValueError):
    """The block is not a well-formed call in this syntax."""


def schema_types(tools: Sequence[Mapping] | None) -> dict[str, dict[str, Any]]:
    """``{function name: {parameter: JSON-schema type}}`` from an OpenAI ``tools`` list."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        if isinstance(props, Mapping):
            out[str(fn.get("name"))] = {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, Mapping)}
    return out


def json_call(body: str) -> list[tuple[str, Any]]:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise BadCall(str(exc)) from None
    objs = obj if isinstance(obj, list) else [obj]
    calls = []
    for o in objs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise BadCall("a call needs a name")
        args = o.get("arguments", o.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise BadCall("arguments are not JSON") from None
        calls.append((o["name"], args))
    return calls


def verbatim(declared: Any) -> bool:
    """Whether a parameter of this declared JSON-schema type is written as bare text and kept so."""
    types = declared if isinstance(declared, list) else [declared]
    return "string" in types or declared is None


#: Python's spellings of the JSON literals: Qwen3.5's template writes a past call's non-string
#: values with Jinja's ``|string`` (``True``, ``None``), so its model writes them so too
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def typed_value(value: str, declared: Any) -> Any:
    """A textual parameter value typed by the tool's schema (strings stay verbatim)."""
    if verbatim(declared):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return _PYTHON_LITERALS.get(value.strip(), value)


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def qwen_xml_call(body: str, types: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    calls = []
    for fm in _XML_FUNCTION.finditer(body):
        name = fm.group(1).strip()
        declared = types.get(name, {})
        args = {}
        for pm in _XML_PARAM.finditer(fm.group(2)):
            value = pm.group(2)
            value = value.removeprefix("\n")
            value = value.removesuffix("\n")
            args[pm.group(1).strip()] = typed_value(value, declared.get(pm.group(1).strip()))
        calls.append((name, args))
    if not calls:
        raise BadCall("no <function=…> element")
    return calls


DSML = "｜DSML｜"
DSML_INVOKE = re.compile(r"<" + DSML + r'invoke name="([^"]*)">(.*?)</' + DSML + r"invoke>", re.DOTALL)
DSML_PARAM = re.compile(r"<" + DSML + r'parameter name="([^"]*)" string="(true|false)">(.*?)</' + DSML + r"parameter>", re.DOTALL)


def deepseek_call(body: str) -> list[tuple[str, Any]]:
    calls = []
    for im in DSML_INVOKE.finditer(body):
        args = {}
        for pm in DSML_PARAM.finditer(im.group(2)):
            raw = pm.group(3)
            if pm.group(2) == "true":
                args[pm.group(1)] = raw
            else:
                try:
                    args[pm.group(1)] = json.loads(raw)
                except ValueError:
                    raise BadCall(f"parameter {pm.group(1)} is not JSON") from None
        calls.append((im.group(1), args))
    if not calls:
        raise BadCall("no invoke element")
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
                raise BadCall("unterminated string")
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
                    raise BadCall("expected , or ]")
            self.i += 1
            return items
        m = re.compile(r"[^,}\]]*").match(s, self.i)
        self.i = m.end()
        return gemma_bare_value(m.group(0))

    def mapping(self) -> dict:
        s = self.s
        if not s.startswith("{", self.i):
            raise BadCall("expected {")
        self.i += 1
        out = {}
        while not s.startswith("}", self.i):
            if self.i >= len(s):
                raise BadCall("unterminated object")
            if s.startswith(self.QUOTE, self.i):
                key = self.value()
            else:
                colon = s.find(":", self.i)
                if colon == -1:
                    raise BadCall("expected key:")
                key = s[self.i : colon].strip()
                self.i = colon
            if not s.startswith(":", self.i):
                raise BadCall("expected :")
            self.i += 1
            out[key] = self.value()
            if s.startswith(",", self.i):
                self.i += 1
        self.i += 1
        return out


def gemma_bare_value(token: str) -> Any:
    """An unquoted Gemma 4 value: a literal, a JSON number, or else the text itself."""
    token = token.strip()
    if token in ("true", "false"):
        return token == "true"
    if token in ("null", "none", "None"):
        return None
    try:
        return json.loads(token)
    except ValueError:
        return token


def gemma4_call(body: str) -> list[tuple[str, Any]]:
    m = re.match(r"\s*call:([^{\s]+)", body)
    if not m:
        raise BadCall("expected call:NAME{…}")
    reader = _GemmaArgs(body)
    reader.i = m.end()
    args = reader.mapping()
    if body[reader.i :].strip():
        raise BadCall("text after the arguments")
    return [(m.group(1), args)]
