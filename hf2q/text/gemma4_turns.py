"""OpenAI tool turns for Gemma 4 templates that only read Gemma's native ``tool_responses``.

Gemma's own chat format keeps a whole tool round in one model turn: the calls, then each call's
response, then the answer. The official template (``google-gemma-4-31B-it.jinja``) also reads
OpenAI's ``role: tool`` messages; earlier ones (the ``-interleaved`` template) read only an
assistant message's ``tool_responses`` list of ``{"name", "response"}``. For those, an assistant
message with calls, the ``role: tool`` messages after it and a plain assistant answer that follows
are folded into that one message (as llama.cpp's chat layer does for them). A response's text is
given as the object it encodes when it is JSON, so the template writes it in Gemma's notation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def reads_only_native_responses(template_source: str) -> bool:
    """Whether a Gemma 4 template takes tool results only as ``tool_responses`` (it never looks at
    a ``role: tool`` message's ``tool_call_id``)."""
    return "tool_responses" in template_source and "tool_call_id" not in template_source


def _response(content: Any) -> Any:
    if isinstance(content, list):  # content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    if isinstance(content, str):
        try:
            return json.loads(content)
        except ValueError:
            return content
    return content


def fold_tool_responses(messages: Sequence[Mapping]) -> list[dict]:
    """``messages`` with each tool round (assistant calls → tool results → plain answer) as one
    assistant message carrying ``tool_responses``; a result is named after the call its
    ``tool_call_id`` answers, else the call at its position."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        m = dict(messages[i])
        i += 1
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            continue
        calls = list(m["tool_calls"])
        names = {c.get("id"): c.get("function", {}).get("name") for c in calls}
        responses = []
        while i < len(messages) and messages[i].get("role") == "tool":
            result = messages[i]
            position = calls[len(responses)] if len(responses) < len(calls) else {}
            name = names.get(result.get("tool_call_id")) or position.get("function", {}).get("name") \
                or result.get("name") or "unknown"
            responses.append({"name": name, "response": _response(result.get("content"))})
            i += 1
        if responses:
            m["tool_responses"] = responses
        nxt = messages[i] if i < len(messages) else None
        if responses and nxt is not None and nxt.get("role") == "assistant" and not nxt.get("tool_calls") \
                and nxt.get("content"):
            m["content"] = nxt["content"]
            i += 1
        out.append(m)
    return out
