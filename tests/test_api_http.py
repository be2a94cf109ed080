"""The HTTP surface (docs/API.md) over a real Hypercorn server on an ephemeral 127.0.0.1 port.

The runtime is the real actor system driven by a fake ModelRunner where available
(``tests/fakes``); the text side is a small scripted ``ChatModel`` so each rule of the
HTTP contract is checked in isolation: auth on every route, CORS, request ids, malformed
JSON and wrong types → 400 naming the field, unknown route 404, queue full → 429 +
Retry-After, impossible request → 400, SSE framing and keep-alives, tool-call deltas,
disconnect cancels, injected GPU fault → one terminal error each, /readyz 503,
/health 200, new work 503. Clients: httpx and the official ``openai`` SDK.
"""

from __future__ import annotations

import functools
import time
import json

import httpx
import openai
import pytest
import trio
from test_api_support import (
    open_test_server,
    sse_events,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


async def test_health_readyz_models_and_request_ids():
    async with open_test_server() as srv, httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert r.headers["x-request-id"].startswith("req-")
        r = await c.get("/readyz", headers={"x-request-id": "abc-123"})
        assert r.status_code == 200 and r.json()["ready"] is True
        assert r.headers["x-request-id"] == "abc-123"
        r = await c.get("/v1/models")
        assert [m["id"] for m in r.json()["data"]] == ["scripted"]
        assert (await c.get("/v1/models/scripted")).json()["id"] == "scripted"
        r = await c.get("/v1/models/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await c.get("/no/such/route")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        # an unsafe request id is replaced, not echoed
        r = await c.get("/health", headers={"x-request-id": "bad id\twith spaces"})
        assert r.headers["x-request-id"].startswith("req-")


async def test_chat_non_streamed_shape_usage_and_timing():
    async with open_test_server() as srv, httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "unknown_field": {"x": 1}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == srv.model.expected_text(8)
        assert choice["finish_reason"] == "length"
        u = body["usage"]
        assert u["completion_tokens"] == 8
        assert u["prompt_tokens"] == len(srv.model.last_prompt)
        assert u["total_tokens"] == u["prompt_tokens"] + 8
        assert u["prompt_tokens_details"]["cached_tokens"] >= 0
        t = body["x_hf2q_timing"]
        assert t["time_to_first_token_ms"] > 0 and t["decode_tokens_per_sec"] >= 0


WRONG = [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "temperature": True}, "temperature"),
    ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "stop": [1, 2]}, "stop"),
    ({**CHAT, "tools": {"type": "function"}}, "tools"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
    ({**CHAT, "tool_choice": "sometimes"}, "tool_choice"),
    ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    ({**CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
    ({**CHAT, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text"),
    ({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]},
     "messages[0].tool_calls[0].function.name"),
]


async def test_wrong_types_are_400_naming_the_field():
    async with open_test_server() as srv, httpx.AsyncClient(base_url=srv.url) as c:
        for body, field in WRONG:
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == field and field in err["message"], (field, err)
            assert err["type"] == "invalid_request_error"
        # the same rules hold on the SDK side: a BadRequestError, not a crash
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as exc:
                await client.chat.completions.create(**{**CHAT, "n": 3})
            assert exc.value.body["param"] == "n"


async def test_malformed_json_and_empty_body():
    async with open_test_server() as srv, httpx.AsyncClient(base_url=srv.url) as c:
        for raw in (b"{not json", b"", b"[1,2]", b"\xff\xfe"):
            r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, raw
            assert r.json()["error"]["code"] in ("invalid_json",)


async def test_request_size_limit_is_413_in_envelope():
    async with open_test_server(max_request_bytes=4096) as srv, httpx.AsyncClient(base_url=srv.url) as c:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10000}]}
        r = await c.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_auth_on_every_route_constant_time_bearer():
    routes = [("GET", "/metrics"), ("GET", "/v1/models"),
              ("GET", "/v1/models/scripted"), ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"),
              ("POST", "/shutdown"), ("GET", "/nope")]
    async with open_test_server(api_key="s3cret") as srv, httpx.AsyncClient(base_url=srv.url) as c:
        for method, path in routes:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                            {"authorization": "Basic s3cret"}):
                r = await c.request(method, path, headers=headers, json=CHAT if method == "POST" else None)
                assert r.status_code == 401, (method, path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert "x-request-id" in r.headers
        # the probes answer without credentials (a load balancer's health check has none)
        for probe in ("/health", "/readyz"):
            for headers in ({}, {"authorization": "Bearer wrong"}):
                assert (await c.get(probe, headers=headers)).status_code == 200, (probe, headers)
        ok = {"authorization": "Bearer s3cret"}
        assert (await c.get("/health", headers=ok)).status_code == 200
        assert (await c.get("/metrics", headers=ok)).status_code == 200
        r = await c.post("/v1/chat/completions", headers=ok, json=CHAT)
        assert r.status_code == 200
        # the official SDK with the key works, without it fails with AuthenticationError
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0) as good:
            out = await good.chat.completions.create(**CHAT)
        assert out.choices[0].message.content == srv.model.expected_text(8)
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(**CHAT)


async def test_cors_only_for_listed_origins():
    async with open_test_server(cors_origins=("http://app.example",)) as srv, \
            httpx.AsyncClient(base_url=srv.url) as c:
        pre = await c.options("/v1/chat/completions", headers={
            "origin": "http://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == "http://app.example"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"]
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"origin": "http://app.example"})
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"]
        # a foreign origin's POST is refused outright, not merely left without CORS headers
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"origin": "http://evil.example"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        assert r.json()["error"]["code"] == "origin_not_allowed"
        pre = await c.options("/v1/chat/completions", headers={"origin": "http://evil.example",
                                                                 "access-control-request-method": "POST"})
        assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
        assert pre.json()["error"]["code"] == "origin_not_allowed"  # refusals carry the error envelope
        pre = await c.options("/v1/chat/completions")
        assert pre.status_code == 405 and pre.json()["error"]["code"] == "method_not_allowed"


async def test_streaming_frames_roles_usage_and_done():
    async with open_test_server() as srv, httpx.AsyncClient(base_url=srv.url) as c:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [e async for e in sse_events(r)]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert len({ch["id"] for ch in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
        assert text == srv.model.expected_text(8)
        finals = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
        usage = [ch for ch in chunks if ch.get("usage")]
        assert len(usage) == 1 and usage[0]["choices"] == [] and usage[0]["usage"]["completion_tokens"] == 8
        # the SDK parses the same stream
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            stream = await client.chat.completions.create(**{**CHAT, "stream": True})
            got = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert got == srv.model.expected_text(8)


async def test_keepalive_comments_while_queued():
    # one slot, busy with a slow request: the second request waits in the queue and must see keep-alives
    async with open_test_server(slots=1, keepalive_s=0.2, token_delay=0.05) as srv, \
            httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        async def long_request():
            await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40})

        async with trio.open_nursery() as n:
            n.start_soon(long_request)
            await trio.sleep(0.3)
            raw = []
            async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                async for line in r.aiter_lines():
                    raw.append(line)
        assert any(line.startswith(": keep-alive") for line in raw)
        assert raw.count("data: [DONE]") == 1


async def test_tool_call_deltas_reassemble_and_length_cut_is_not_tool_calls():
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    async with open_test_server() as srv, httpx.AsyncClient(base_url=srv.url) as c:
        body = {**CHAT, "tools": tools, "max_tokens": 64}
        r = await c.post("/v1/chat/completions", json=body)
        msg = r.json()["choices"][0]
        assert msg["finish_reason"] == "tool_calls"
        calls = msg["message"]["tool_calls"]
        assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calls[0]["function"]["arguments"]) == srv.model.tool_arguments
        first_id = calls[0]["id"]
        async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(e) for e in [e async for e in sse_events(r)][:-1]]
        deltas = [tc for ch in chunks if ch["choices"] for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
        assert "id" in deltas[0] and deltas[0]["function"]["name"] == "get_weather" and deltas[0]["type"] == "function"
        assert all("id" not in d and "name" not in d["function"] for d in deltas[1:])
        assert len(deltas) > 2  # arguments really arrive in pieces
        args = "".join(d["function"]["arguments"] for d in deltas)
        assert json.loads(args) == srv.model.tool_arguments
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert deltas[0]["id"] != first_id  # fresh ids per response
        # the same call cut by max_tokens: finish_reason length and no broken tool_calls
        r = await c.post("/v1/chat/completions", json={**body, "max_tokens": 6})
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "length" and "tool_calls" not in ch["message"]
        # the SDK reassembles the stream too
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            out = await client.chat.completions.create(**body)
        assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == srv.model.tool_arguments


async def test_queue_full_is_429_with_retry_after_and_impossible_is_400():
    async with open_test_server(slots=1, queue_capacity=1, token_delay=0.05) as srv, \
            httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        statuses = []

        async def one():
            r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 30})
            statuses.append((r.status_code, r.headers.get("retry-after"), r.json()))

        async with trio.open_nursery() as n:
            for _ in range(4):
                n.start_soon(one)
                await trio.sleep(0.05)
        codes = sorted(s for s, _, _ in statuses)
        assert codes.count(200) == 2 and codes.count(429) == 2, statuses
        for s, ra, body in statuses:
            if s == 429:
                assert ra == "1" and body["error"]["code"] in ("queue_full", "slot_budget_exceeded")
        huge = {**CHAT, "messages": [{"role": "user", "content": "y" * (srv.ctx + 10)}]}
        r = await c.post("/v1/chat/completions", json=huge)
        assert r.status_code == 400 and "retry-after" not in r.headers
        assert r.json()["error"]["code"] in ("context_length_exceeded", "kv_budget_unsatisfiable")
        metrics = (await c.get("/metrics")).text
        assert 'hf2q_rejections_total{code="queue_full"}' in metrics or \
               'hf2q_rejections_total{code="slot_budget_exceeded"}' in metrics


async def test_client_disconnect_mid_prefill_cancels_and_frees_slot_once():
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "hello " * 40}]}
    async with open_test_server(slots=1, prefill_delay=0.01, prefill_chunk=8) as srv, \
            httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        with trio.move_on_after(0.4):
            async with c.stream("POST", "/v1/chat/completions", json={**long_chat, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    pass
        await srv.wait_idle()
        prompt_len = len(srv.model.last_prompt)
        assert sum(srv.runner.prefill_sizes) < prompt_len  # it really was cut mid-prefill
        assert srv.runner.decode_batch_sizes == []
        assert srv.cancelled_count() == 1
        r = await c.post("/v1/chat/completions", json=long_chat)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == srv.model.expected_text(8)
        assert srv.cancelled_count() == 1
        assert all(s.phase == "idle" for s in srv.runtime.snapshot().slots)


async def test_gpu_fault_ends_every_request_once_then_503():
    async with open_test_server(slots=2, token_delay=0.05) as srv, \
            httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        results = {}

        async def streamed(i):
            async with c.stream("POST", "/v1/chat/completions",
                                json={**CHAT, "stream": True, "max_tokens": 200}) as r:
                results[i] = [e async for e in sse_events(r)]

        async def plain(i):
            r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 200})
            results[i] = r

        async with trio.open_nursery() as n:
            n.start_soon(streamed, 0)
            n.start_soon(plain, 1)
            n.start_soon(streamed, 2)  # queued behind the two slots
            await trio.sleep(0.5)
            srv.inject_fault()
        for i in (0, 2):
            ev = results[i]
            assert ev[-1] == "[DONE]" and ev.count("[DONE]") == 1
            errors = [json.loads(e) for e in ev[:-1] if "error" in json.loads(e)]
            assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_unhealthy"
        assert results[1].status_code == 503 and results[1].json()["error"]["code"] == "engine_unhealthy"
        assert (await c.get("/health")).status_code == 200
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["ready"] is False
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "engine_unhealthy"
        assert "hf2q_ready 0.0" in (await c.get("/metrics")).text


async def test_metrics_exposition_counts_tokens():
    async with open_test_server() as srv, httpx.AsyncClient(base_url=srv.url) as c:
        await c.post("/v1/chat/completions", json=CHAT)
        text = (await c.get("/metrics")).text
        from prometheus_client.parser import text_string_to_metric_families

        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert fams["hf2q_completion_tokens"].samples[0].value == 8
        assert fams["hf2q_prompt_tokens"].samples[0].value == len(srv.model.last_prompt)
        for name in ("hf2q_time_to_first_token_seconds", "hf2q_decode_tokens_per_second", "hf2q_slots_active",
                     "hf2q_requests_queued", "hf2q_kv_bytes_resident", "hf2q_kv_bytes_on_disk",
                     "hf2q_cached_token_ratio", "hf2q_cancellations", "hf2q_ready", "hf2q_requests"):
            assert name in fams, name
        assert fams["hf2q_ready"].samples[0].value == 1


async def test_metrics_count_gpu_steps_and_decode_batches_as_the_engine_saw_them():
    async with open_test_server(slots=2, token_delay=0.01) as srv, httpx.AsyncClient(base_url=srv.url) as c:
        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for k in range(2):
                n.start_soon(functools.partial(c.post, "/v1/chat/completions", json={**CHAT, "max_tokens": 12 + k}))
        from prometheus_client.parser import text_string_to_metric_families

        fams = {f.name: f for f in text_string_to_metric_families((await c.get("/metrics")).text)}
        sizes = srv.runner.decode_batch_sizes
        assert fams["hf2q_decode_batches"].samples[0].value == len(sizes)
        assert fams["hf2q_decode_batch_tokens"].samples[0].value == sum(sizes) == 11 + 12
        steps = fams["hf2q_gpu_steps"].samples[0].value
        prefills = len(srv.runner.prefill_sizes)
        assert max(len(sizes), prefills) <= steps <= len(sizes) + prefills  # a step: a decode and/or a prefill
        assert 2 in sizes  # both conversations decoded in one batched step
        # every engine call sleeps token_delay: the busy seconds hold at least those, and no more than the wall
        busy = fams["hf2q_gpu_busy_seconds"].samples[0].value
        assert 0.01 * steps <= busy <= time.perf_counter() - t0


async def test_shutdown_drains_then_refuses_new_work():
    async with open_test_server(slots=1, token_delay=0.02) as srv, \
            httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        results = []

        async def running():
            results.append(await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20}))

        async with trio.open_nursery() as n:
            n.start_soon(running)
            await trio.sleep(0.15)
            r = await c.post("/shutdown")
            assert r.status_code == 202
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert results[0].status_code == 200
        assert results[0].json()["usage"]["completion_tokens"] == 20
        await srv.wait_stopped()


async def test_short_request_gets_first_token_during_a_long_prefill():
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "lorem ipsum " * 40}], "stream": True}
    async with open_test_server(slots=2, prefill_delay=0.003, prefill_chunk=32) as srv, \
            httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        first_token_at = {}

        async def run(name, body):
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for e in sse_events(r):
                    if e != "[DONE]" and json.loads(e)["choices"] and \
                            json.loads(e)["choices"][0]["delta"].get("content"):
                        first_token_at.setdefault(name, trio.current_time())

        async with trio.open_nursery() as n:
            n.start_soon(run, "long", long_chat)
            await trio.sleep(0.3)  # the long prompt (~480 tokens, ~1.4 s of prefill) is mid-way
            n.start_soon(run, "short", {**CHAT, "stream": True})
        assert first_token_at["short"] < first_token_at["long"]


async def test_logprobs_match_the_generated_tokens():
    async with open_test_server() as srv, httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})
        body = r.json()
        content = body["choices"][0]["logprobs"]["content"]
        text = body["choices"][0]["message"]["content"]
        assert "".join(e["token"] for e in content) == text
        for e in content:
            assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2
            assert e["top_logprobs"][0]["token"] == e["token"]
            assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"])
            assert e["top_logprobs"][1]["logprob"] < e["logprob"]


def _fake_embedding(ids, dim=16):
    """The fake embedding runner's rule, written independently (tests/fakes/runner.py)."""
    import numpy as np

    v = np.zeros(dim)
    for j, t in enumerate(ids):
        v[(t + j) % dim] += 1.0 + (t % 5)
    return v / np.linalg.norm(v)


async def test_embeddings_float_base64_usage_and_errors():
    import base64

    import numpy as np

    async with open_test_server(embeddings=True) as srv, httpx.AsyncClient(base_url=srv.url) as c:
        texts = ["A man is eating food.", "Ünïcødé ✓"]
        r = await c.post("/v1/embeddings", json={"input": texts, "model": "embedder"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1]
        for d, t in zip(body["data"], texts):
            v = np.asarray(d["embedding"])
            assert np.allclose(v, _fake_embedding(t.encode()), atol=1e-6)
            assert abs(np.linalg.norm(v) - 1) < 1e-5
        assert body["usage"]["prompt_tokens"] == sum(len(t.encode()) for t in texts)
        r = await c.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"})
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        assert np.allclose(np.frombuffer(raw, "<f4"), _fake_embedding(texts[0].encode()), atol=1e-6)
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            out = await client.embeddings.create(model="embedder", input=texts)  # the SDK asks for base64
            assert np.allclose(out.data[1].embedding, _fake_embedding(texts[1].encode()), atol=1e-6)
        for bad, param in (({"input": 5}, "input"), ({"input": ["ok", {"x": 1}]}, "input[1]"),
                           ({"input": "x", "encoding_format": "hex"}, "encoding_format")):
            r = await c.post("/v1/embeddings", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        r = await c.post("/v1/embeddings", json={"input": "x", "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["scripted", "embedder"]


async def test_embeddings_without_embedding_model_is_404():
    async with open_test_server() as srv, httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_persistent_kv_restart_reports_cached_tokens_and_disk_metrics(tmp_path):
    """--kv-persist through the HTTP layer: a fresh server (new runtime, empty slots) over the same
    store answers the same prompt with cached_tokens from disk and identical output."""
    from prometheus_client.parser import text_string_to_metric_families

    from hf2q.kvstore import BLOCK_TOKENS, BlockStore

    prompt = {**CHAT, "messages": [{"role": "user", "content": "persist me " * 80}]}  # ~880 byte tokens
    answers = []
    for _ in range(2):
        store = BlockStore.open(tmp_path / "kv", "f" * 64)
        try:
            async with open_test_server(kv_store=store) as srv, httpx.AsyncClient(base_url=srv.url) as c:
                r = await c.post("/v1/chat/completions", json=prompt)
                answers.append(r.json())
                await srv.runtime.drain(5)  # lets queued block writes reach the disk
                fams = {f.name: f for f in text_string_to_metric_families((await c.get("/metrics")).text)}
        finally:
            store.close()
        n_prompt = answers[-1]["usage"]["prompt_tokens"]
        full_blocks = (n_prompt - 1) // BLOCK_TOKENS
        assert fams["hf2q_kv_bytes_on_disk"].samples[0].value > 0
        assert fams["hf2q_kv_persist_blocks"].samples[0].value == full_blocks
    first, second = answers
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= full_blocks * BLOCK_TOKENS
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
