"""One chat request through the real server on the tiny DeepSeek-V4 GGUF (the slot runtime, HTTP).

The GGUF is the one ``tests/test_engine_deepseek4.py`` checks against transformers; llama.cpp's
converter embedded DeepSeek-V4's chat template in it. The reply at temperature 0 must be the text of
the greedy tokens the engine gives the rendered prompt directly, and a repeat of the request the
same reply (the second one starts from the slot's cached prefix).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.test_api_real_model import real_server
from tests.test_engine_deepseek4 import deepseek4_gguf

pytestmark = [pytest.mark.slow]

MAX_TOKENS = 6


async def test_chat_reply_is_the_engines_greedy_text():
    from hf2q.api.validation import parse_chat_request
    from hf2q.engine.runner import MlxModelRunner

    gguf_path = deepseek4_gguf()
    body = {"messages": [{"role": "user", "content": "Summarise compressed sparse attention in one line. " * 12}],
            "temperature": 0, "max_tokens": MAX_TOKENS, "chat_template_kwargs": {"enable_thinking": False}}
    async with real_server(slots=2, path=gguf_path, model_id="deepseek4") as (url, _rt, model), \
            httpx.AsyncClient(base_url=url, timeout=600) as c:
        replies = []
        for _ in range(2):
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            replies.append(r.json()["choices"][0]["message"])
        prompt_ids = list(model.prepare(parse_chat_request(body), None).prompt_tokens)
    assert len(prompt_ids) > 128  # the compressed layers are in play
    assert replies[0] == replies[1]  # the repeat starts from the slot's cached prefix
    runner = MlxModelRunner.load(gguf_path)
    seq, ids = runner.new_sequence(), []
    logits = runner.prefill(seq, prompt_ids)
    for _ in range(MAX_TOKENS):
        ids.append(int(np.argmax(logits)))
        logits = runner.decode([seq], [ids[-1]])[0]
    assert replies[0]["content"] == model.decode_tokens(ids)
