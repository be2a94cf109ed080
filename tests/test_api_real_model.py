"""The headline scenario on the REAL engine: a real model behind the real runtime and a real HTTP server.

Four agent-style conversations run concurrently on four slots, each with tools and a system
context of its own (~6 KB; the issue's scenario has ~20 KB, see ``NOTES_BYTES``), on SmolLM2 and on a
tiny Qwen 3.5 GGUF (hybrid recurrent layers, the official Qwen3.5 template and its XML calls):

1. cold: each asks for a tool call (``tool_choice`` names the function, temperature 0); the
   prompts went in as bounded prefill transactions (``PREFILL_CHUNK``) and some steps mixed
   decode rows with a prefill chunk;
2. repeated verbatim: the answer is identical and, where the family reuses any prefix
   (SmolLM2), ``cached_tokens >= prompt_tokens - 32`` (each conversation went back to the slot
   that holds its prefix);
3. streamed: the SSE tool-call deltas (id/type/name first, then argument pieces) reassemble
   to the same call;
4. continued with a tool result: the new turn reuses the conversation's prefix (SmolLM2);
5. cancelled: streams closed after their first frames end as cancelled, the slots come back
   idle, and a cancelled slot answers as before.

References are independent of the server: the prompt token count is recomputed with
``transformers``' tokenizer (built from the same GGUF, or for the tiny Qwen 3.5 from the
checkpoint's own tokenizer files), and the tool call's arguments must be JSON that matches the
tool's schema.
"""

from __future__ import annotations

import json
import os
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from hf2q.api.validation import parse_chat_request

pytestmark = [pytest.mark.slow]

CTX = 8192
#: bytes of project notes per conversation (~1.3k tokens each): long enough that every prompt takes several
#: prefill transactions (``PREFILL_CHUNK``) and mixes with the other slots' decode rows, which is what the
#: assertions need; the issue's ~20 KB scenario is ``HF2Q_TEST_NOTES_BYTES=20000`` (the assertions hold at any size).
NOTES_BYTES = int(os.environ.get("HF2Q_TEST_NOTES_BYTES", "6000"))
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project and return its text.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "file path",
                                                             "maxLength": 40}},
                   "required": ["path"], "additionalProperties": False}}}]


def project_notes(i: int, n_bytes: int = NOTES_BYTES) -> str:
    """~20 KB of distinct, readable project notes for conversation ``i``."""
    modules = ["parser", "scheduler", "cache", "server", "tokenizer", "sampler", "loader", "writer"]
    lines, k = [], 0
    while sum(len(x) + 1 for x in lines) < n_bytes:
        m = modules[(k + i) % len(modules)]
        lines.append(f"- Note {k} for project {i}: the {m} module keeps state in src/{m}_{k % 13}.py and "
                     f"is tested by tests/test_{m}.py; owner team {chr(65 + (k * 7 + i) % 26)}.")
        k += 1
    return "\n".join(lines)


def conversation(i: int) -> list[dict]:
    return [{"role": "system", "content": "You are a coding agent working on a project. Project notes:\n"
                                          + project_notes(i)},
            {"role": "user", "content": f"Open the main file of project {i} so we can review it."}]


@asynccontextmanager
async def real_server(slots: int = 4, path=None, model_id: str = "smollm2", **config):
    """A real ``hf2q serve`` on ``path`` (default: the built-in default model, SmolLM2); yields
    ``(url, runtime, chat model)``. ``config``: further ``RuntimeConfig`` fields."""
    from hf2q.sched.contracts import RuntimeConfig
    from hf2q.actors.runtime import open_runtime
    from hf2q.api.app import ServerContext
    from hf2q.api.command import runner_factory
    from hf2q.api.server import serve
    from hf2q.api.textbridge import GGUFChatModel
    from hf2q.fetch import default_chat_model

    path = default_chat_model() if path is None else path
    model = GGUFChatModel.from_gguf(path, model_id)
    config = RuntimeConfig(slots=slots, ctx=CTX, queue_capacity=8, gpu_deadline_s=600, **config)
    async with open_runtime(runner_factory(path, CTX), config) as runtime, trio.open_nursery() as nursery:
        assert await runtime.wait_ready(), runtime.readiness()
        ctx = ServerContext(runtime=runtime, chat_model=model, model_id=model_id)
        handle = await nursery.start(lambda task_status: serve(ctx, "127.0.0.1", 0, graceful_timeout=1,
                                                               task_status=task_status))
        try:
            yield handle.url, runtime, model
        finally:
            handle.request_stop()
            with trio.move_on_after(30):
                await handle.closed.wait()
            nursery.cancel_scope.cancel()


def request(i: int, model_id: str = "smollm2", **extra) -> dict:
    return {"model": model_id, "messages": conversation(i), "tools": TOOLS, "temperature": 0, "max_tokens": 64,
            "tool_choice": {"type": "function", "function": {"name": "read_file"}}, **extra}


#: prefill transaction size of the four-agent test: each ~1.3k-token prompt takes several
PREFILL_CHUNK = 384


def _family(name: str):
    """(GGUF path, independent HF tokenizer, slack of a repeated prompt's cached tokens) per family.

    SmolLM2 reuses any prefix: a repeat is served from the slot's KV within 32 tokens. Qwen 3.5's
    recurrent state goes back only to its reuse points, one every 256 tokens and one at each prefill
    transaction's end (docs/ENGINE.md, "Hybrid recurrent state"): within 256 tokens.
    """
    from transformers import AutoTokenizer

    from hf2q.fetch import default_chat_model

    if name == "smollm2":
        path = default_chat_model()
        return path, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), 32
    from tests.models.qwen35_chat import qwen35_chat_gguf
    from tests.models.tokenizer_files import tokenizer_dir

    return qwen35_chat_gguf(), AutoTokenizer.from_pretrained(tokenizer_dir("qwen3")), 256


async def post_all(c: httpx.AsyncClient, bodies: list[dict]) -> list[dict]:
    out: list = [None] * len(bodies)

    async def one(k):
        r = await c.post("/v1/chat/completions", json=bodies[k])
        assert r.status_code == 200, r.text
        out[k] = r.json()

    async with trio.open_nursery() as n:
        for k in range(len(bodies)):
            n.start_soon(one, k)
    return out


async def sse_chunks(c: httpx.AsyncClient, body: dict):
    """The parsed ``data:`` chunks of a streamed chat completion, as they arrive (no error frame)."""
    async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            assert "error" not in ch, ch
            yield ch


async def stream_call(c: httpx.AsyncClient, body: dict) -> tuple[list[dict], str]:
    deltas, finish = [], None
    async for ch in sse_chunks(c, body):
        for choice in ch["choices"]:
            deltas.extend(choice["delta"].get("tool_calls") or [])
            finish = choice["finish_reason"] or finish
    return deltas, finish


@pytest.mark.parametrize("family", ["smollm2", "qwen35"])
async def test_four_agent_conversations_cached_streamed_and_continued(family):
    path, hf_tok, slack = _family(family)
    async with real_server(path=path, model_id=family, prefill_chunk=PREFILL_CHUNK) as (url, runtime, model), \
            httpx.AsyncClient(base_url=url, timeout=900) as c:
        bodies = [request(i, family) for i in range(4)]
        cold = await post_all(c, bodies)
        calls = []
        for i, out in enumerate(cold):
            ch = out["choices"][0]
            assert ch["finish_reason"] == "tool_calls", ch
            (call,) = ch["message"]["tool_calls"]
            assert call["function"]["name"] == "read_file" and call["id"].startswith("call_")
            args = json.loads(call["function"]["arguments"])
            assert isinstance(args.get("path"), str) and args["path"]
            calls.append(call)
        rendered = model.render(parse_chat_request(bodies[0]))
        assert cold[0]["usage"]["prompt_tokens"] == len(hf_tok(rendered, add_special_tokens=False)["input_ids"])
        assert all(out["usage"]["prompt_tokens"] > NOTES_BYTES // 5 for out in cold)  # the notes reached the model
        # bounded prefill: every prompt went in as transactions of at most PREFILL_CHUNK tokens, and
        # decode-first steps mixed the first replies' decode rows with the later prompts' chunks
        counters = runtime.snapshot().counters
        assert counters["prefill_transactions"] >= sum(-(-out["usage"]["prompt_tokens"] // PREFILL_CHUNK)
                                                       for out in cold)
        assert counters["decode_batches"] + counters["prefill_transactions"] > counters["gpu_steps"]  # mixed steps

        # 2. repeated: identical output, prompt served from each conversation's slot
        again = await post_all(c, bodies)
        for out, first, call in zip(again, cold, calls):
            u = out["usage"]
            (call2,) = out["choices"][0]["message"]["tool_calls"]
            assert call2["function"] == call["function"]
            assert call2["id"] != call["id"]  # fresh ids per response
            if slack is not None:
                assert u["prompt_tokens_details"]["cached_tokens"] >= u["prompt_tokens"] - slack, u
                assert out["x_hf2q_timing"]["time_to_first_token_ms"] < first["x_hf2q_timing"][
                    "time_to_first_token_ms"]

        # 3. streamed (all four at once): deltas reassemble to the same call
        streamed: list = [None] * 4

        async def stream_one(k):
            streamed[k] = await stream_call(c, bodies[k])

        async with trio.open_nursery() as n:
            for k in range(4):
                n.start_soon(stream_one, k)
        for i in range(4):
            deltas, finish = streamed[i]
            assert finish == "tool_calls"
            assert deltas[0]["index"] == 0 and deltas[0]["type"] == "function" and deltas[0]["id"].startswith("call_")
            assert deltas[0]["function"]["name"] == "read_file"
            assert all("name" not in d["function"] for d in deltas[1:])
            assert "".join(d["function"].get("arguments", "") for d in deltas) == calls[i]["function"]["arguments"]

        # 4. continued with a tool result (tool_choice back to auto): the conversation's prefix is reused
        follow = []
        for i in range(4):
            msgs = conversation(i) + [
                {"role": "assistant", "content": None, "tool_calls": [calls[i]]},
                {"role": "tool", "tool_call_id": calls[i]["id"], "content": "def main():\n    return 42\n"}]
            follow.append({"model": family, "messages": msgs, "tools": TOOLS, "temperature": 0,
                           "max_tokens": 16, "tool_choice": "auto"})
        cont = await post_all(c, follow)
        for out, first, body, body4 in zip(cont, cold, bodies, follow):
            u = out["usage"]
            # what the two turns share, token for token (auto and forced differ only in the last instruction line)
            p1 = model.prepare(parse_chat_request(body), CTX).prompt_tokens
            p4 = model.prepare(parse_chat_request(body4), CTX).prompt_tokens
            assert len(p4) == u["prompt_tokens"] and len(p1) == first["usage"]["prompt_tokens"]
            shared = len(os.path.commonprefix([list(p1), list(p4)]))
            assert shared > 0.9 * len(p1)
            if slack is not None:
                assert u["prompt_tokens_details"]["cached_tokens"] >= shared - slack, (u, shared)
            ch = out["choices"][0]
            assert ch["finish_reason"] in ("stop", "length", "tool_calls")
            for call in ch["message"].get("tool_calls", []):
                json.loads(call["function"]["arguments"])
        snap = runtime.snapshot()
        assert all(s.phase == "idle" for s in snap.slots)

        # 5. cancellation: four streams left after their first frames end as cancelled, the slots
        # come back idle, and a slot left mid-reply still answers exactly as before
        async def leave_early(k):
            async with c.stream("POST", "/v1/chat/completions", json={**bodies[k], "stream": True,
                                                                      "tool_choice": "auto", "max_tokens": 256}) as r:
                frames = 0
                async for line in r.aiter_lines():
                    frames += line.startswith("data: ")
                    if frames == 3:  # the role frame, then two of the reply's
                        break

        async with trio.open_nursery() as n:
            for k in range(4):
                n.start_soon(leave_early, k)
        with trio.fail_after(120):
            while any(s.phase != "idle" for s in runtime.snapshot().slots):
                await trio.sleep(0.05)
        assert runtime.snapshot().counters["cancelled"] >= 1
        after = await post_all(c, bodies[:1])
        (call3,) = after[0]["choices"][0]["message"]["tool_calls"]
        assert call3["function"] == calls[0]["function"]


async def test_json_schema_response_and_stop_strings_on_the_real_model():
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    async with real_server(slots=2) as (url, _runtime, _model), httpx.AsyncClient(base_url=url, timeout=900) as c:
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        r = await c.post("/v1/chat/completions", json={
            "messages": ask, "temperature": 0, "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
        out = r.json()["choices"][0]
        assert out["finish_reason"] == "stop", out
        obj = json.loads(out["message"]["content"])
        assert set(obj) == {"city", "is_capital"} and isinstance(obj["is_capital"], bool)
        assert isinstance(obj["city"], str) and len(obj["city"]) <= 20
        # greedy answer, then the same request cut by a stop string inside it
        plain = (await c.post("/v1/chat/completions", json={"messages": ask, "temperature": 0,
                                                             "max_tokens": 12})).json()
        text = plain["choices"][0]["message"]["content"]
        assert "Paris" in text  # SmolLM2's known greedy answer (MODELS.md)
        cut = (await c.post("/v1/chat/completions", json={"messages": ask, "temperature": 0, "max_tokens": 12,
                                                           "stop": ["Paris"]})).json()
        assert cut["choices"][0]["message"]["content"] == text[: text.index("Paris")]
        assert cut["choices"][0]["finish_reason"] == "stop"
