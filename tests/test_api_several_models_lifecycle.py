"""A several-model server over HTTP (the real app and hypercorn, in process; fake engines, and one
real GGUF load): a model whose file is corrupt backs off instead of reloading per request, and a
stream whose client leaves without reading releases its model.

References: the fake runners count their loads, the registry's own ``/v1/models`` cards say what is
resident, and the fake model's greedy rule gives the expected text.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from functools import partial

import httpx
import trio

from hf2q.actors.model_registry import Entry, ModelRegistry
from hf2q.api.app import ServerContext
from hf2q.api.several import RegistryRuntime
from hf2q.api.server import serve
from hf2q.sched.contracts import RuntimeConfig
from tests.fakes import FakeModelRunner
from tests.test_api_support import ScriptedChatModel

CONFIG = RuntimeConfig(slots=1, ctx=2048, gpu_deadline_s=20)


def fake_entry(name: str, runner: FakeModelRunner, loads: list) -> Entry:
    def factory():
        loads.append(name)
        return runner.factory()
    return Entry(name, None, "chat", 10, ScriptedChatModel(runner=runner, model_id=name), CONFIG, factory)


@asynccontextmanager
async def several_model_server(entries, budget: int, load_backoff_s: float):
    registry = ModelRegistry(entries, budget, wait_s=1.0, load_backoff_s=load_backoff_s)
    async with trio.open_nursery() as nursery:
        await nursery.start(registry.run)
        ctx = ServerContext(runtime=RegistryRuntime(registry), chat_model=entries[0].text,
                            model_id=entries[0].model_id, models=registry)
        handle = await nursery.start(partial(serve, ctx, "127.0.0.1", 0, drain_timeout=5, graceful_timeout=1))
        try:
            async with httpx.AsyncClient(base_url=handle.url, timeout=30) as client:
                yield client, registry
        finally:
            nursery.cancel_scope.cancel()


def ask(client, model: str, max_tokens: int = 4, **extra):
    return client.post("/v1/chat/completions", json={"model": model, "max_tokens": max_tokens, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "hi"}], **extra})


async def cards(client) -> dict[str, dict]:
    return {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}


async def test_a_corrupt_gguf_backs_off_then_is_tried_again_and_the_other_model_serves(tmp_path):
    from hf2q.api.command import runner_factory

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 8)  # the magic, then nothing a GGUF header can be
    tries = []

    def load_broken():
        tries.append(1)
        return runner_factory(broken, 512)

    good_runner, loads = FakeModelRunner(vocab_size=256), []
    good = fake_entry("good", good_runner, loads)
    bad = Entry("broken", broken, "chat", 10, ScriptedChatModel(runner=FakeModelRunner(), model_id="broken"),
                CONFIG, load_broken)
    async with several_model_server([good, bad], budget=20, load_backoff_s=2.0) as (client, _):
        first = await ask(client, "broken")
        assert first.status_code == 503, first.text
        error = first.json()["error"]
        assert error["code"] == "model_load_failed" and "corrupt or truncated GGUF" in error["message"]
        assert len(tries) == 1 and 1 <= int(first.headers["retry-after"]) <= 2  # a slow load eats into the 2 s
        t0 = time.monotonic()
        again = await ask(client, "broken")
        assert again.status_code == 503 and again.json()["error"]["code"] == "model_load_failed"
        assert time.monotonic() - t0 < 1.0 and len(tries) == 1  # at once, without loading again
        assert 1 <= int(again.headers["retry-after"]) <= 2
        assert (await cards(client))["broken"]["state"] == "failed"
        ok = await ask(client, "good")  # the broken file costs the other model nothing
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == \
            good.text.expected_text(4)
        await trio.sleep(2.1)
        later = await ask(client, "broken")  # the back-off is over: one more load is tried
        assert later.status_code == 503 and len(tries) == 2
        assert loads == ["good"]


async def test_a_stream_closed_unread_releases_its_model_which_becomes_evictable():
    slow = FakeModelRunner(vocab_size=256, step_latency_s=0.02)  # 1000 tokens would take 20 s
    loads = []
    a, b = fake_entry("a", slow, loads), fake_entry("b", FakeModelRunner(vocab_size=256), loads)
    async with several_model_server([a, b], budget=15, load_backoff_s=30.0) as (client, registry):
        t0 = time.monotonic()
        async with client.stream("POST", "/v1/chat/completions",
                                 json={"model": "a", "max_tokens": 1000, "stream": True, "temperature": 0,
                                       "messages": [{"role": "user", "content": "hi"}]}) as stream:
            assert stream.status_code == 200
            assert (await cards(client))["a"]["active_requests"] == 1  # generating; nothing read
        with trio.fail_after(5):  # closed: the server sees the disconnect and lets the model go
            while (await cards(client))["a"]["active_requests"]:
                await trio.sleep(0.05)
        assert time.monotonic() - t0 < 10  # long before the 1000 tokens could have been generated
        other = await ask(client, "b")  # no room for both: the idle model is evicted for it
        assert other.status_code == 200, other.text
        states = await cards(client)
        assert (states["a"]["state"], states["b"]["state"], a.evictions) == ("unloaded", "ready", 1)
        assert loads == ["a", "b"]


async def test_the_dashboard_has_one_row_per_model():
    """While ``a`` streams and ``b`` is not loaded: a row each, with what the registry and ``a``'s
    runtime say (state, active requests, busy slots, loads), and none of the prompt's text."""
    import io

    from rich.console import Console

    from hf2q.api.operator import render_models_dashboard, run_models_dashboard

    loads = []
    a = fake_entry("model-a", FakeModelRunner(vocab_size=256, step_latency_s=0.02), loads)
    b = fake_entry("model-b", FakeModelRunner(vocab_size=256), loads)
    async with several_model_server([a, b], budget=15, load_backoff_s=30.0) as (client, registry):
        async with client.stream("POST", "/v1/chat/completions",
                                 json={"model": "model-a", "max_tokens": 200, "stream": True,
                                       "messages": [{"role": "user", "content": "SECRET-PROMPT"}]}) as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data: {"):
                    break  # decoding now
            console = Console(record=True, width=160, file=io.StringIO())
            console.print(render_models_dashboard(registry.entries.values(), url="http://x", budget_bytes=15,
                                                  started=0.0))
            frame = console.export_text()
            screen = io.StringIO()
            with trio.move_on_after(0.3):  # the live loop draws the same rows
                await run_models_dashboard(registry, url="http://x", refresh_s=0.05,
                                           console=Console(file=screen, width=160))
    rows = {line.split()[0]: line.split() for line in frame.splitlines() if line.startswith("model-")}
    assert rows["model-a"][:6] == ["model-a", "chat", "ready", "1", "1/1", "0"]
    assert rows["model-a"][-2:] == ["1", "0"]  # loaded once, never evicted
    assert rows["model-b"][:6] == ["model-b", "chat", "unloaded", "0", "-", "-"]
    assert "2 models" in frame and "memory 10 B / 15 B" in frame and "SECRET-PROMPT" not in frame
    assert "model-a" in screen.getvalue() and "model-b" in screen.getvalue()
