"""Find marker strings in text that arrives in chunks.

Stop strings, reasoning markers (``<think>`` …) and tool-call markers all come out of a
model a token at a time, so a marker may be cut at any chunk end. :class:`MarkerMatcher`
walks a trie of the markers as text arrives: text is released as soon as it cannot be the
start of any marker, and only the longest suffix that is still a proper prefix of some
marker is held back. A chunk costs at most its length times the longest marker's length;
text already released is never looked at again.

The marker found is the one a search of the whole text at once would find: the one that
starts first, and of those starting at the same place, the one listed first. So when one
marker lies inside another (``["abcd", "bc"]``), a complete ``bc`` waits until the
``abcd`` that began before it is ruled out, and the answer never depends on where the
chunks were cut.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["MarkerMatcher", "Scan"]


class Scan(NamedTuple):
    """What one :meth:`MarkerMatcher.scan` decided."""

    text: str  # safe to release; when a marker was found, the text right before it
    marker: str | None  # the marker found, or None: all input was taken (some may be held)
    rest: str = ""  # input after the marker, not scanned yet: scan it next


class _Node:
    __slots__ = ("children", "index", "best_below")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.index: int | None = None  # the marker that ends here (its position in the list)
        self.best_below: float = math.inf  # the first-listed marker that ends further down


def _build_trie(markers: tuple[str, ...]) -> _Node:
    root = _Node()
    for index, marker in enumerate(markers):
        path = [root]
        for ch in marker:
            path.append(path[-1].children.setdefault(ch, _Node()))
        if path[-1].index is None:
            path[-1].index = index
        for node in path[:-1]:
            node.best_below = min(node.best_below, index)
    return root


class MarkerMatcher:
    """Streaming search for the first of several markers; reusable after each find.

    Feed text with :meth:`scan` until it reports a marker, then continue with its ``rest``
    (with this matcher or another: a parser that switches from an opening marker to a
    closing one feeds ``rest`` to the closing marker's matcher). At the end of the stream
    call ``scan(..., final=True)``: it releases what was held back, or reports a marker that
    was waiting only for a longer one to be ruled out.
    """

    def __init__(self, markers: Iterable[str]):
        self.markers = tuple(m for m in markers if m)
        self._root = _build_trie(self.markers)
        self._reset()

    def _reset(self) -> None:
        self._held = ""
        # live partial matches as (start in _held, trie node), earliest start first
        self._partials: list[tuple[int, _Node]] = []
        self._found: tuple[int, int] | None = None  # (start in _held, marker index) not yet certain

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def scan(self, text: str, *, final: bool = False) -> Scan:
        buf = self._held + text
        partials, found = self._partials, self._found
        for pos in range(len(self._held), len(buf)):
            ch = buf[pos]
            alive: list[tuple[int, _Node]] = []
            for start, node in partials:
                child = node.children.get(ch)
                if child is None:
                    continue
                if child.index is not None and (found is None or start < found[0]
                                                or (start == found[0] and child.index < found[1])):
                    found = (start, child.index)
                if child.children:
                    alive.append((start, child))
            if found is None:
                child = self._root.children.get(ch)
                if child is not None:
                    if child.index is not None:
                        found = (pos, child.index)
                    if child.children:
                        alive.append((pos, child))
            if found is not None:
                # only a partial that began earlier, or a first-listed longer marker at the
                # same start, can still take the place of the one found
                alive = [(s, n) for s, n in alive if s < found[0] or (s == found[0] and n.best_below < found[1])]
                if not alive:
                    return self._hit(buf, found)
            partials = alive
        if final and found is not None:
            return self._hit(buf, found)
        if final or not partials:
            self._reset()
            return Scan(buf, None)
        keep = partials[0][0]
        self._held = buf[keep:]
        self._partials = [(s - keep, n) for s, n in partials]
        self._found = None if found is None else (found[0] - keep, found[1])
        return Scan(buf[:keep], None)

    def _hit(self, buf: str, found: tuple[int, int]) -> Scan:
        start, index = found
        marker = self.markers[index]
        self._reset()
        return Scan(buf[:start], marker, buf[start + len(marker) :])
