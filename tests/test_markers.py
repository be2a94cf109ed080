"""Streaming marker matcher.

Reference: a one-shot search of the whole text with ``str.find`` — the marker starting
first (the first listed among those starting at one place), the text before it, then the
same search again after it. Any chunking of the text must give the same pieces and hits,
and while nothing is found the matcher may hold back only the longest suffix that is a
proper prefix of some marker.
"""

from __future__ import annotations

import random

import pytest

from hf2q.text.markers import MarkerMatcher


def _reference(markers, text):
    markers = [m for m in markers if m]
    pieces, hits = [], []
    while True:
        found = [(text.find(m), i) for i, m in enumerate(markers) if m in text]
        if not found:
            return pieces + [text], hits
        at, i = min(found)
        pieces.append(text[:at])
        hits.append(markers[i])
        text = text[at + len(markers[i]) :]


def _longest_partial(markers, text):
    return max((k for m in markers for k in range(len(m)) if k <= len(text) and text.endswith(m[:k])), default=0)


def _chunks(text, rng):
    out, i = [], 0
    while i < len(text):
        j = i + rng.choice([0, 1, 1, 2, 3, 5, 8])
        out.append(text[i:j])
        i = j
    return out


def _stream(matcher, chunks, markers):
    """Pieces and hits from feeding ``chunks``; checks the hold-back at every step."""
    pieces, hits, piece, seen = [], [], [], ""
    for n, chunk in enumerate(chunks + [""]):
        final = n == len(chunks)
        while True:
            scan = matcher.scan(chunk, final=final)
            piece.append(scan.text)
            if scan.marker is None:
                seen += chunk
                break
            pieces.append("".join(piece))
            hits.append(scan.marker)
            piece, seen, chunk = [], "", scan.rest
        released = "".join(piece)
        assert seen.startswith(released)
        held = seen[len(released) :]
        if final:
            assert held == ""
        elif not any(m in held for m in markers if m):
            assert len(held) == _longest_partial(markers, seen)
        assert matcher.holding == bool(held)
    return pieces + ["".join(piece)], hits


@pytest.mark.parametrize("seed", range(400))
def test_matches_one_shot_search_for_any_chunking(seed):
    rng = random.Random(seed)
    alphabet = rng.choice(["ab", "abc", "ab<>/"])
    markers = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.1:
        markers.append("")
    text = "".join(rng.choice(alphabet + "xy") for _ in range(rng.randint(0, 60)))
    want = _reference(markers, text)
    matcher = MarkerMatcher(markers)
    for _ in range(3):  # one matcher, reused stream after stream
        assert _stream(matcher, _chunks(text, rng), markers) == want


def test_holds_back_only_what_may_start_a_marker():
    m = MarkerMatcher(["</think>"])
    assert m.scan("reasoning <") == ("reasoning ", None, "")
    assert m.scan("/thi") == ("", None, "")
    assert m.scan("s is not it") == ("</this is not it", None, "")
    assert m.scan("</think>answer") == ("", "</think>", "answer")
    assert not m.holding


def test_marker_inside_another_waits_for_the_longer_one():
    m = MarkerMatcher(["abcd", "bc"])
    assert m.scan("xabc") == ("x", None, "")
    assert m.scan("d!") == ("", "abcd", "!")
    assert m.scan("abc") == ("", None, "")
    assert m.scan("e") == ("a", "bc", "e")
    assert m.scan("abc", final=True) == ("a", "bc", "")


def test_first_listed_wins_at_one_start():
    assert MarkerMatcher(["ab", "abc"]).scan("abc") == ("", "ab", "c")
    m = MarkerMatcher(["abc", "ab"])
    assert m.scan("ab") == ("", None, "")
    assert m.scan("x") == ("", "ab", "x")


def test_no_markers_passes_everything():
    m = MarkerMatcher(["", ""])
    assert m.scan("anything") == ("anything", None, "")
    assert not m.holding


def test_unicode_is_matched_by_character():
    m = MarkerMatcher(["🦙»"])
    assert m.scan("é🦙") == ("é", None, "")
    assert m.scan("»ü") == ("", "🦙»", "ü")
