"""DeepSeek-V4 served with ``response_format``: the schema goes into the template, the reply is a fenced
json block written through the constrained decoder, and the client gets the JSON.

As llama.cpp's chat layer does for this family: the template's ``response_format`` variable is the
schema (``{}`` for ``json_object``), which its system block asks the model to follow; the reply is
```` ```json ```` … ```` ``` ````, and the message content is the JSON inside. The reference for the
prompt is transformers' renderer of the sdist's template file; the tiny model's random weights write
the JSON, which must validate against the schema (``jsonschema``) and stream in pieces that reassemble
to the non-streamed reply.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_api_real_deepseek4_tools import ASK, _reference, _request
from tests.test_api_real_model import CTX, real_server, sse_chunks

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def test_the_fence_comes_off_however_the_reply_is_cut():
    from hf2q.text.deepseek4_turns import JSON_FENCE, FencedContent

    reply = JSON_FENCE[0] + '{"ok":true}' + JSON_FENCE[1]
    for size in (1, 2, 5, len(reply)):
        f = FencedContent()
        out = "".join(f.feed(reply[i:i + size]) for i in range(0, len(reply), size)) + f.finish()
        assert out == '{"ok":true}'
    f = FencedContent()
    assert f.feed("plain ") + f.feed("text``") + f.finish() == "plain text``"  # no fence: untouched


def test_the_schema_reaches_the_template_as_llama_cpp_passes_it():
    from tests.models.deepseek4_chat import deepseek4_chat_gguf
    from hf2q.api.textbridge import GGUFChatModel

    model = GGUFChatModel.from_gguf(deepseek4_chat_gguf(), "deepseek4")
    want = _reference(ASK, response_format=SCHEMA, thinking=False)
    assert "## Response Format" in want and '"maximum"' in want
    assert model.render(_request(ASK, response_format=AS_SCHEMA, reasoning_effort="none")) == want
    assert model.render(_request(ASK, response_format={"type": "json_object"}, reasoning_effort="none")) == \
        _reference(ASK, response_format={}, thinking=False)
    assert _request(ASK).response_format is None
    assert "Response Format" not in model.render(_request(ASK, reasoning_effort="none"))
    assert model.prepare(_request(ASK, response_format=AS_SCHEMA), CTX).params.constraint is not None


@pytest.mark.slow
async def test_json_replies_validate_and_stream():
    from tests.models.deepseek4_chat import deepseek4_chat_gguf

    async with real_server(slots=1, path=deepseek4_chat_gguf(), model_id="deepseek4") as (url, _rt, _model), \
            httpx.AsyncClient(base_url=url, timeout=600) as c:
        for extra in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": True}}):
            body = {"messages": ASK, "response_format": AS_SCHEMA, "temperature": 0, "max_tokens": 40, **extra}
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()["choices"][0]
            assert out["finish_reason"] == "stop", out
            assert not out["message"].get("reasoning_content")  # the grammar closed the open <think> first
            content = out["message"]["content"]
            jsonschema.validate(json.loads(content), SCHEMA)
            pieces = [ch["choices"][0]["delta"].get("content") or "" async for ch in sse_chunks(c, body)
                      if ch["choices"]]
            assert "".join(pieces) == content and sum(bool(p) for p in pieces) >= 3
        r = await c.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
