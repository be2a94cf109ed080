"""The text side of serving a Qwen 3.5 GGUF (the tiny ``qwen35`` with the official Qwen3.5 template).

References: transformers' ``apply_chat_template`` on the same template source (the prompt for every
``reasoning_effort`` / ``enable_thinking``), the template itself (an assistant turn it renders from
known calls is what the model writes; reading it back must give those calls), and llguidance's
matcher over the GGUF's own vocabulary (what a forced call may write).
"""

from __future__ import annotations

import copy
import functools
import json

import pytest

from hf2q.api.shapes import ContentDelta, ReasoningDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from hf2q.api.validation import parse_chat_request
from tests.models.qwen35_chat import qwen35_chat_gguf, template_source

TOOLS = [
    {"type": "function", "function": {"name": "edit_file", "description": "Replace a file's text", "parameters": {
        "type": "object", "properties": {
            "path": {"type": "string"}, "line": {"type": "integer"}, "ratio": {"type": "number"},
            "create": {"type": "boolean"}, "options": {"type": "object"}, "tags": {"type": "array"},
            "limit": {"type": ["integer", "null"]}, "code": {"type": "string"}},
        "required": ["path"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}},
]
ASK = [{"role": "system", "content": "You edit code."}, {"role": "user", "content": "Fix the bug in a.py, then test."}]


@functools.cache
def model():
    from hf2q.api.textbridge import GGUFChatModel

    return GGUFChatModel.from_gguf(qwen35_chat_gguf(), "qwen35")


@functools.cache
def hf_tokenizer():
    from transformers import AutoTokenizer

    from tests.models.tokenizer_files import tokenizer_dir

    return AutoTokenizer.from_pretrained(tokenizer_dir("qwen3"))


def test_the_gguf_template_picks_the_xml_call_syntax_and_thinking():
    m = model()
    assert m.template_source == template_source()
    assert m.tool_syntax == "qwen_xml"
    assert m.template.thinking_markers == ("<think>", "</think>")


@pytest.mark.parametrize("fields, thinking", [
    ({}, True),
    ({"chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"chat_template_kwargs": {"enable_thinking": True}}, True),
    ({"reasoning_effort": "none"}, False),
    ({"reasoning_effort": "minimal"}, False),
    ({"reasoning_effort": "low"}, True),
    ({"reasoning_effort": "high"}, True),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, False),
])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_the_prompt_is_what_transformers_renders_for_that_thinking_setting(fields, thinking, tools):
    body = {"messages": ASK, **({"tools": tools} if tools else {}), **fields}
    got = model().render(parse_chat_request(body))
    kwargs = {"enable_thinking": thinking}
    if "reasoning_effort" in fields:
        kwargs["reasoning_effort"] = fields["reasoning_effort"]
    expected = hf_tokenizer().apply_chat_template(copy.deepcopy(ASK), tools=copy.deepcopy(tools),
                                                   chat_template=template_source(), add_generation_prompt=True,
                                                   tokenize=False, **kwargs)
    assert got == expected
    assert got.endswith("<think>\n" if thinking else "<think>\n\n</think>\n\n")


CALLS = [("edit_file", {"path": "a.py", "line": 12, "ratio": 0.5, "create": False, "options": {"indent": 4},
                        "tags": ["fix", "bug"], "limit": None, "code": "x = 1\n\nif x:\n    print('ok <b>')\n"}),
         ("run", {"cmd": "pytest -q"})]


def _decode(text: str, body: dict) -> list:
    """The deltas the served decoder gives for generated ``text``, fed one token at a time."""
    m = model()
    prepared = m.prepare(parse_chat_request(body), 4096)
    decoder = prepared.new_decoder()
    out = []
    for t in m.tokenizer.encode(text, add_special=False, parse_special=True):
        out += decoder.feed(t)
    return out + decoder.finish()


def _reply(deltas) -> tuple[str, str, list[tuple[str, dict]]]:
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    names = {d.index: d.name for d in deltas if isinstance(d, ToolCallStart)}
    args: dict[int, str] = {}
    for d in deltas:
        if isinstance(d, ToolCallArgs):
            args[d.index] = args.get(d.index, "") + d.text
    done = [d.index for d in deltas if isinstance(d, ToolCallEnd)]
    return reasoning, content, [(names[i], json.loads(args[i])) for i in done]


def test_template_written_reasoning_content_and_parallel_calls_stream_back_typed():
    """The assistant turn the template renders from known calls is read back, token by token, as
    those calls (values typed by each tool's schema), with the reasoning and the text apart."""
    tpl = model().template
    turn = {"role": "assistant", "content": "I will fix it, then run the tests.",
            "reasoning_content": "The bug is on line 12.",
            "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                           for i, (n, a) in enumerate(CALLS)]}
    prompt = tpl.render(ASK, tools=TOOLS, add_generation_prompt=True)
    full = tpl.render(ASK + [turn], tools=TOOLS, add_generation_prompt=False)
    assert full.startswith(prompt.removesuffix("<think>\n"))
    generated = full[len(prompt):].removesuffix("<|im_end|>\n")
    assert "<function=edit_file>" in generated and "\nFalse\n" in generated  # the template writes Python literals
    deltas = _decode(generated, {"messages": ASK, "tools": TOOLS})
    reasoning, content, calls = _reply(deltas)
    assert reasoning == "The bug is on line 12."
    assert content == "I will fix it, then run the tests."
    assert calls == CALLS
    # OpenAI's streaming order: per call its id and name first, then argument pieces, then the end
    for index in (0, 1):
        kinds = [type(d) for d in deltas if getattr(d, "index", None) == index]
        assert kinds[0] is ToolCallStart and kinds[-1] is ToolCallEnd
        assert set(kinds[1:-1]) == {ToolCallArgs} and len(kinds) - 2 >= 3
    ids = [d.call_id for d in deltas if isinstance(d, ToolCallStart)]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("value, declared, expected", [
    ("123", "path", "123"),  # a declared string stays the text, even when it reads as JSON
    ("true", "path", "true"),
    ("123", "line", 123),
    ("-2.5e1", "ratio", -25.0),
    ("true", "create", True),
    ("True", "create", True),
    ("null", "limit", None),
    ("None", "limit", None),
    ("7", "limit", 7),
    ('{"a": [1, {"b": null}]}', "options", {"a": [1, {"b": None}]}),
    ('["x", 2]', "tags", ["x", 2]),
    ("not json", "line", "not json"),  # unreadable as its type: kept as written
])
def test_parameter_values_are_typed_by_the_schema(value, declared, expected):
    text = (f"<tool_call>\n<function=edit_file>\n<parameter=path>\nb.py\n</parameter>\n"
            f"<parameter={declared}>\n{value}\n</parameter>\n</function>\n</tool_call>")
    _, _, calls = _reply(_decode("\n</think>\n\n" + text, {"messages": ASK, "tools": TOOLS}))
    assert calls == [("edit_file", {"path": "b.py", declared: expected} if declared != "path" else {"path": value})]
    got = calls[0][1][declared]
    assert type(got) is type(expected)


def _accepts(constraint, text: str) -> bool:
    for t in model().tokenizer.encode(text, add_special=False, parse_special=True):
        if not constraint.allowed_mask()[t]:
            return False
        constraint.advance(t)
    return constraint.is_accepting()


CALL = "<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("fields, opening", [
    ({}, "\n</think>\n\n"),  # thinking on: the prompt leaves <think> open, the call closes it first
    ({"reasoning_effort": "none"}, ""),  # thinking off: the prompt closed it
])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "run"}}])
def test_a_forced_call_is_written_after_the_reasoning_block_closes(fields, opening, choice):
    m = model()
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, **fields}
    constraint = lambda: m.prepare(parse_chat_request(body), 4096).params.constraint  # noqa: E731
    assert _accepts(constraint(), opening + CALL)
    if opening:
        assert not _accepts(constraint(), CALL)  # a call inside the reasoning would be lost to the answer
        assert not _accepts(constraint(), "Let me think." + opening + CALL)
    # what the decoder makes of it: no reasoning, one call
    reasoning, content, calls = _reply(_decode(opening + CALL, body))
    assert (reasoning, content, calls) == ("", "", [("run", {"cmd": "ls"})])


def test_a_json_reply_is_written_after_the_reasoning_block_closes():
    m = model()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    prepared = m.prepare(parse_chat_request(body), 4096)
    assert _accepts(prepared.params.constraint, '\n</think>\n\n{"ok": true}')
    assert not _accepts(m.prepare(parse_chat_request(body), 4096).params.constraint, '{"ok": true}')


def test_forced_free_text_on_a_vocabulary_that_spells_the_markup():
    """Qwen's vocabulary has ``</tool_call>`` as a token: a long free-text value must still be
    writable under a large budget (the count with the markup exclusion exhausts llguidance's
    lexer), and a small declared ``maxLength`` stays exact."""
    m = model()
    assert m.tokenizer.encode("</tool_call>", add_special=False, parse_special=True).__len__() == 1
    tools = [{"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20}, "text": {"type": "string"}}, "required": ["title", "text"]}}}]
    body = {"messages": ASK, "tools": tools, "tool_choice": "required", "reasoning_effort": "none",
            "parallel_tool_calls": False}

    def call(title, text):
        return (f"<tool_call>\n<function=note>\n<parameter=title>\n{title}\n</parameter>\n"
                f"<parameter=text>\n{text}\n</parameter>\n</function>\n</tool_call>")
    constraint = lambda: m.prepare(parse_chat_request(body), 8192).params.constraint  # noqa: E731
    text = "def f(x):\n    return '</b>' + x\n" * 20
    assert _accepts(constraint(), call("t" * 20, text))
    assert not _accepts(constraint(), call("t" * 21, text))
    assert not _accepts(constraint(), call("a </function> b", text))  # a short value keeps the exclusion
