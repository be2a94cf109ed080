"""Gemma 4 through the real server and the official ``openai`` client, on the tiny Gemma 4 GGUFs.

The GGUFs (``tests/models/gemma4_chat.py``) carry the official Gemma 4 template, so the server picks the
``<|tool_call>call:NAME{…}<tool_call|>`` syntax and the thought channel from it. Random weights never
choose to call a tool; a forced ``tool_choice`` makes them, through the constrained decoder: every call
must validate against its tool's schema (``jsonschema``, independent of the grammar) with thinking on
and off, and, streamed, reassemble to the non-streamed reply's arguments.

Bounded transactions: a multi-turn prompt far longer than the 16-token window is prefilled by the
server in transactions (the family's 4,096 tokens; 8 on the E2B shape) cut at the stable-prefix boundary,
and its greedy reply must equal, token for token, the one our engine gives after prefilling the same
prompt in one eager forward.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio

from hf2q.sched.transactions import plan_transactions
from tests.test_api_real_model import CTX, real_server

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow]


def _tool(name: str, required: list[str], **properties) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


EDIT = _tool("edit_file", ["path", "start", "dry_run", "text"], path={"type": "string", "maxLength": 16},
             start={"type": "integer", "minimum": 1}, dry_run={"type": "boolean"},
             text={"type": "string", "maxLength": 24})
RUN = _tool("run", ["cmd"], cmd={"type": "string", "enum": ["pytest", "make"]})
TOOLS = [EDIT, RUN]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
THINKING = {"on": {"chat_template_kwargs": {"enable_thinking": True}}, "off": {"reasoning_effort": "none"}}
NAMED = {"type": "function", "function": {"name": "edit_file"}}
ASK = [{"role": "user", "content": "Fix line 3 of a.py, then run the tests."}]


def _client(url: str):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _valid(calls, named: str | None) -> list[tuple[str, dict]]:
    assert calls
    out = []
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert named in (None, call.function.name)
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


async def _streamed_calls(client, **kw) -> tuple[list[tuple[str, dict]], str | None, int]:
    """The calls a streamed reply's deltas reassemble to, its finish reason and how many argument pieces came."""
    names, args, finish, pieces = {}, {}, None, 0
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            assert not getattr(ch.delta, "reasoning_content", None)
            for d in ch.delta.tool_calls or ():
                if d.id is not None:  # a call's first delta: its id and name, before any argument
                    assert d.index not in names and d.function.name
                    names[d.index], args[d.index] = d.function.name, ""
                else:
                    assert d.function.name is None
                if d.function.arguments:
                    args[d.index] += d.function.arguments
                    pieces += 1
            finish = ch.finish_reason or finish
    return [(names[k], json.loads(args[k])) for k in sorted(names)], finish, pieces


async def test_forced_calls_in_gemma4_syntax_validate_and_stream():
    family, cases = "gemma4", (("on", "required"), ("off", "named"))
    from tests.models.gemma4_chat import gemma4_chat_gguf

    async with real_server(slots=2, path=gemma4_chat_gguf(family), model_id=family) as (url, _rt, model):
        assert model.tool_syntax == "gemma4"
        client = _client(url)
        for thinking, choice in cases:
            named = "edit_file" if choice == "named" else None
            kw = dict(model=family, messages=ASK, tools=TOOLS, tool_choice=NAMED if named else choice, temperature=0,
                      max_tokens=64, parallel_tool_calls=False, extra_body=THINKING[thinking])
            r = await client.chat.completions.create(**kw)
            out = r.choices[0]
            assert out.finish_reason == "tool_calls", (thinking, out)
            assert not getattr(out.message, "reasoning_content", None)
            assert len(out.message.tool_calls) == 1
            calls = _valid(out.message.tool_calls, named)
            streamed, finish, pieces = await _streamed_calls(client, **kw)
            assert finish == "tool_calls"
            assert streamed == calls  # the same T=0 reply, reassembled from its deltas
            assert pieces >= 2  # the arguments came in pieces, as they were generated
        # parallel calls allowed: every call that completes validates (random weights go on to max_tokens)
        r = await client.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 temperature=0, max_tokens=64)
        _valid(r.choices[0].message.tool_calls, None)
        # a past call and its response go back through the official template
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "pytest"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3 passed"}]
        r = await client.chat.completions.create(model=family, messages=history, tools=TOOLS, temperature=0,
                                                 max_tokens=4)
        assert r.usage.prompt_tokens == len(model.prepare(_request(history, TOOLS), 4096).prompt_tokens)


def _request(messages, tools=None):
    from hf2q.api.validation import parse_chat_request

    return parse_chat_request({"messages": messages, **({"tools": tools} if tools else {})})


def _long_conversation(rounds: int = 6) -> list[dict]:
    turns = []
    for k in range(rounds):
        turns.append({"role": "user", "content": f"Step {k}: explain what the function on line {10 * k} of "
                                                 f"module_{k}.py does, and whether its loop can stop early."})
        turns.append({"role": "assistant", "content": f"Line {10 * k} walks the list once and returns the first "
                                                      f"match, so the loop stops at the match {k}."})
    return turns + [{"role": "user", "content": "Summarise all of that in one sentence."}]


def _eager_greedy(path, prompt: list[int], n: int) -> list[int]:
    """The reference: the engine prefills the whole prompt in one forward, then decodes greedily."""
    from hf2q.engine.runner import MlxModelRunner

    runner = MlxModelRunner.load(path, CTX)
    seq = runner.new_sequence()
    out = [int(np.argmax(runner.prefill(seq, prompt)))]
    while len(out) < n:
        out.append(int(np.argmax(runner.decode([seq], [out[-1]])[0])))
    return out


CHUNK = 8
STEPS = 24


# the family's own 4,096-token candidate on a prompt longer than it (and than the tiny model's trained context:
# its rope does not care), and 8-token transactions on the E2B shape, whose shared-KV layers read another
# layer's cache across every cut
@pytest.mark.parametrize("family,chunk,rounds", [("gemma4", None, 66), ("gemma4_e2b", CHUNK, 6)])
async def test_resumed_prefill_equals_the_eager_one_token_for_token(family, chunk, rounds):
    from tests.models.gemma4_chat import gemma4_chat_gguf

    path = gemma4_chat_gguf(family)
    messages = _long_conversation(rounds)
    async with real_server(slots=2, path=path, model_id=family, prefill_chunk=chunk) as (url, rt, model):
        chunk = chunk or 4096
        prepared = model.prepare(_request(messages), 8192)
        prompt, stable = list(prepared.prompt_tokens), prepared.stable_prefix
        assert len(prompt) > chunk + 16 and 0 < stable < len(prompt) and stable % chunk  # a cut off the grid
        before = rt.snapshot().counters.get("prefill_transactions", 0)
        r = await _client(url).chat.completions.create(
            model=family, messages=messages, temperature=0, max_tokens=STEPS, logprobs=True,
            extra_body={"ignore_eos": True})
        transactions = rt.snapshot().counters["prefill_transactions"] - before
    assert transactions == len(plan_transactions(0, len(prompt), chunk, stable)) > 2
    served = [lp.token for lp in r.choices[0].logprobs.content]
    eager = await trio.to_thread.run_sync(_eager_greedy, path, prompt, len(served))
    assert len(served) == STEPS
    assert served == [model.decode_tokens([t]) for t in eager]
