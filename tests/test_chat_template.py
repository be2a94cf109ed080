"""Chat templates render exactly what transformers' ``apply_chat_template`` renders.

The official templates shipped in the llama.cpp sdist (Qwen3, Qwen3.5, Gemma 4,
DeepSeek-V4-Flash, Llama 3.1/3.2/3.3) and SmolLM2's ChatML from its GGUF, over
conversations with tools, tool calls and results, multi-turn, reasoning, thinking on/off
and with/without the generation prompt.
"""

from __future__ import annotations

import copy
import json

import pytest

from hf2q.errors import InputError
from hf2q.text.chat_template import CHATML, ChatTemplate, parse_tool_call_arguments

TEMPLATES = [
    "Qwen-Qwen3-0.6B",
    "Qwen3.5-4B",
    "google-gemma-4-31B-it",
    "deepseek-ai-DeepSeek-V4-Flash-0731",
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct",
]
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Zürich\" <b>"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
ARGS = {"city": "Zürich & <Genève>", "days": 3}

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi there!"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Quote: \"x\" 'y' </s> ünïcödé"},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "name": "get_weather", "content": "{\"temp\": 21}"},
    ],
    "parallel_calls": [  # Llama 3.x refuses this with raise_exception: both sides must refuse
        {"role": "user", "content": "Weather in Bern and Basel?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}},
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Basel"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain\nand wind"},
    ],
    "reasoning_history": [
        {"role": "user", "content": "Think first: 7*6?"},
        {"role": "assistant", "content": "42", "reasoning_content": "7 times 6 is 42."},
        {"role": "user", "content": "Thanks. Now 6*7?"},
    ],
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from tests.models.tokenizer_files import tokenizer_dir

    return AutoTokenizer.from_pretrained(tokenizer_dir("smollm2"))


def _template_source(name: str) -> str:
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    return (fetch(LLAMA_CPP_SDIST) / "models" / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def _hf_render(hf, source, messages, tools, add_generation_prompt, **kwargs):
    return hf.apply_chat_template(
        copy.deepcopy(messages),
        tools=copy.deepcopy(tools),
        chat_template=source,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        bos_token=BOS,
        eos_token=EOS,
        **kwargs,
    )


CASES = [
    (conv, tools, agp, kw)
    for conv in CONVERSATIONS
    for tools in (None, [WEATHER_TOOL])
    for agp in (True, False)
    for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True})
    if not (conv in ("tool_round_trip", "parallel_calls") and tools is None)
]


@pytest.mark.parametrize("name", TEMPLATES)
def test_official_templates_match_transformers(name, hf_tokenizer):
    source = _template_source(name)
    ours = ChatTemplate(source, bos_token=BOS, eos_token=EOS)
    compared = 0
    for conv, tools, agp, kw in CASES:
        messages = CONVERSATIONS[conv]
        try:
            expected = _hf_render(hf_tokenizer, source, messages, tools, agp, **kw)
        except Exception as exc:  # noqa: BLE001 - the template itself refuses this conversation
            with pytest.raises(InputError):
                ours.render(messages, tools=tools, add_generation_prompt=agp, **kw)
            assert "raise" in source or exc
            continue
        got = ours.render(messages, tools=tools, add_generation_prompt=agp, **kw)
        assert got == expected, (conv, tools is not None, agp, kw)
        compared += 1
    assert compared >= len(CASES) // 2


def test_smollm2_chatml_from_gguf(hf_tokenizer):
    from hf2q.fetch import SMOLLM2, fetch

    ours = ChatTemplate.from_gguf(fetch(SMOLLM2))
    assert ours.special_tokens["eos_token"] == "<|im_end|>"
    for conv in ("single", "system_multi_turn"):
        for agp in (True, False):
            expected = hf_tokenizer.apply_chat_template(CONVERSATIONS[conv], add_generation_prompt=agp, tokenize=False)
            assert ours.render(CONVERSATIONS[conv], add_generation_prompt=agp) == expected
    assert ours.render(CONVERSATIONS["single"]).endswith("<|im_start|>assistant\n")


def test_tojson_keeps_html_and_unicode():
    t = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}")
    x = {"a": "<b>&'é\"", "n": [1, 2]}
    assert t.render([], add_generation_prompt=False, x=x) == json.dumps(x, ensure_ascii=False) + "|" + json.dumps(
        x, ensure_ascii=False, indent=2
    )


def test_loopcontrols_and_trim_blocks():
    t = ChatTemplate("{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}\n{% endfor %}")
    msgs = [{"role": "user", "content": c} for c in "abcd"]
    assert t.render(msgs) == "a\nb\n"


def test_raise_exception_is_input_error():
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InputError, match="roles must alternate"):
        t.render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_escapes():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InputError):
        t.render([])
    t = ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(InputError):
        t.render([])


def test_syntax_error_and_missing_template():
    with pytest.raises(InputError, match="does not compile"):
        ChatTemplate("{% for %}")
    from hf2q.fetch import GEMMA3_270M, fetch

    with pytest.raises(InputError, match="no chat template"):
        ChatTemplate.from_gguf(fetch(GEMMA3_270M))
    fallback = ChatTemplate.from_gguf(fetch(GEMMA3_270M), fallback=CHATML)
    assert fallback.special_tokens["bos_token"] == "<bos>"
    assert fallback.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_parse_tool_call_arguments():
    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{\"a\": 1}"}},
                                                  {"function": {"name": "g", "arguments": "not json"}}]}]
    out = parse_tool_call_arguments(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == "{\"a\": 1}"  # caller's data untouched


def test_thinking_markers():
    assert ChatTemplate(_template_source("Qwen-Qwen3-0.6B")).thinking_markers == ("<think>", "</think>")
    assert ChatTemplate(_template_source("google-gemma-4-31B-it")).thinking_markers == ("<|channel>", "<channel|>")
    assert ChatTemplate(CHATML).thinking_markers is None


MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("source, says", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "looped more than"),
    ("{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}",
     "looped more than"),
    ("{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}", "produced more than"),
    ("{{ 'x' * 10**10 }}", "would build more than"),
    ("{{ (messages * 100000000) | length }}", "would build more than"),
    ("{{ 2 ** 1000000000 }}", "would build more than"),
], ids=["nested-range", "nested-request-list", "output", "string-repeat", "list-repeat", "power"])
def test_a_runaway_template_stops_within_its_budget(source, says):
    import time

    msgs = MSGS * 200  # 200³ iterations for the nested loop over the request
    t = time.perf_counter()
    with pytest.raises(InputError, match=says):
        ChatTemplate(source).render(msgs)
    assert time.perf_counter() - t < 10


def test_the_time_budget_ends_a_slow_render():
    import time

    slow = "{% for i in range(100000) %}{% for m in messages %}{{ m.role|upper }}{% endfor %}{% endfor %}"
    t = time.perf_counter()
    with pytest.raises(InputError, match="budget"):
        ChatTemplate(slow, time_budget_s=0.2).render(MSGS * 5)
    assert time.perf_counter() - t < 3


def test_budgeted_ranges_and_lists_behave_as_plain_ones():
    src = ("{{ range(3)|list }}{{ range(5)|length }}{% for i in range(3)|reverse %}{{ i }}{% endfor %}"
           "{{ range(10)[2] }}{{ 3 in range(5) }}{% for i in range(2, 8, 3) %}{{ loop.index }}{{ loop.last }}{% endfor %}"
           "{{ messages[1:]|length }}{{ (messages + messages)|length }}{{ messages[-1].content }}"
           "{% for m in messages[:1] %}{{ m.role }}{% endfor %}{{ messages|selectattr('role', 'eq', 'user')|list|length }}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    reference = ImmutableSandboxedEnvironment().from_string(src).render(messages=msgs)
    assert ChatTemplate(src).render(msgs) == reference == "[0, 1, 2]52102True1False2True14buser1"
