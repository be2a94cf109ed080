"""Stop-string matching over streamed text (sampling itself lives in ``hf2q.engine.sampling``)."""

from __future__ import annotations

from collections.abc import Iterable


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
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        first, which = -1, None
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (first == -1 or i < first):
                first, which = i, s
        if which is not None:
            self.stopped, self.matched, self._held = True, which, ""
            return buf[:first], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """The held-back text, at the end of generation when no stop string completed."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    @property
    def holding(self) -> bool:
        return bool(self._held)
