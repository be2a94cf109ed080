"""Switching ``tool_choice`` between turns keeps the prompt prefix cached (SmolLM2, generic tools).

SmolLM2's ChatML template has no tool syntax, so the server teaches the generic
``<tool_call>`` format in the system block. That block must not depend on ``tool_choice``:
an agent that alternates auto / required / a named tool / none over the same conversation
should have the whole conversation served from its slot, recomputing only the short
choice note and the generation prompt. Real engine, real HTTP server, openai-style requests;
the expected shared length is counted with transformers' tokenizer built from the same GGUF.
"""

from __future__ import annotations

import os

import httpx
import pytest

from hf2q.api.validation import parse_chat_request
from tests.test_api_real_model import TOOLS, real_server

pytestmark = [pytest.mark.slow]

CHOICES = ["auto", "required", {"type": "function", "function": {"name": "read_file"}}, "none"]


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You are a coding agent. The project is a small HTTP server in src/."},
        {"role": "user", "content": "Open the main file so we can review it."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "src/main.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "def main():\n    serve(port=8080)\n"},
        {"role": "user", "content": "Which port does it listen on, and where is serve() defined? Check if needed."},
    ]


def hf_token_count(text: str) -> int:
    from transformers import AutoTokenizer

    from hf2q.fetch import default_chat_model

    path = default_chat_model()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return len(tok(text, add_special_tokens=False)["input_ids"])


async def test_tool_choice_changes_keep_the_whole_conversation_cached():
    bodies = [{"model": "smollm2", "messages": conversation(), "tools": TOOLS, "tool_choice": choice,
               "temperature": 0, "max_tokens": 4} for choice in CHOICES]
    async with real_server(slots=1) as (url, _runtime, model), httpx.AsyncClient(base_url=url, timeout=900) as c:
        texts = [model.render(parse_chat_request(b)) for b in bodies]
        # what all four prompts share as text reaches past the conversation's last user words
        shared_text = os.path.commonprefix(texts)
        assert conversation()[-1]["content"] in shared_text
        assert all('"name": "read_file"' in t for t in texts)  # the tools are taught every time, "none" too
        shared = hf_token_count(shared_text)
        first = await c.post("/v1/chat/completions", json=bodies[0])
        assert first.status_code == 200, first.text
        for body in bodies[1:]:
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            # only the choice note and the generation prompt are computed again (2 tokens of slack
            # for a BPE merge across the cut of the text prefix)
            assert u["prompt_tokens_details"]["cached_tokens"] >= shared - 2, (body["tool_choice"], u, shared)
            assert u["prompt_tokens"] - shared <= 24, u
