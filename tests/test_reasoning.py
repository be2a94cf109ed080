"""Streaming reasoning splitter.

References: (1) the model's own chat template — a past assistant turn rendered with
``reasoning_content`` R and ``content`` C must split back into exactly (R, C); (2) the
same completion fed whole and in random chunks must split identically.
"""

from __future__ import annotations

import random

import pytest

from hf2q.text.chat_template import ChatTemplate
from hf2q.text.reasoning import (
    ReasoningSplitter,
    prompt_opens_reasoning,
    split_complete,
    splitter_for,
)


def _template(name):
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    return ChatTemplate((fetch(LLAMA_CPP_SDIST) / "models" / "templates" / f"{name}.jinja").read_text())


def _stream(splitter, text, rng):
    r, c, i = [], [], 0
    while i < len(text):
        j = i + rng.randint(1, 5)
        a, b = splitter.feed(text[i:j])
        r.append(a)
        c.append(b)
        i = j
    a, b = splitter.finish()
    return "".join(r) + a, "".join(c) + b


REASONINGS = ["7 times 6 is 42.", "Line one.\n\nLine two with </thin and <think", "x"]
ANSWERS = ["42", "The answer:\n\n```\ncode\n```", "<b>ok</b> 🦙"]


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "Qwen3.5-4B"])
def test_template_rendered_turn_splits_back(name):
    tpl = _template(name)
    rng = random.Random(0)
    for reasoning in REASONINGS:
        for answer in ANSWERS:
            msgs = [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": answer, "reasoning_content": reasoning},
            ]
            rendered = tpl.render(msgs, add_generation_prompt=False)
            head = tpl.render(msgs[:1], add_generation_prompt=True, enable_thinking=True)
            # the assistant turn as the model would have generated it after the prompt
            start = rendered.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
            completion = rendered[start:].rsplit("<|im_end|>", 1)[0]
            opened = prompt_opens_reasoning(head)
            if opened:
                completion = completion.split("<think>", 1)[1]
            for _ in range(5):
                got = _stream(ReasoningSplitter(started_in_prompt=opened), completion, rng)
                assert got == (reasoning, answer)


def test_qwen35_prompt_opens_block():
    tpl = _template("Qwen3.5-4B")
    on = tpl.render([{"role": "user", "content": "hi"}], enable_thinking=True)
    off = tpl.render([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert prompt_opens_reasoning(on) and not prompt_opens_reasoning(off)
    splitter = splitter_for(tpl, on)
    assert splitter is not None and splitter.in_reasoning


def test_gemma4_channel_markers():
    tpl = _template("google-gemma-4-31B-it")
    prompt_off = tpl.render([{"role": "user", "content": "hi"}])
    splitter = splitter_for(tpl, prompt_off)
    assert splitter is not None and not splitter.in_reasoning  # the empty thought block is closed in the prompt
    s = ReasoningSplitter("<|channel>", "<channel|>")
    got = _stream(s, "<|channel>thought\nWeigh options.\n<channel|>Answer.", random.Random(1))
    assert got == ("Weigh options.", "Answer.")


@pytest.mark.parametrize("seed", range(20))
def test_chunking_never_changes_the_split(seed):
    rng = random.Random(seed)
    pieces = ["<think>", "\n", "abc", "</think>", "\n\n", "<", "/", "think", ">", "x", " ", "<thi", "nk>", "y\n"]
    text = "".join(rng.choice(pieces) for _ in range(25))
    whole = split_complete(text)
    assert _stream(ReasoningSplitter(), text, rng) == whole
    assert _stream(ReasoningSplitter(), text, random.Random(seed + 100)) == whole


def test_no_reasoning_passes_content_through():
    assert split_complete("  Hello <b>") == ("", "  Hello <b>")
    assert split_complete("<thinker>") == ("", "<thinker>")


def test_truncated_reasoning_is_kept():
    assert split_complete("<think>\nhalf a thou") == ("half a thou", "")
    assert split_complete("still thinking", started_in_prompt=True) == ("still thinking", "")


def test_partial_marker_is_held_back():
    s = ReasoningSplitter()
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>\nidea</th") == ("idea", "")
    assert s.feed("ink>\n\nDone") == ("", "Done")


@pytest.mark.parametrize(("name", "kwargs", "opened"), [
    ("deepseek-ai-DeepSeek-V4-Flash-0731", {"enable_thinking": True}, True),
    ("deepseek-ai-DeepSeek-V4-Flash-0731", {"enable_thinking": False}, False),
    ("Qwen-Qwen3-0.6B", {"enable_thinking": True}, False),  # Qwen3 writes <think> itself
    ("Qwen-Qwen3-0.6B", {"enable_thinking": False}, False),
    ("google-gemma-4-31B-it", {"enable_thinking": True}, False),
])
def test_prompt_state_per_template(name, kwargs, opened):
    tpl = _template(name)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for with_tools in (None, tools):  # tool instructions may mention the markers themselves
        prompt = tpl.render([{"role": "user", "content": "hi"}], tools=with_tools, **kwargs)
        assert splitter_for(tpl, prompt).in_reasoning is opened


@pytest.mark.parametrize(("name", "expected"), [
    ("Qwen3.5-4B", "\n</think>\n\n"),  # what the template itself writes for an empty block
    ("deepseek-ai-DeepSeek-V4-Flash-0731", None),  # thinking off is not a continuation: the end marker
])
def test_the_closing_of_a_block_the_prompt_opened(name, expected):
    from hf2q.text.reasoning import closing_text

    tpl = _template(name)
    user = [{"role": "user", "content": "hi"}]
    on = tpl.render(user, add_generation_prompt=True, enable_thinking=True)
    off = tpl.render(user, add_generation_prompt=True, enable_thinking=False)
    start, end = tpl.thinking_markers
    assert prompt_opens_reasoning(on, start, end)
    closing = closing_text(on, off, end)
    assert closing == (end if expected is None else expected)
    # a reply that begins with it has no reasoning and keeps its answer whole
    assert split_complete(closing + "<b>ok</b>", start, end, started_in_prompt=True) == ("", "<b>ok</b>")
    if expected is not None:
        assert on + closing == off  # the constrained reply continues the prompt as thinking-off would
