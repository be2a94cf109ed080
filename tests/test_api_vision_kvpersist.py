"""``serve --mmproj --kv-persist`` (tiny Qwen3-VL F32 GGUF + mmproj), over HTTP, across a restart.

A prompt of a long text, an image and a question fills one whole KV block (256 tokens) holding
the image and the question's first words. A first server answers it cold and persists the block;
a restarted server on the same directory hydrates that block, runs no encode, and answers with the
cold server's log-probabilities (the question's rest after the block sits at the positions the
image left, which come back with the block). The same text with another image reuses no block: the
block key names the image.
"""

from __future__ import annotations

import base64
import io
from contextlib import asynccontextmanager
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import trio

from tests.models.qwen3vl import checkpoint, f32_gguf

CTX = 1024
BLOCK = 256
LONG_TEXT = " ".join(f"word{i}" for i in range(60))  # 170 tokens: the image ends inside the first block
QUESTION = "What is in the picture after all those words? Describe every part of it in detail, with colours and shapes."


def _uri(seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _body(seed: int) -> dict:
    content = [{"type": "text", "text": LONG_TEXT}, {"type": "image_url", "image_url": {"url": _uri(seed)}},
               {"type": "text", "text": QUESTION}]
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 3,
            "logprobs": True, "top_logprobs": 5}


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    from hf2q.convert.mmproj import convert_mmproj

    path = tmp_path_factory.mktemp("vl") / "mmproj-tiny-f32.gguf"
    convert_mmproj(checkpoint("qwen3vl"), path, "f32")
    return path


@asynccontextmanager
async def _server(mmproj_path, kv_dir):
    from hf2q.actors.runtime import open_runtime
    from hf2q.api.app import ServerContext
    from hf2q.api.command import _vision, kv_store_opener, runner_factory
    from hf2q.api.server import serve
    from hf2q.api.textbridge import GGUFChatModel
    from hf2q.sched.contracts import RuntimeConfig

    path = f32_gguf("qwen3vl")
    model = GGUFChatModel.from_gguf(path, "vl")
    vision = _vision(SimpleNamespace(mmproj_path=mmproj_path, mmproj_line=""), model)
    opener = kv_store_opener(SimpleNamespace(kv_persist=str(kv_dir), kv_persist_budget=None), path,
                             model.template_source)
    config = RuntimeConfig(slots=1, ctx=CTX, queue_capacity=4, gpu_deadline_s=600, prefill_chunk=64)
    async with open_runtime(runner_factory(path, CTX, vision=vision), config, kv_store_opener=opener) as runtime, \
            trio.open_nursery() as nursery:
        assert await runtime.wait_ready(), runtime.readiness()
        ctx = ServerContext(runtime=runtime, chat_model=model, model_id="vl")
        handle = await nursery.start(lambda task_status: serve(ctx, "127.0.0.1", 0, graceful_timeout=1,
                                                               task_status=task_status))
        try:
            yield handle.url, model.vision.store
            assert await runtime.drain(60)  # every persisted block written before the restart
        finally:
            handle.request_stop()
            with trio.move_on_after(30):
                await handle.closed.wait()
            nursery.cancel_scope.cancel()


def _logprobs(out: dict) -> list[tuple[str, list[float]]]:
    return [(t["token"], [a["logprob"] for a in t["top_logprobs"]]) for t in out["choices"][0]["logprobs"]["content"]]


async def test_a_restart_hydrates_an_image_block_and_equals_cold_logits(mmproj, tmp_path):
    async with _server(mmproj, tmp_path) as (url, _), httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json=_body(1))
        assert r.status_code == 200, r.text
        cold = r.json()
        assert cold["usage"]["prompt_tokens"] > BLOCK and cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    async with _server(mmproj, tmp_path) as (url, store), httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json=_body(1))
        assert r.status_code == 200, r.text
        warm = r.json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCK  # the block with the image
        assert store.encodes == 0  # the whole image is in the restored block: no vision work at all
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        for (tok_w, lp_w), (tok_c, lp_c) in zip(_logprobs(warm), _logprobs(cold), strict=True):
            assert tok_w == tok_c
            np.testing.assert_allclose(lp_w, lp_c, atol=1e-4, rtol=0)
    async with _server(mmproj, tmp_path) as (url, _), httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json=_body(2))  # the same text, another image
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
