"""``serve --mmproj --kv-persist`` (tiny Qwen3-VL F32 GGUF + mmproj), over HTTP, across a restart.

A prompt of a long text, an image and a question fills one whole KV block (256 tokens) holding
the image and the question's first words. A first server answers it cold and persists the block;
a restarted server on the same directory hydrates that block, runs no encode, and answers with the
cold server's log-probabilities (the question's rest after the block sits at the positions the
image left, which come back with the block). The same text with another image reuses no block: the
block key names the image.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
import numpy as np
import pytest

from tests.models.qwen3vl_serve import data_uri, mmproj_f32, png, vision_server

CTX = 1024
BLOCK = 256
LONG_TEXT = " ".join(f"word{i}" for i in range(60))  # 170 tokens: the image ends inside the first block
QUESTION = "What is in the picture after all those words? Describe every part of it in detail, with colours and shapes."


def _uri(seed: int) -> str:
    return data_uri(png(seed))


def _body(seed: int) -> dict:
    content = [{"type": "text", "text": LONG_TEXT}, {"type": "image_url", "image_url": {"url": _uri(seed)}},
               {"type": "text", "text": QUESTION}]
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 3,
            "logprobs": True, "top_logprobs": 5}


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    return mmproj_f32(tmp_path_factory.mktemp("vl"))


@asynccontextmanager
async def _server(mmproj_path, kv_dir):
    async with vision_server(mmproj_path, slots=1, ctx=CTX, prefill_chunk=64, kv_dir=kv_dir) as (url, model, _):
        yield url, model.vision.store


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
