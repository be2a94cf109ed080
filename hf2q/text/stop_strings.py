"""The request's ``stop`` strings, applied to generated text as it streams.

Stop strings are a text-level rule: the API runs them after detokenisation, so a stop
string split across tokens (or across the bytes of one character) is still found. The
stop string itself is never sent, the text before it is (docs/API.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from hf2q.text.markers import MarkerMatcher

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Finds stop strings in streamed text, even when they span token boundaries.

    ``push(text)`` returns ``(safe_text, stopped)``: ``safe_text`` can be sent to the
    client now (text that might be the start of a stop string is held back); once a stop
    string is found, ``stopped`` is True and ``safe_text`` ends right before it.
    """

    def __init__(self, stops: Iterable[str] | str | None):
        if isinstance(stops, str):
            stops = [stops]
        self.stops = [s for s in (stops or ()) if s]
        self._markers = MarkerMatcher(self.stops)
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        return self._scan(text, final=False)

    def flush(self) -> str:
        """The held-back text, at the end of generation when no stop string completed."""
        if self.stopped:
            return ""
        return self._scan("", final=True)[0]

    def _scan(self, text: str, *, final: bool) -> tuple[str, bool]:
        scan = self._markers.scan(text, final=final)
        if scan.marker is not None:
            self.stopped, self.matched = True, scan.marker
        return scan.text, self.stopped

    @property
    def holding(self) -> bool:
        return self._markers.holding
