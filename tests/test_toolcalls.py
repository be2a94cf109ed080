"""Tool-call parsing against the models' own chat templates.

Reference: each family's official template renders an assistant turn with known
``tool_calls`` (and content); the text after the generation prompt is exactly what the
model would generate. Streaming that text through our parser in random chunks must give
back the same names, the same argument values (byte for byte) and the same content.
Every truncation of it must yield only complete, valid calls plus a truncation flag.
"""

from __future__ import annotations

import json
import random

import pytest

from hf2q.text.call_formats import DSML
from hf2q.text.chat_template import CHATML, ChatTemplate
from hf2q.text.reasoning import prompt_opens_reasoning, split_complete
from hf2q.text.toolcalls import (
    ContentDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallIncomplete,
    ToolCallMalformed,
    ToolCallStart,
    collect,
    detect_syntax,
    generic_tool_instructions,
    make_parser,
    messages_for_generic_template,
    parse_complete,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "search", "description": "Search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    },
]
NASTY = 'Zü"rich\\ \t<x> & 🦙 \u2028 {not json} \'q\''
CALLS = [("get_weather", {"city": NASTY, "days": 3}), ("search", {"q": "a\nb  c"})]

# family template, syntax, end-of-turn markers, assistant header, how many calls a turn may hold
FAMILIES = {
    "Qwen-Qwen3-0.6B": ("qwen", ["<|im_end|>"], "<|im_start|>assistant\n", 2),
    "Qwen3.5-4B": ("qwen_xml", ["<|im_end|>"], "<|im_start|>assistant\n", 2),
    "google-gemma-4-31B-it": ("gemma4", ["<turn|>", "<|tool_response>"], "<|turn>model\n", 2),
    "deepseek-ai-DeepSeek-V4-Flash-0731": ("deepseek", ["<｜end▁of▁sentence｜>"], "<｜Assistant｜>", 2),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3", ["<|eot_id|>"], "<|start_header_id|>assistant<|end_header_id|>\n\n", 1),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3", ["<|eot_id|>"], "<|start_header_id|>assistant<|end_header_id|>\n\n", 1),
}


def _template(name):
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    return ChatTemplate((fetch(LLAMA_CPP_SDIST) / "models" / "templates" / f"{name}.jinja").read_text(), bos_token="<B>", eos_token="<E>")


def _generated_text(tpl, name, calls, content):
    """What the model generates for this assistant turn, per its template."""
    _, ends, header, _ = FAMILIES[name]
    user = [{"role": "user", "content": "question"}]
    turn = {"role": "assistant", "content": content,
            "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]}
    full = tpl.render(user + [turn], tools=TOOLS, add_generation_prompt=False)
    prefix = tpl.render(user, tools=TOOLS, add_generation_prompt=True)
    text = full[len(prefix):] if full.startswith(prefix) else full[full.rindex(header) + len(header):]
    cut = min((text.find(e) for e in ends if e in text), default=len(text))
    text = text[:cut]
    if tpl.thinking_markers:
        opened = full.startswith(prefix) and prompt_opens_reasoning(prefix, *tpl.thinking_markers)
        _, text = split_complete(text, *tpl.thinking_markers, started_in_prompt=opened)
    return text


def _stream(parser, text, rng):
    events, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 7)
        events += parser.feed(text[i:j])
        i = j
    return events + parser.finish()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_detect_syntax(name):
    assert detect_syntax(_template(name).source) == FAMILIES[name][0]


def test_detect_generic_for_chatml():
    from hf2q.fetch import SMOLLM2, fetch

    assert detect_syntax(ChatTemplate.from_gguf(fetch(SMOLLM2)).source) == "generic"
    assert detect_syntax(CHATML) == "generic"


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("content", ["", "Let me check that."])
def test_template_rendered_calls_parse_back(name, content):
    syntax, _, _, max_calls = FAMILIES[name]
    if syntax == "llama3":
        content = ""  # Llama 3 templates drop the content of tool-call turns
    tpl = _template(name)
    calls = CALLS[:max_calls]
    text = _generated_text(tpl, name, calls, content)
    rng = random.Random(name)
    for _ in range(8):
        parser = make_parser(syntax, TOOLS)
        events = _stream(parser, text, rng)
        got_content, got_calls = collect(events)
        assert got_content.strip() == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
        assert not parser.truncated
        ids = [c["id"] for c in got_calls]
        assert len(set(ids)) == len(ids) and all(i.startswith("call_") and len(i) > 10 for i in ids)
        # start before arguments, one start per index
        starts = [e.index for e in events if isinstance(e, ToolCallStart)]
        assert starts == list(range(len(calls)))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_truncation_is_clean(name):
    syntax, _, _, max_calls = FAMILIES[name]
    tpl = _template(name)
    calls = CALLS[:max_calls]
    text = _generated_text(tpl, name, calls, "")
    for cut in range(len(text)):
        content, got, truncated = parse_complete(syntax, text[:cut], TOOLS)
        parsed = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got]
        assert parsed == calls[: len(parsed)]  # only whole, correct calls
        if truncated:
            assert len(parsed) < len(calls) and content.strip() == ""
        elif syntax == "llama3":
            # undecidable prefixes ('{"na') come back as text, never as a half call
            assert parsed == calls or (content == text[:cut].strip() and '"name":' not in content)
        else:
            # between calls: at most the beginning of the next call marker is left as text
            marker = make_parser(syntax).start
            assert marker.startswith(content.strip())


def test_fresh_ids_per_parse():
    text = '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
    a = parse_complete("qwen", text)[1][0]["id"]
    b = parse_complete("qwen", text)[1][0]["id"]
    assert a != b


def test_unparseable_call_is_returned_as_content():
    text = "Hi <tool_call>{broken json</tool_call> bye"
    content, calls, truncated = parse_complete("qwen", text)
    assert calls == [] and not truncated and content == text


def test_truncated_call_reports_incomplete():
    p = make_parser("qwen")
    events = p.feed('Sure.\n<tool_call>\n{"name": "search", "argu')
    events += p.finish()
    # the name went out as soon as it was read; the call never completes
    assert [type(e) for e in events] == [ContentDelta, ToolCallStart, ToolCallIncomplete]
    assert events[0].text == "Sure." and p.truncated
    assert events[1].name == "search" and events[2].index == events[1].index
    assert collect(events) == ("Sure.", [])


def test_content_held_only_while_it_may_be_a_marker():
    p = make_parser("qwen")
    assert p.feed("Hello <tool") == [ContentDelta("Hello")]
    assert p.feed("box>") == [ContentDelta(" <toolbox>")]


def test_llama3_plain_answer_and_call():
    assert parse_complete("llama3", "The capital is Paris.")[:2] == ("The capital is Paris.", [])
    content, calls, _ = parse_complete("llama3", '<|python_tag|>{"name": "search", "parameters": {"q": "é"}}')
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"q": "é"}
    _, _, truncated = parse_complete("llama3", '{"name": "search", "parameters": {"q"')
    assert truncated
    assert parse_complete("llama3", "{braces} in prose")[:2] == ("{braces} in prose", [])


def test_arguments_survive_byte_for_byte():
    args = {"s": NASTY, "n": [1, 2.5, None, True], "o": {"k": "\\u00e9 literal"}}
    for syntax in ("qwen", "generic"):
        text = "<tool_call>" + json.dumps({"name": "f", "arguments": args}, ensure_ascii=False) + "</tool_call>"
        _, calls, _ = parse_complete(syntax, text)
        assert json.loads(calls[0]["function"]["arguments"]) == args
        assert NASTY in calls[0]["function"]["arguments"].replace('\\"', '"').replace("\\\\", "\\").replace("\\t", "\t")


def test_generic_format_on_smollm2_chatml():
    from hf2q.fetch import SMOLLM2, fetch

    tpl = ChatTemplate.from_gguf(fetch(SMOLLM2))
    history = [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Bern\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    msgs = messages_for_generic_template(history, TOOLS, "required")
    prompt = tpl.render(msgs)
    assert generic_tool_instructions(TOOLS, "required") in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Bern"}}</tool_call>' in prompt
    assert "<tool_response>sunny</tool_response>" in prompt
    # the instructed format parses with the generic parser
    p = make_parser("generic")
    ev = p.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Basel"}}</tool_call>') + p.finish()
    assert [type(e) for e in ev] == [ToolCallStart, ToolCallArgsDelta, ToolCallEnd]
    assert json.loads(ev[1].text) == {"city": "Basel"}


# ---------------------------------------------------------------------------- streamed deltas

def _close_positions(syntax, text, n_calls):
    """Where each call's block closes in ``text``: (closing marker's start, its end)."""
    if syntax == "llama3":
        return [(text.rindex("}"), len(text))] * n_calls  # the envelope's own closing brace
    marker = make_parser(syntax).end
    blocks, at = [], 0
    while (k := text.find(marker, at)) >= 0:
        blocks.append((k, k + len(marker)))
        at = k + len(marker)
    return blocks if len(blocks) == n_calls else [blocks[-1]] * n_calls  # DeepSeek: one block, all calls


def _stream_with_offsets(parser, text, rng):
    """Feed random chunks; returns [(chunk's start, chunk's end, event)]."""
    out, i = [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 7))
        out += [(i, j, e) for e in parser.feed(text[i:j])]
        i = j
    return out + [(len(text), len(text) + 1, e) for e in parser.finish()]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_arguments_stream_while_the_call_is_written(name):
    syntax, _, _, max_calls = FAMILIES[name]
    calls = CALLS[:max_calls]
    text = _generated_text(_template(name), name, calls, "" if syntax == "llama3" else "Let me check that.")
    closes = _close_positions(syntax, text, len(calls))
    rng = random.Random("stream " + name)
    for _ in range(12):
        fed = _stream_with_offsets(make_parser(syntax, TOOLS), text, rng)
        events = [e for _, _, e in fed]
        assert not any(isinstance(e, ToolCallMalformed) for e in events)
        _, got = collect(events)
        for i, ((fn, args), close) in enumerate(zip(calls, closes, strict=True)):
            final = got[i]["function"]["arguments"]
            assert json.loads(final) == args
            if syntax in ("qwen_xml", "deepseek", "gemma4"):  # markup: built as json.dumps writes it
                assert final == json.dumps(args, ensure_ascii=False)
            else:  # JSON: the model's own text, character for character
                assert final in text
            deltas = [(a, b, e.text) for a, b, e in fed if isinstance(e, ToolCallArgsDelta) and e.index == i]
            start_at = next(b for _, b, e in fed if isinstance(e, ToolCallStart) and e.index == i)
            end_at = next(b for _, b, e in fed if isinstance(e, ToolCallEnd) and e.index == i)
            # every piece went out before the closing marker began (nothing waits for it, and
            # the concatenation is exactly the arguments: nothing of the marker leaked); the
            # call completes only once all of the marker is fed
            assert all(a < close[0] for a, _, _ in deltas)
            assert end_at >= close[1] and start_at <= deltas[0][1]
            # and they come piece by piece, inside a string value too
            assert len(deltas) >= 3
            if fn == "get_weather":
                mid = text.index("'q'")  # 15 characters after the llama inside the city
                assert any("🦙" in "".join(t for _, b2, t in deltas if b2 <= b) for _, b, _ in deltas if b <= mid)


@pytest.mark.parametrize("body", [
    '{"arguments": {"q": "x"}, "name": "search"}',  # arguments before the name
    '[{"name": "search", "arguments": {"q": "x"}}, {"name": "get_weather", "arguments": {"city": "Bern"}}]',
    '{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}',  # arguments as a string of JSON
    '{"name": "search"}',  # no arguments
    '{"name": "search", "parameters": {"q": [1, 2.5e3, -0, true, null, {}]}}',
    '{"name": "search", "arguments": {"q": NaN}}',  # Python's reader takes it, strict JSON does not
    '{"name": "search", "arguments": {"q": "x",}}',  # broken after the start went out
    '{"name": "search", "arguments": {"q": "x"}} trailing',
    '{"name": 3, "arguments": {}}',
    ' {"name" : "search" , "arguments" : { "q" : "x" } } ',
])
def test_odd_json_blocks_end_as_the_whole_block_reader_says(body):
    from hf2q.text.call_formats import BadCall, json_call

    try:
        expected = [(n, a) for n, a in json_call(body.strip())]
    except BadCall:
        expected = None
    text = "Hi <tool_call>" + body + "</tool_call>"
    rng = random.Random(body)
    for _ in range(5):
        events = _stream(make_parser("qwen"), text, rng)
        content, got = collect(events)
        if expected is None:
            assert got == [] and content == text
        else:
            assert content == "Hi"
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == expected
        assert sum(isinstance(e, ToolCallEnd) for e in events) == len(got)  # one end per call


def test_a_call_cut_inside_its_arguments_went_out_in_part_and_never_completes():
    p = make_parser("generic")
    events = p.feed('<tool_call>{"name": "write_file", "arguments": {"path": "a.py", "text": "line one\\nline')
    events += p.finish()
    kinds = [type(e) for e in events]
    assert kinds[0] is ToolCallStart and kinds[-1] is ToolCallIncomplete and ToolCallEnd not in kinds
    assert "".join(e.text for e in events if isinstance(e, ToolCallArgsDelta)) == \
        '{"path": "a.py", "text": "line one\\nline'
    assert collect(events) == ("", []) and p.truncated


@pytest.mark.parametrize("syntax, text", [
    ("qwen_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern</parameter>\n"
                 "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Bern<|"|>,opts:{a:[1,<|"|>x<|"|>,true],b:none},days:2}'
               "<tool_call|>"),
    ("deepseek", "<" + DSML + "tool_calls>\n<" + DSML + 'invoke name="get_weather">\n<' + DSML
                 + 'parameter name="opts" string="false">{"a": [1]}</' + DSML + "parameter>\n</" + DSML
                 + "invoke>\n</" + DSML + "tool_calls>"),
])
def test_markup_values_of_other_types_stream_as_json(syntax, text):
    whole = parse_complete(syntax, text, TOOLS)
    for seed in range(5):
        events = _stream(make_parser(syntax, TOOLS), text, random.Random(seed))
        assert not any(isinstance(e, ToolCallMalformed) for e in events)
        content, calls = collect(events)
        assert (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]) == \
            (whole[0], [(c["function"]["name"], c["function"]["arguments"]) for c in whole[1]])
        assert sum(isinstance(e, ToolCallArgsDelta) for e in events) >= 3
