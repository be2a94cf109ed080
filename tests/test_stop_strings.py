"""Stop strings when one lies inside another.

Reference: ``str.find`` over the whole text — the client gets the text before the stop
string that starts first, however the text was cut into tokens.
"""

from __future__ import annotations

import random

import pytest

from hf2q.text.stop_strings import StopStringMatcher


def _sent(stops, pieces):
    m = StopStringMatcher(stops)
    out = []
    for piece in pieces:
        safe, stopped = m.push(piece)
        out.append(safe)
        if stopped:
            return "".join(out), m.matched
    out.append(m.flush())
    return "".join(out), m.matched


@pytest.mark.parametrize("seed", range(200))
def test_nested_stops_any_chunking(seed):
    rng = random.Random(seed)
    outer = "".join(rng.choice("ab") for _ in range(rng.randint(2, 5)))
    i = rng.randrange(len(outer))
    inner = outer[i : rng.randint(i + 1, len(outer))]
    stops = [outer, inner] if rng.random() < 0.5 else [inner, outer]
    text = "".join(rng.choice(["a", "b", "x", outer[:-1]]) for _ in range(rng.randint(0, 12)))
    hits = sorted((text.find(s), n) for n, s in enumerate(stops) if s in text)
    want = (text[: hits[0][0]], stops[hits[0][1]]) if hits else (text, None)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert _sent(stops, pieces) == want


def test_stop_completed_only_by_the_end_of_generation():
    m = StopStringMatcher(["abcd", "bc"])
    assert m.push("xabc") == ("x", False)
    assert m.flush() == "a" and m.stopped and m.matched == "bc"
