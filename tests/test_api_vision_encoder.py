"""The image encoder as its own GPU work in the real server (tiny Qwen3-VL F32 GGUF + mmproj), over HTTP.

* While one slot streams text, another's image is encoded in several jobs (one vision block each
  here): the engine thread's log shows decode steps of the text stream between the encode's jobs,
  and the client sees text tokens arrive between sending the image request and its answer.
* The same image after another text: the encoder does not run again (the feature cache), and the
  reply is transformers' greedy continuation.
* A client that leaves mid-encode ends the encode (nothing cached, its images released); an encode
  that fails answers 503 for its request alone, and the server goes on serving.
"""

from __future__ import annotations

import io
import json
import threading
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from tests.models.qwen3vl import checkpoint
from tests.models.qwen3vl_serve import data_uri, mmproj_f32, png, vision_server

CTX = 4096
SIDE = 256  # Qwen3-VL's minimum area: no resize; 256 patch rows, 64 merged tokens
NO_END = {"151645": -100, "151643": -100}  # <|im_end|>, <|endoftext|>: the text stream runs to max_tokens


def _uri(seed: int) -> str:
    return data_uri(png(seed))


def _image_body(text: str, seed: int, **kw) -> dict:
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": _uri(seed)}}]
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 6, **kw}


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    return mmproj_f32(tmp_path_factory.mktemp("vl"))


@pytest.fixture
def engine_log(monkeypatch):
    """What the engine thread ran, in order: ``("step", decode slots)`` and ``("encode", outcome)``;
    and one vision block per encode job, so a 256-patch image takes three."""
    import hf2q.actors.gpu_owner as gpu_owner
    from hf2q.engine.vision import encode_job

    log: list[tuple] = []
    real_step, real_job = gpu_owner.run_step, encode_job.ImageEncodeJob.step

    def step(runner, batch, *rest):
        log.append(("step", tuple(r.slot for r in batch)))
        return real_step(runner, batch, *rest)

    def job(self, runner):
        out = real_job(self, runner)
        log.append(("encode", out.outcome))
        return out

    monkeypatch.setattr(gpu_owner, "run_step", step)
    monkeypatch.setattr(encode_job.ImageEncodeJob, "step", job)
    monkeypatch.setattr(encode_job, "JOB_PATCH_BLOCKS", SIDE * SIDE // 256)
    return log


@asynccontextmanager
async def _server(mmproj_path):
    """A 2-slot server; yields its URL, the image store and the slot actors."""
    async with vision_server(mmproj_path, ctx=CTX) as (url, model, runtime):
        yield url, model.vision.store, runtime._system.slots  # noqa: SLF001


@pytest.fixture(scope="module")
def reference():
    """transformers' greedy 6-token replies to ``(text, image seed)`` turns, the model loaded once."""
    import torch
    import transformers
    from PIL import Image

    src = checkpoint("qwen3vl")
    proc = transformers.AutoImageProcessor.from_pretrained(src)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()

    def greedy(text: str, seed: int) -> str:
        image = proc(images=[Image.open(io.BytesIO(png(seed)))], return_tensors="pt")
        prompt = (f"<|im_start|>user\n{text}<|vision_start|>" + "<|image_pad|>" * 64
                  + "<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        kinds = (ids == model.config.image_token_id).long()
        with torch.no_grad():
            out = model.generate(input_ids=ids, mm_token_type_ids=kinds, pixel_values=image["pixel_values"],
                                 image_grid_thw=image["image_grid_thw"], max_new_tokens=6, do_sample=False)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return greedy


async def _idle(slots, store) -> None:
    with trio.fail_after(60):
        while store.holds or any(s.state != "idle" for s in slots):
            await trio.sleep(0.02)


@pytest.mark.slow  # the transformers reference and a 2-slot server: ~30 s
async def test_text_streams_between_encode_jobs_and_a_cached_image_is_not_encoded_again(mmproj, engine_log, reference):
    events: list[str] = []  # what the client saw, in order
    async with _server(mmproj) as (url, store, slots), httpx.AsyncClient(base_url=url, timeout=120) as client:
        first_text = trio.Event()

        async def stream_text(task_status=trio.TASK_STATUS_IGNORED):
            body = {"messages": [{"role": "user", "content": "Count"}], "temperature": 0, "stream": True,
                    "max_tokens": CTX - 64, "logit_bias": NO_END}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        events.append("text")
                        first_text.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_text)
            await first_text.wait()
            events.append("image sent")
            r = await client.post("/v1/chat/completions", json=_image_body("Describe", 1))
            events.append("image answered")
            nursery.cancel_scope.cancel()  # the text stream has done its part
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == reference("Describe", 1)
        encodes = [i for i, e in enumerate(engine_log) if e[0] == "encode"]
        assert [engine_log[i][1] for i in encodes] == ["running", "running", "encoded"]
        text_slot = engine_log[encodes[0] - 1][1]  # the decode rows of the step before the encode
        assert text_slot, engine_log[:encodes[0]]
        for a, b in zip(encodes, encodes[1:]):  # a decode step of the text stream between every two jobs
            assert any(e[0] == "step" and e[1] == text_slot for e in engine_log[a + 1:b]), engine_log[a:b + 1]
        sent, answered = events.index("image sent"), events.index("image answered")
        assert "text" in events[sent + 1:answered]  # the stream kept arriving while the image was in
        await _idle(slots, store)
        assert store.encodes == 1

        # the same image after other text: the prefix differs before it, the features come from the cache
        engine_log.clear()
        r = await client.post("/v1/chat/completions", json=_image_body("Look at this", 1))
        assert r.status_code == 200, r.text
        assert [e[1] for e in engine_log if e[0] == "encode"] == ["cached"]
        assert store.encodes == 1 and store.feature_hits == 1  # the prefill's reads are no hits
        assert r.json()["choices"][0]["message"]["content"] == reference("Look at this", 1)
        outcomes = sum((s.images.outcomes for s in slots), start=type(slots[0].images.outcomes)())
        assert outcomes == {"encoded": 1, "cached": 1}


async def test_disconnect_mid_encode_and_a_failed_encode_end_only_their_request(mmproj, engine_log, monkeypatch):
    from hf2q.engine.vision.prompt_images import content_key
    from hf2q.engine.vision.qwen3vl import Qwen3VLVisionEncoder

    entered, release = threading.Event(), threading.Event()
    fail = threading.Event()
    real = Qwen3VLVisionEncoder.advance

    def advance(self, state, blocks):  # the first job waits for the test; with ``fail`` set one raises
        if fail.is_set():
            fail.clear()
            raise RuntimeError("out of device memory (injected)")
        if not entered.is_set():
            entered.set()
            assert release.wait(60)
        return real(self, state, blocks)

    async with _server(mmproj) as (url, store, slots), httpx.AsyncClient(base_url=url, timeout=120) as client:
        monkeypatch.setattr(Qwen3VLVisionEncoder, "advance", advance)  # after the warm-up's encode
        with trio.move_on_after(60) as scope:
            async with trio.open_nursery() as nursery:
                async def doomed():
                    async with client.stream("POST", "/v1/chat/completions",
                                             json=_image_body("Describe", 2, stream=True)) as r:
                        async for _ in r.aiter_lines():
                            pass
                nursery.start_soon(doomed)
                while not entered.is_set():
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()  # the client leaves while its image's first job runs
        assert not scope.cancelled_caught
        txn = next(s.images.current for s in slots if s.images.current is not None)
        with trio.fail_after(30):
            while not txn.handle.gone:  # the server has seen the disconnect
                await trio.sleep(0.01)
        release.set()
        await _idle(slots, store)
        assert txn.state == "aborted"
        assert [e[1] for e in engine_log if e[0] == "encode"] == ["running"]  # no job after the first
        assert store.encodes == 0 and store.cached_features(content_key(png(2))) is None

        fail.set()  # the next encode fails: its request alone gets the answer
        r = await client.post("/v1/chat/completions", json=_image_body("Describe", 2))
        assert r.status_code == 503, r.text
        assert "image encoding failed: RuntimeError: out of device memory" in r.json()["error"]["message"]
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = await client.post("/v1/chat/completions", json=_image_body("Describe", 2))
        assert r.status_code == 200, r.text
        assert store.encodes == 1 and (await client.get("/readyz")).status_code == 200
        await _idle(slots, store)
        assert sum(s.images.outcomes["aborted"] for s in slots) == 1
        assert sum(s.images.outcomes["failed"] for s in slots) == 1
