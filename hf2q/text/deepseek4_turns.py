"""OpenAI tool turns in the order DeepSeek-V4 was trained on.

DeepSeek-V4's template puts every message of a run of ``user`` / ``tool`` messages into one user
turn, each result as ``<tool_result>…</tool_result>``, in the order the messages come. DeepSeek's own
encoder (and llama.cpp's chat layer after it) writes the results of one assistant turn in the order of
that turn's calls instead, matched by ``tool_call_id``, however the client listed them: an agent that
runs calls concurrently may send the results in the order they finished. Reordering them here gives
the model the layout it knows, and a conversation that is replayed with its results in another order
renders to the same prompt, so its cached prefix still applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def results_in_call_order(messages: Sequence[Mapping]) -> list[dict]:
    """``messages`` with each run of tool results sorted by the position of the call it answers in the
    assistant turn before it. User messages keep their places; a result whose id matches no call
    keeps its order after the matched ones."""
    out = [dict(m) for m in messages]
    order: dict[str, int] = {}
    i = 0
    while i < len(out):
        role = out[i].get("role")
        if role not in ("user", "tool"):
            if role == "assistant":
                order = {c["id"]: k for k, c in enumerate(out[i].get("tool_calls") or ())
                         if isinstance(c, Mapping) and isinstance(c.get("id"), str)}
            i += 1
            continue
        end = i
        while end < len(out) and out[end].get("role") in ("user", "tool"):
            end += 1
        places = [k for k in range(i, end) if out[k].get("role") == "tool"]
        ranked = sorted((out[k] for k in places), key=lambda m: order.get(m.get("tool_call_id"), len(order)))
        for k, m in zip(places, ranked, strict=True):
            out[k] = m
        i = end
    return out


#: what a DeepSeek-V4 reply under a ``response_format`` writes around its JSON: the template's system
#: block asks for the schema, and llama.cpp's reader for this family expects a fenced json block
JSON_FENCE = ("```json\n", "\n```")


def response_format_schema(response_format: Mapping | None) -> dict | None:
    """The template's ``response_format`` variable for an OpenAI ``response_format``, as llama.cpp hands
    it over: the JSON schema itself (``{}`` for ``json_object``); None for plain text."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return dict(response_format.get("schema") or {})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        return dict(spec.get("schema") or {}) if isinstance(spec, Mapping) else {}
    return None


class FencedContent:
    """The reply's content with the fence around it taken off, as it streams: the opening is dropped
    once it has arrived whole, and the last ``len(closing)`` characters are held back until the end
    shows whether they are the closing fence. Text that does not open with the fence passes through."""

    def __init__(self, fence: tuple[str, str] = JSON_FENCE):
        self.opening, self.closing = fence
        self._head = ""  # text seen while it may still be the opening
        self._opened: bool | None = None
        self._held = ""

    def feed(self, text: str) -> str:
        if self._opened is None:
            self._head += text
            if self.opening.startswith(self._head):
                return ""
            self._opened = self._head.startswith(self.opening)
            text = self._head[len(self.opening):] if self._opened else self._head
        if not self._opened:
            return text
        self._held += text
        cut = max(0, len(self._held) - len(self.closing))
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def finish(self) -> str:
        if self._opened is None:
            return self._head
        held, self._held = self._held, ""
        return "" if self._opened and held == self.closing else held
