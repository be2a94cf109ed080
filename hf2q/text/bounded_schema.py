"""Tool-argument schemas tightened so that a forced call can always finish.

A grammar that lets a value go on forever will, on a small model, sometimes go on forever:
an endless string, whitespace between every token, one invented property after another
(outlines issue 908 and ollama PR 3785 describe the same failure). :func:`bounded` returns a
copy of a tool's ``parameters`` that admits a *subset* of what the schema admits (so every
call it lets through still validates against the tool's own schema) and in which every
value is finite:

* objects take only the properties they declare unless the schema says otherwise
  (``additionalProperties`` / ``patternProperties`` given);
* strings, arrays and free maps get a length when the schema gives none, shared out of a
  budget derived from the request's ``max_tokens`` (a character of an ASCII string costs at
  most one token, and half of ``max_tokens`` is kept for names, keys and markup);
* numbers get a range and integers a digit count (a fixed precision for floats);
* values with no declared shape at all become scalars (no unbounded nesting);
* local ``$ref`` s (``#/$defs/…``) are written out in place, since the arguments are
  embedded in a call object where the schema's own pointers would no longer resolve.

``JSON_LAYOUT`` is llguidance's ``x-guidance`` layout for every JSON body: compact, with
the single spaces models write after ``,`` and ``:`` and no free whitespace runs (see
llguidance's docs/json_schema.md, "Whitespace handling").
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from hf2q.errors import InputError

#: llguidance JSON layout: ``{"a": 1, "b": [2, 3]}`` and nothing looser
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: the largest integer magnitude a bounded number may take (15 digits)
NUMBER_LIMIT = 10**15 - 1
#: the precision of a bounded float (six decimals)
NUMBER_STEP = 1e-6
#: shortest length a bounded string is given, however small the budget
MIN_STRING = 24
#: most items an array (or entries a free map) is given when the schema names no bound
MAX_ITEMS = 8
#: tokens of ``max_tokens`` per array item allowed (256 tokens: 4 items)
TOKENS_PER_ITEM = 64

_COMPOSITE = ("anyOf", "oneOf", "allOf", "$ref", "not")
_SHAPED = ("properties", "items", "prefixItems", "additionalProperties", "patternProperties",
           "enum", "const") + _COMPOSITE
_SCALARS = ["string", "number", "boolean", "null"]


def with_layout(schema: Mapping[str, Any] | bool) -> dict:
    """``schema`` with the compact layout as its top-level ``x-guidance`` (kept if it has one)."""
    body = dict(schema) if isinstance(schema, Mapping) else ({} if schema else {"not": {}})
    body.setdefault("x-guidance", dict(JSON_LAYOUT))
    return body


def string_budget(max_tokens: int | None) -> int:
    """Characters all of a call's unbounded strings may share, from the request's ``max_tokens``."""
    return max(MIN_STRING, (max_tokens or 4096) // 2)


def max_items_for(max_tokens: int | None) -> int:
    """Items an array with no ``maxItems`` may hold, from the request's ``max_tokens``."""
    return max(1, min(MAX_ITEMS, (max_tokens or 4096) // TOKENS_PER_ITEM))


def bounded(schema: Mapping[str, Any] | None, max_tokens: int | None, free: str | list[str] | None = None) -> dict:
    """A finite copy of a tool's ``parameters`` (see the module docstring).

    ``free`` is the type a value of no declared shape takes (default: any scalar); the markup
    call syntaxes pass ``"string"``, since they write such values verbatim.
    """
    out = copy.deepcopy(dict(schema)) if isinstance(schema, Mapping) else {"type": "object"}
    out = _inline_refs(out, out, ())
    for key in ("$defs", "definitions"):
        out.pop(key, None)
    if "type" not in out and not any(k in out for k in _SHAPED):
        out["type"] = "object"  # a tool's arguments are always an object
    items = max_items_for(max_tokens)
    slots = _string_slots(out, items, set())
    per_string = max(MIN_STRING, string_budget(max_tokens) // max(1, slots))
    _tighten(out, per_string, items, list(_SCALARS) if free is None else free)
    return out


#: how many ``$ref`` s deep a value may go before the schema counts as recursive
REF_DEPTH = 8


def _resolve(root: Mapping, ref: str) -> Any:
    node: Any = root
    for part in ref[1:].lstrip("/").split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            raise InputError(f"tool parameters: $ref {ref!r} does not resolve")
        node = node[part]
    return node


def _inline_refs(node: Any, root: Mapping, trail: tuple[str, ...]) -> Any:
    """``node`` with every local ``$ref`` replaced by (a copy of) what it points at."""
    if isinstance(node, list):
        return [_inline_refs(x, root, trail) for x in node]
    if not isinstance(node, Mapping):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        if len(trail) >= REF_DEPTH:
            raise InputError(f"tool parameters: $ref {ref!r} is recursive; forced calls need a finite schema")
        target = _resolve(root, ref)
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        merged = {**target, **siblings} if isinstance(target, Mapping) else target
        return _inline_refs(merged, root, trail + (ref,))
    return {k: (v if k in ("$defs", "definitions", "const", "enum", "default", "examples")
                else _inline_refs(v, root, trail)) for k, v in node.items()}


def _types(node: Mapping) -> set[str]:
    t = node.get("type")
    return set(t) if isinstance(t, list) else ({t} if isinstance(t, str) else set())


def _has_own_bound_keywords(node: Mapping) -> bool:
    return any(k in node for k in _COMPOSITE) or "enum" in node or "const" in node


def _item_bound(node: Mapping, items: int) -> int:
    return max(int(node.get("minItems", 0) or 0), items) if "maxItems" not in node else int(node["maxItems"])


def _string_slots(node: Any, items: int, seen: set[int]) -> int:
    """How many unbounded strings a value of ``node`` may hold at most (arrays count each item)."""
    if not isinstance(node, Mapping) or id(node) in seen:
        return 0
    seen = seen | {id(node)}
    if "enum" in node or "const" in node:
        return 0
    alternatives = [s for k in ("anyOf", "oneOf") for s in node.get(k) or ()]
    if alternatives:
        return max(_string_slots(s, items, seen) for s in alternatives)
    total = sum(_string_slots(s, items, seen) for s in node.get("allOf") or ())
    types = _types(node)
    free = not types and not any(k in node for k in _SHAPED)  # becomes a scalar, a string among them
    if "maxLength" not in node and not any(k in node for k in _COMPOSITE) and ("string" in types or free):
        total += 1
    for sub in (node.get("properties") or {}).values():
        total += _string_slots(sub, items, seen)
    each = node.get("items")
    if isinstance(each, Mapping):
        total += _item_bound(node, items) * _string_slots(each, items, seen)
    for sub in node.get("prefixItems") or ():
        total += _string_slots(sub, items, seen)
    extra = node.get("additionalProperties")
    if isinstance(extra, Mapping):
        total += int(node.get("maxProperties", items)) * (1 + _string_slots(extra, items, seen))
    return total


def _tighten(node: Any, per_string: int, items: int, free: str | list[str]) -> None:
    """Add the missing bounds to ``node`` and everything under it, in place."""
    if not isinstance(node, dict):
        return
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for sub in node.get(key) or ():
            _tighten(sub, per_string, items, free)
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        for sub in (node.get(key) or {}).values():
            _tighten(sub, per_string, items, free)
    for key in ("items", "additionalProperties"):
        _tighten(node.get(key), per_string, items, free)
    if _has_own_bound_keywords(node):
        return  # enum/const are finite; composites are bounded through their parts
    if "type" not in node and not any(k in node for k in _SHAPED):
        node["type"] = copy.copy(free)  # "any value": never unbounded nesting
    types = _types(node)
    if not types or "object" in types:
        if "additionalProperties" not in node and "patternProperties" not in node:
            node["additionalProperties"] = False
        elif "maxProperties" not in node and not node.get("properties"):
            node["maxProperties"] = max(int(node.get("minProperties", 0) or 0), items)
    if not types or "string" in types:
        node.setdefault("maxLength", max(int(node.get("minLength", 0) or 0), per_string))
    if not types or "array" in types:
        node.setdefault("maxItems", _item_bound(node, items))
    if not types or types & {"number", "integer"}:
        if "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = -NUMBER_LIMIT
        if "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = NUMBER_LIMIT
        if (not types or "number" in types) and "multipleOf" not in node:
            node["multipleOf"] = NUMBER_STEP
