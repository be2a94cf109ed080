"""Forced tool calls in Qwen 3.5's XML syntax through the real server, on a tiny qwen35 GGUF.

The GGUF (``tests/models/qwen35_chat.py``) carries the official Qwen3.5 template, so the server
picks the ``<tool_call><function=…><parameter=…>`` syntax from it. Random weights never choose to
call a tool; a forced ``tool_choice`` makes them, through the constrained decoder: every reply
must carry calls whose arguments validate against the tool's schema (``jsonschema``, independent
of the grammar), with thinking on (the prompt opens ``<think>``: the call must still land in
``tool_calls``, not in ``reasoning_content``), off, and through ``reasoning_effort``. Streamed,
each call's id and name come first and its arguments follow in pieces that reassemble to the
non-streamed reply's.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_api_real_model import real_server, sse_chunks

jsonschema = pytest.importorskip("jsonschema")

pytestmark = [pytest.mark.slow]

EDIT = {"type": "function", "function": {"name": "edit_file", "description": "Replace lines of a file",
                                         "parameters": {"type": "object", "properties": {
                                             "path": {"type": "string", "maxLength": 24},
                                             "start": {"type": "integer", "minimum": 1},
                                             "dry_run": {"type": "boolean"},
                                             "options": {"type": "object", "properties": {
                                                 "indent": {"type": "integer"}}, "required": ["indent"]},
                                             "text": {"type": "string"}},
                                             "required": ["path", "start", "dry_run", "options", "text"]}}}
RUN = {"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string", "enum": ["pytest", "make"]}}, "required": ["cmd"]}}}
TOOLS = [EDIT, RUN]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
THINKING = {"on": {}, "off": {"chat_template_kwargs": {"enable_thinking": False}},
            "effort none": {"reasoning_effort": "none"}, "effort high": {"reasoning_effort": "high"}}
NAMED = {"type": "function", "function": {"name": "edit_file"}}


def _body(choice, thinking: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "Fix line 3 of a.py, then run the tests."}], "tools": TOOLS,
            "tool_choice": choice, "temperature": 0, "max_tokens": 200, **THINKING[thinking], **extra}


def _valid(calls: list[dict], named: str | None) -> None:
    assert calls
    for call in calls:
        name = call["function"]["name"]
        assert named in (None, name)
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


async def test_forced_calls_in_the_xml_syntax_validate_and_stream():
    from tests.models.qwen35_chat import qwen35_chat_gguf

    async with real_server(slots=2, path=qwen35_chat_gguf(), model_id="qwen35") as (url, _rt, model), \
            httpx.AsyncClient(base_url=url, timeout=600) as c:
        assert model.tool_syntax == "qwen_xml"
        for thinking in THINKING:
            for choice, named, parallel in (("required", None, True), (NAMED, "edit_file", False)):
                body = _body(choice, thinking, parallel_tool_calls=parallel)
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                choice_out = r.json()["choices"][0]
                assert choice_out["finish_reason"] == "tool_calls", (thinking, choice_out)
                message = choice_out["message"]
                assert not message.get("reasoning_content")  # the call closed the open block first
                calls = message["tool_calls"]
                _valid(calls, named)
                if not parallel:
                    assert len(calls) == 1

                # streamed: per call, id + name first, then argument pieces only
                deltas, finish = [], None
                async for ch in sse_chunks(c, body):
                    for ch_choice in ch["choices"]:
                        deltas.extend(ch_choice["delta"].get("tool_calls") or [])
                        assert not ch_choice["delta"].get("reasoning_content")
                        finish = ch_choice["finish_reason"] or finish
                assert finish == "tool_calls"
                for k, call in enumerate(calls):
                    mine = [d for d in deltas if d["index"] == k]
                    assert mine[0]["id"].startswith("call_") and mine[0]["type"] == "function"
                    assert mine[0]["function"]["name"] == call["function"]["name"]
                    assert all("name" not in d["function"] and "id" not in d for d in mine[1:])
                    assert len(mine) >= 3  # the arguments came in pieces, as they were generated
                    streamed = "".join(d["function"].get("arguments", "") for d in mine)
                    assert json.loads(streamed) == json.loads(call["function"]["arguments"])  # same T=0 reply
                assert {d["index"] for d in deltas} == set(range(len(calls)))
