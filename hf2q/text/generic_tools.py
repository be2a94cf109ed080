"""Tools for templates that have no tool syntax of their own (e.g. SmolLM2's ChatML).

We teach the model our ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` form in
the system prompt and rewrite the conversation's past calls and results into plain
turns; :mod:`hf2q.text.toolcalls` parses the replies with its ``generic`` syntax.

The system block depends only on the tools, never on ``tool_choice``: an agent that switches
``tool_choice`` between turns keeps its whole prompt prefix (and so its cached KV). Forced
choices are enforced by constrained decoding; the one line that names the choice (if any) is
appended to the conversation's last user turn, after everything the turns have in common.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def generic_tool_instructions(tools: Sequence[Mapping], tool_choice: Any = "auto") -> str:
    """System-prompt text teaching a template-less model our ``<tool_call>`` JSON format.

    The same text for every ``tool_choice`` (the argument is accepted for compatibility and
    ignored): see ``tool_choice_note`` for the per-request line.
    """
    lines = [
        "You can call the following tools. Each tool is described by a JSON schema:",
        "",
    ]
    for tool in tools:
        fn = tool.get("function", tool)
        lines.append(json.dumps({"name": fn.get("name"), "description": fn.get("description", ""),
                                 "parameters": fn.get("parameters", {})}, ensure_ascii=False))
    lines += [
        "",
        "To call a tool, reply with exactly one line per call in this form and nothing else:",
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}</tool_call>',
        "When a tool result is given back to you, use it to answer the user.",
        "If no tool is needed, answer normally.",
    ]
    return "\n".join(lines)


def tool_choice_note(tool_choice: Any) -> str | None:
    """The line that states this request's ``tool_choice`` (None for ``auto``), placed after the
    conversation so that it never changes the prompt's shared prefix."""
    if tool_choice == "required":
        return "(Call at least one tool now.)"
    if tool_choice == "none":
        return "(Answer directly now, without calling a tool.)"
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        return f"(Call the tool {name!r} now.)"
    return None


def messages_for_generic_template(messages: Sequence[Mapping], tools: Sequence[Mapping] | None, tool_choice: Any = "auto") -> list[dict]:
    """Rewrite an OpenAI conversation for a template that knows nothing about tools.

    Tool instructions (the same for every ``tool_choice``) go into the system message; past
    assistant calls become the ``<tool_call>`` text the model would have written; tool results
    become user turns marked as such (ChatML-only templates render any role, but small models
    follow user/assistant turns best); the ``tool_choice_note``, if any, ends the last user turn.
    Pass ``tools`` for ``tool_choice="none"`` too, so that the prefix stays the same.
    """
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            parts = [m.get("content") or ""]
            for call in m["tool_calls"]:
                fn = call.get("function", {})
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                parts.append("<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "</tool_call>")
            m = {"role": "assistant", "content": "\n".join(p for p in parts if p)}
        elif role == "tool":
            content = m.get("content")
            if not isinstance(content, str):
                content = json.dumps(content, ensure_ascii=False)
            m = {"role": "user", "content": f"<tool_response>{content}</tool_response>"}
        elif m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tools:
        text = generic_tool_instructions(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
        note = tool_choice_note(tool_choice)
        last = out[-1] if out else None
        if note and last is not None and last.get("role") == "user" and isinstance(last.get("content"), str):
            out[-1] = {**last, "content": f"{last['content']}\n\n{note}"}
    return out
