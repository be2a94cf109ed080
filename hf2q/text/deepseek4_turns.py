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
