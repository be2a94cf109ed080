"""Bounded argument schemas: finite, and never looser than the tool's own schema.

Every instance the bounded schema accepts must validate against the original (checked with
``jsonschema`` on hand-picked values at and past each bound), and the bounds must appear
where the original has none.
"""

from __future__ import annotations

import pytest

from hf2q.text.bounded_schema import (
    MIN_STRING,
    NUMBER_LIMIT,
    bounded,
    max_items_for,
    string_budget,
    with_layout,
)

jsonschema = pytest.importorskip("jsonschema")

PARAMS = {"type": "object", "properties": {
    "city": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "count": {"type": "integer"},
    "ratio": {"type": "number"},
    "anything": {"description": "no declared shape"},
    "nested": {"type": "object", "properties": {"zip": {"type": "string", "maxLength": 5}}},
    "mode": {"enum": ["a", "b"]},
    "free_map": {"type": "object", "additionalProperties": {"type": "integer"}},
}, "required": ["city"]}


def _ok(instance, schema) -> bool:
    try:
        jsonschema.validate(instance, schema)
        return True
    except jsonschema.ValidationError:
        return False


def test_every_value_gets_a_bound_and_the_schema_is_not_changed_in_place():
    before = repr(PARAMS)
    b = bounded(PARAMS, 256)
    assert repr(PARAMS) == before
    p = b["properties"]
    assert b["additionalProperties"] is False and p["nested"]["additionalProperties"] is False
    assert p["nested"]["properties"]["zip"]["maxLength"] == 5  # the schema's own bound stays
    assert p["tags"]["maxItems"] == max_items_for(256)
    # city, anything, and each of the tags share the budget
    assert p["city"]["maxLength"] == p["tags"]["items"]["maxLength"] == max(
        MIN_STRING, string_budget(256) // (2 + max_items_for(256)))
    assert p["count"]["maximum"] == NUMBER_LIMIT and p["count"]["minimum"] == -NUMBER_LIMIT
    assert "multipleOf" not in p["count"] and p["ratio"]["multipleOf"] > 0
    assert "string" in p["anything"]["type"] and "object" not in p["anything"]["type"]
    assert p["mode"] == {"enum": ["a", "b"]}
    assert p["free_map"]["maxProperties"] == max_items_for(256)


def test_what_the_bounded_schema_accepts_the_tool_schema_accepts():
    b = bounded(PARAMS, 256)
    n = b["properties"]["city"]["maxLength"]
    samples = [
        {"city": "x" * n}, {"city": "x" * (n + 1)}, {"city": "P", "extra": 1},
        {"city": "P", "count": NUMBER_LIMIT}, {"city": "P", "count": NUMBER_LIMIT + 1},
        {"city": "P", "ratio": 0.125}, {"city": "P", "ratio": 1e-9},
        {"city": "P", "tags": ["a"] * max_items_for(256)}, {"city": "P", "tags": ["a"] * (max_items_for(256) + 1)},
        {"city": "P", "anything": "s"}, {"city": "P", "anything": [1]}, {"city": "P", "nested": {"zip": "1", "x": 2}},
        {"city": "P", "free_map": {"a": 1}},
    ]
    accepted = [s for s in samples if _ok(s, b)]
    assert all(_ok(s, PARAMS) for s in accepted)
    assert len(accepted) == 6  # the limit values themselves, never the ones past them
    assert not _ok({"city": "x" * (n + 1)}, b) and not _ok({"city": "P", "extra": 1}, b)


def test_a_schema_that_says_otherwise_keeps_its_choice():
    open_obj = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
                "additionalProperties": True}
    assert bounded(open_obj, 256)["additionalProperties"] is True
    own = {"type": "object", "properties": {"n": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5},
                                            "s": {"type": "string", "minLength": 200}}}
    p = bounded(own, 64)["properties"]
    assert "minimum" not in p["n"] and p["n"]["multipleOf"] == 0.5
    assert p["s"]["maxLength"] == 200  # never below the schema's minLength


def test_no_parameters_means_no_arguments_and_the_layout_is_compact():
    assert bounded(None, 256) == {"type": "object", "additionalProperties": False}
    body = with_layout({"type": "object"})
    assert body["x-guidance"]["whitespace_flexible"] is False
    assert body["x-guidance"]["item_separator"] == ", " and body["x-guidance"]["key_separator"] == ": "


def test_local_refs_are_written_out_and_recursive_ones_refused():
    from hf2q.errors import InputError

    params = {"type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                    "required": ["x"]}},
              "properties": {"a": {"$ref": "#/$defs/point", "description": "start"},
                             "b": {"$ref": "#/definitions/name"}},
              "definitions": {"name": {"type": "string"}}, "required": ["a"]}
    b = bounded(params, 256)
    assert "$defs" not in b and "definitions" not in b
    a = b["properties"]["a"]
    assert a["properties"]["x"]["maximum"] == NUMBER_LIMIT and a["additionalProperties"] is False
    assert a["description"] == "start" and b["properties"]["b"]["type"] == "string"
    assert _ok({"a": {"x": 1}, "b": "n"}, b) and _ok({"a": {"x": 1}, "b": "n"}, params)
    node = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
    tree = {"type": "object", "$defs": {"node": node}, "properties": {"root": {"$ref": "#/$defs/node"}}}
    with pytest.raises(InputError, match="recursive"):
        bounded(tree, 256)
    with pytest.raises(InputError, match="does not resolve"):
        bounded({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, 256)
