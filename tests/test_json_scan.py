"""The incremental JSON scanner against Python's own strict reader.

Every prefix of a valid document is accepted, the whole is ``done``, and each value's
reported span is exactly the text ``json`` reads back as that value; text Python's reader
refuses (in strict mode, without its NaN/Infinity extension) is refused or left unfinished.
"""

from __future__ import annotations

import json
import random

import pytest

from hf2q.text.json_scan import JsonScanner


def _value(rng, depth=0):
    kinds = ["str", "int", "float", "lit"] + (["obj", "arr"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice('ab "\\/\n\t\u00e9\U0001f999\u2028{}[]:,') for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([0.5, -1e-7, 3.25e20, -0.0, 12.0])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "obj":
        return {f"k{i}\"\\\u00e9": _value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def _scan(text):
    s, events = JsonScanner(), []
    for ch in text:
        events += s.push(ch)
        if s.error:
            break
    return s, events


@pytest.mark.parametrize("seed", range(40))
def test_valid_documents_and_their_value_spans(seed):
    rng = random.Random(seed)
    value = _value(rng)
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]),
                      separators=rng.choice([None, (",", ":")]))
    text = rng.choice(["", " ", "\n"]) + text + rng.choice([" ", " \n"])  # a number ends at what follows it
    s, events = _scan(text)
    assert not s.error and s.done
    starts = [e for e in events if e.kind == "start"]
    ends = [e for e in events if e.kind == "end"]
    assert len(starts) == len(ends)
    # pair spans like brackets: each start's end is the first unmatched end at its depth
    for st in starts:
        end = next(e for e in ends if e.depth == st.depth and e.pos > st.pos)
        json.loads(text[st.pos:end.pos])  # a whole value
    top = next(e for e in ends if e.depth == 0)
    assert json.loads(text[starts[0].pos:top.pos]) == value
    keys = [e.text for e in events if e.kind == "key"]
    assert keys == [k for k in _keys(value)]


def _keys(v):
    if isinstance(v, dict):
        for k, x in v.items():
            yield k
            yield from _keys(x)
    elif isinstance(v, list):
        for x in v:
            yield from _keys(x)


@pytest.mark.parametrize("text", [
    '{"a": 1,}', '[1 2]', '{"a" 1}', '{a: 1}', '"tab\there"', '01', '1.', '-', '1e', '.5', "NaN", "tru",
    '{"a": Infinity}', '"\\x"', '"\\u12g4"', '[1]]', '{"a": 1} {', "'s'", '{"a": [1, {"b": nul}]}',
])
def test_refuses_what_pythons_strict_reader_refuses(text):
    def strict(t):
        def no_constant(c):
            raise ValueError(c)
        return json.loads(t, parse_constant=no_constant)

    with pytest.raises(ValueError):
        strict(text)
    s, _ = _scan(text)
    assert s.error or not s.done
