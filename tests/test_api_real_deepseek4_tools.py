"""DeepSeek-V4 served: DSML tool calls, thinking and the conversation's cached prefix.

The tiny DeepSeek-V4 GGUF (``tests/models/deepseek4_chat.py``: our converter, F16) carries llama.cpp's
``deepseek-ai-DeepSeek-V4.jinja``, so the server reads the DSML syntax and ``<think>`` from it. The
reference for every prompt is transformers' own renderer of the sdist's template file, fed the
conversation as Hugging Face writes it (arguments as objects, results in call order):

* a forced ``tool_choice`` (required, a named function) makes the random weights write a DSML block
  through the constrained decoder; the calls validate against their schemas (``jsonschema``), stream in
  pieces that reassemble to the non-streamed reply, and the text the grammar writes is the text the
  template renders for those calls, so the reply goes back into the history unchanged;
* tool results go back as the template's ``<tool_result>`` user turn, in call order;
* thinking: ``enable_thinking`` / ``reasoning_effort`` reach the template's variables, the reasoning
  comes back as ``reasoning_content``, and a later turn, whose history drops the old reasoning as the
  template does, still starts from the slot's cached prefix and gives the engine's cold greedy reply.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_api_real_gemma4 import _eager_greedy
from tests.test_api_real_model import CTX, real_server, sse_chunks

jsonschema = pytest.importorskip("jsonschema")

DS = "\uff5cDSML\uff5c"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
EDIT = {"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string", "maxLength": 6}, "line": {"type": "integer", "minimum": 1, "maximum": 99},
    "dry": {"type": "boolean"}}, "required": ["path", "line", "dry"]}}}
RUN = {"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string", "enum": ["pytest", "make"]}}, "required": ["cmd"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
FIND = {"type": "function", "function": {"name": "find", "parameters": {"type": "object", "properties": {
    "q": {"type": "string"}, "opts": {"type": "object", "properties": {"n": {"type": "array", "items": {
        "type": "integer"}}}, "required": ["n"]}}}}}
TOOLS = [EDIT, RUN]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# the user turns end in a word: SmolLM2's vocabulary (the tiny model's) merges punctuation with the "<" of the
# template's next marker, and the prompt then has no token boundary where its history ends
ASK = [{"role": "user", "content": "Fix line 3 of a.py, then run the tests"}]
THINKING_ON = {"chat_template_kwargs": {"enable_thinking": True}}
BOS = "<|im_start|>"  # the tiny model's tokenizer is SmolLM2's


def _reference(messages, tools=None, add_generation_prompt=True, **variables) -> str:
    """transformers' rendering of the sdist's DeepSeek-V4 template (``messages`` in Hugging Face's form)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from tests.models.deepseek4_chat import template_source

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template_source(),
                                        add_generation_prompt=add_generation_prompt, bos_token=BOS, **variables)
    return rendered[0]


def _hf_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _openai(messages) -> list[dict]:
    """``messages`` as an OpenAI client sends them (arguments as JSON text)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]}
        out.append(m)
    return out


@pytest.fixture(scope="module")
def chat_model():
    """The text side of the server over SmolLM2's tokenizer and the official template (no weights needed)."""
    from hf2q.api.textbridge import GGUFChatModel
    from hf2q.fetch import SMOLLM2, fetch
    from hf2q.text.chat_template import ChatTemplate
    from hf2q.text.tokenizer import GGUFTokenizer

    from tests.models.deepseek4_chat import template_source

    return GGUFChatModel(GGUFTokenizer.from_gguf(fetch(SMOLLM2)), ChatTemplate(template_source(), bos_token=BOS),
                         "deepseek4")


def _request(messages, **extra):
    from hf2q.api.validation import parse_chat_request

    return parse_chat_request({"messages": messages, **extra})


# ---------------------------------------------------------------------------- the text side alone

ROUND = [("now", {}), ("find", {}), ("find", {"q": "a\nb <x> ü"}), ("find", {"q": "z", "opts": {"n": [1, 2]}}),
         ("edit", {"path": "a.py", "line": 3, "dry": False})]


def _template_reply_reads_back(tok, calls) -> None:
    """A past call as the template renders it is exactly a reply the forced grammar allows, and reads back
    as the same calls, fed in pieces of any size."""
    from hf2q.text import constrained
    from hf2q.text.toolcalls import collect, make_parser

    tools = [EDIT, NOW, FIND]
    turn = {"role": "assistant", "content": "", "tool_calls": [_hf_call(f"c{i}", n, a) for i, (n, a) in enumerate(calls)]}
    prompt = _reference(ASK, tools)
    full = _reference(ASK + [turn], tools, add_generation_prompt=False)
    assert full.startswith(prompt) and full.endswith(EOS)
    reply = full[len(prompt):-len(EOS)]
    grammar = constrained.for_tool_choice(tok, "deepseek", tools, "required")
    for t in tok.encode(reply, add_special=False, parse_special=False):
        grammar.advance(t)
    assert grammar.is_accepting()
    rng = random.Random(len(reply))
    parser, events, i = make_parser("deepseek", tools), [], 0
    while i < len(reply):
        j = i + rng.randint(1, 9)
        events += parser.feed(reply[i:j])
        i = j
    content, got = collect(events + parser.finish())
    assert content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


@pytest.mark.parametrize("calls", [ROUND[:1], ROUND[1:2], ROUND[2:3], ROUND[3:], ROUND[2:]],
                         ids=["no-args", "optional-none", "string", "parallel-typed", "three"])
def test_the_forced_grammar_writes_what_the_template_renders(chat_model, calls):
    _template_reply_reads_back(chat_model.tokenizer, calls)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# planes 4 to 13 (no character assigned there) are outside what llguidance's free text can write
@given(q=st.text(st.characters(blacklist_categories=("Cs",), max_codepoint=0x3FFFF), max_size=24),
       n=st.lists(st.integers(-10**6, 10**6), max_size=4), line=st.integers(1, 99), dry=st.booleans())
def test_any_argument_values_round_trip(chat_model, q, n, line, dry):
    _template_reply_reads_back(chat_model.tokenizer, [("find", {"q": q, "opts": {"n": n}}),
                                                      ("edit", {"path": "a.py", "line": line, "dry": dry})])


def test_tool_results_render_as_the_template_does_in_call_order(chat_model):
    calls = [_hf_call("call_a", "run", {"cmd": "make"}), _hf_call("call_b", "edit", {"path": "a.py", "line": 3,
                                                                                       "dry": True})]
    results = [{"role": "tool", "tool_call_id": "call_a", "content": "built"},
               {"role": "tool", "tool_call_id": "call_b", "content": '{"ok": true}'}]
    turn = {"role": "assistant", "content": "On it.", "reasoning_content": "Two steps.", "tool_calls": calls}
    want = _reference(ASK + [turn] + results, TOOLS, thinking=True)
    assert "<｜User｜><tool_result>built</tool_result>\n\n<tool_result>" in want  # one user turn, call order
    for order in (results, results[::-1]):  # a client may list results as they finished
        got = chat_model.render(_request(_openai(ASK + [turn]) + order, tools=TOOLS, **THINKING_ON))
        assert got == want


def test_results_keep_user_messages_in_place_and_unknown_ids_last():
    from hf2q.text.deepseek4_turns import results_in_call_order

    def tool(cid):
        return {"role": "tool", "tool_call_id": cid, "content": cid}
    turn = {"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]}
    note = {"role": "user", "content": "meanwhile"}
    got = results_in_call_order([turn, tool("x"), tool("b"), note, tool("a"), {"role": "assistant"}, tool("b")])
    assert got == [turn, tool("a"), tool("b"), note, tool("x"), {"role": "assistant"}, tool("b")]


def test_thinking_variables_reach_the_template(chat_model):
    def prompt(**extra):
        return chat_model.render(_request(ASK, **extra))

    assert prompt() == _reference(ASK)  # the template's own default: thinking off
    assert prompt(**THINKING_ON) == _reference(ASK, enable_thinking=True) != prompt()
    assert prompt(reasoning_effort="high") == _reference(ASK, enable_thinking=True, reasoning_effort="high")
    assert prompt(reasoning_effort="none") == _reference(ASK, enable_thinking=False)
    deepest = prompt(chat_template_kwargs={"enable_thinking": True, "reasoning_effort": "max"})
    assert deepest == _reference(ASK, enable_thinking=True, reasoning_effort="max")
    assert deepest.startswith(BOS + "Reasoning Effort: Absolute maximum")


def _decoded(chat_model, req, text: str):
    """(reasoning, content, calls) of ``text`` written by the model, token by token, for ``req``."""
    decoder = chat_model.prepare(req, CTX).new_decoder()
    deltas = []
    for t in chat_model.tokenizer.encode(text, add_special=False, parse_special=False):
        deltas += decoder.feed(t)
    deltas += decoder.finish()
    kinds = {}
    for d in deltas:
        kinds.setdefault(type(d).__name__, []).append(d)
    reasoning = "".join(d.text for d in kinds.get("ReasoningDelta", ()))
    content = "".join(d.text for d in kinds.get("ContentDelta", ()))
    names = [d.name for d in kinds.get("ToolCallStart", ())]
    return reasoning, content, names


def test_a_dsml_block_opened_from_the_reasoning_ends_it(chat_model):
    block = (f'\n\n<{DS}tool_calls>\n<{DS}invoke name="run">\n<{DS}parameter name="cmd" string="true">make'
             f"</{DS}parameter>\n</{DS}invoke>\n</{DS}tool_calls>")
    with_tools = _request(ASK, tools=TOOLS, **THINKING_ON)
    assert _decoded(chat_model, with_tools, "I will build first." + block) == ("I will build first.", "", ["run"])
    assert _decoded(chat_model, with_tools, "Build.\n</think>" + block) == ("Build.", "", ["run"])
    # no tools: the block is not a call, and stays in the reasoning where the model wrote it
    assert _decoded(chat_model, _request(ASK, **THINKING_ON), "Plan." + block) == ("Plan." + block, "", [])


# ---------------------------------------------------------------------------- through the real server

def _valid(calls: list[dict], named: str | None) -> list[tuple[str, dict]]:
    assert calls
    out = []
    for call in calls:
        name = call["function"]["name"]
        assert named in (None, name) and call["id"].startswith("call_")
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[name])
        out.append((name, args))
    return out


async def _streamed(c: httpx.AsyncClient, body: dict) -> tuple[list[tuple[str, dict]], str | None, int]:
    """The calls a streamed reply's deltas reassemble to, its finish reason and how many argument pieces came."""
    names, args, finish, pieces = {}, {}, None, 0
    async for ch in sse_chunks(c, body):
        for choice in ch["choices"]:
            assert not choice["delta"].get("reasoning_content")
            for d in choice["delta"].get("tool_calls") or ():
                if "id" in d:  # a call's first delta: its id and name, before any argument
                    assert d["index"] not in names and d["function"]["name"]
                    names[d["index"]], args[d["index"]] = d["function"]["name"], ""
                else:
                    assert "name" not in d["function"]
                if d["function"].get("arguments"):
                    args[d["index"]] += d["function"]["arguments"]
                    pieces += 1
            finish = choice["finish_reason"] or finish
    return [(names[k], json.loads(args[k])) for k in sorted(names)], finish, pieces


@pytest.mark.slow
async def test_forced_dsml_calls_validate_stream_and_go_back_into_the_history(chat_model):
    from tests.models.deepseek4_chat import deepseek4_chat_gguf

    # one slot: each request finds the previous one's cache
    async with real_server(slots=1, path=deepseek4_chat_gguf(), model_id="deepseek4") as (url, _rt, model), \
            httpx.AsyncClient(base_url=url, timeout=600) as c:
        assert model.tool_syntax == "deepseek"
        named = {"type": "function", "function": {"name": "edit"}}
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": named, "temperature": 0, "max_tokens": 200,
                **THINKING_ON}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        first = r.json()
        out = first["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        assert not out["message"].get("reasoning_content")  # the call closed the open <think> first
        calls = _valid(out["message"]["tool_calls"], "edit")
        assert len(calls) == 1
        streamed, finish, pieces = await _streamed(c, body)
        assert (streamed, finish) == (calls, "tool_calls") and pieces >= 3  # the same T=0 reply, in pieces

        # the call and its result go back: the prompt is the template's, and the first prompt is still cached
        history = _openai(ASK) + [out["message"], {"role": "tool", "tool_call_id": out["message"]["tool_calls"][0][
            "id"], "content": "patched"}]
        want = _reference(ASK + [{"role": "assistant", "content": "", "tool_calls": [
            _hf_call("x", *calls[0])]}, {"role": "tool", "content": "patched"}], TOOLS, thinking=True)
        again = {**body, "messages": history, "tool_choice": "auto", "max_tokens": 1}
        r = await c.post("/v1/chat/completions", json=again)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert model.render(_request(history, tools=TOOLS, **THINKING_ON)) == want
        assert usage["prompt_tokens"] == len(model.prepare(_request(history, tools=TOOLS, **THINKING_ON),
                                                           CTX).prompt_tokens)
        first_prompt = model.prepare(_request(ASK, tools=TOOLS, **THINKING_ON), CTX)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= first_prompt.stable_prefix > 0

        # required, thinking off through reasoning_effort, one call
        r = await c.post("/v1/chat/completions", json={**body, "tool_choice": "required", "parallel_tool_calls": False,
                                                       "reasoning_effort": "none", "chat_template_kwargs": {}})
        out = r.json()["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        assert len(_valid(out["message"]["tool_calls"], None)) == 1


STEPS = 6


@pytest.mark.slow
async def test_thinking_turns_reuse_the_cached_prefix():
    import trio

    from tests.models.deepseek4_chat import deepseek4_chat_gguf

    path = deepseek4_chat_gguf()
    first = [{"role": "user", "content": "Tell me why the loop on line 10 stops early"}]
    async with real_server(slots=1, path=path, model_id="deepseek4") as (url, _rt, model), \
            httpx.AsyncClient(base_url=url, timeout=600) as c:
        body = {"messages": first, "temperature": 0, "max_tokens": STEPS, "logprobs": True, **THINKING_ON,
                "ignore_eos": True}
        r = (await c.post("/v1/chat/completions", json=body)).json()
        message = r["choices"][0]["message"]
        tokens = [lp["token"] for lp in r["choices"][0]["logprobs"]["content"]]
        assert message["reasoning_content"] == "".join(tokens).strip("\n")  # the prompt opened <think>
        assert not message["content"]
        # the next turn: the template drops the old reasoning, so the history differs from what the slot holds
        # after the first turn's generation prompt; the cached prefix still covers the first turn's history
        turns = first + [{"role": "assistant", "content": "It returns at the first match.",
                          "reasoning_content": message["reasoning_content"]},
                         {"role": "user", "content": "And the one on line 20"}]
        prompt = model.render(_request(turns, **THINKING_ON))
        assert prompt == _reference(turns, enable_thinking=True)
        assert message["reasoning_content"] not in prompt
        r = (await c.post("/v1/chat/completions", json={**body, "messages": turns})).json()
        stable = model.prepare(_request(first, **THINKING_ON), CTX).stable_prefix
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= stable > 0
        served = [lp["token"] for lp in r["choices"][0]["logprobs"]["content"]]
        prompt_ids = list(model.prepare(_request(turns, **THINKING_ON), CTX).prompt_tokens)
    cold = await trio.to_thread.run_sync(_eager_greedy, path, prompt_ids, STEPS)  # one prefill, no cache
    assert served == [model.decode_tokens([t]) for t in cold]  # reused = cold, token for token
