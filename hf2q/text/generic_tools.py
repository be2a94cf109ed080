"""Tools for templates that have no tool syntax of their own (e.g. SmolLM2's ChatML).

We teach the model our ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` form in
the system prompt and rewrite the conversation's past calls and results into plain
turns; :mod:`hf2q.text.toolcalls` parses the replies with its ``generic`` syntax.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def generic_tool_instructions(tools: Sequence[Mapping], tool_choice: Any = "auto") -> str:
    """System-prompt text teaching a template-less model our ``<tool_call>`` JSON format."""
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
    ]
    if tool_choice == "required":
        lines.append("You must call at least one tool now.")
    elif isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        lines.append(f"You must call the tool {name!r} now.")
    else:
        lines.append("If no tool is needed, answer normally.")
    return "\n".join(lines)


def messages_for_generic_template(messages: Sequence[Mapping], tools: Sequence[Mapping] | None, tool_choice: Any = "auto") -> list[dict]:
    """Rewrite an OpenAI conversation for a template that knows nothing about tools.

    Tool instructions go into the system message; past assistant calls become the
    ``<tool_call>`` text the model would have written; tool results become user turns
    marked as such (ChatML-only templates render any role, but small models follow
    user/assistant turns best).
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
        text = generic_tool_instructions(tools, tool_choice)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
