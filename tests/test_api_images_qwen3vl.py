"""Images through ``/v1/chat/completions`` of the real server (tiny Qwen3-VL F32 GGUF + its mmproj), over HTTP.

* A 256×256 PNG (the processor's minimum area: no resize, so both sides see the same pixels) in a
  user message: ``prompt_tokens`` is the length of transformers' input (its image processor and the
  ``<|vision_start|><|image_pad|>×64<|vision_end|>`` expansion of Qwen3-VL's processor), and the
  greedy reply is transformers' ``generate``.
* The same request again is served from the cached prefix through the image; another image at the
  same place reuses nothing past the text before it.
* Refusals, each a 400 naming the content part: an http URL, bad base64, bytes that are no image,
  a GIF, an image above the pixel limit, more images than allowed; and a server without the mmproj.
"""

from __future__ import annotations

import io
from contextlib import asynccontextmanager

import httpx
import pytest

from tests.models.qwen3vl import checkpoint
from tests.models.qwen3vl_serve import data_uri, mmproj_f32, png as png_bytes, vision_server

CTX = 1024
SIDE = 256  # 65536 pixels: Qwen3-VL's minimum, so no resize; 8×8 merged tokens
PROMPT = "Describe"


def _png(seed: int | None, size=(SIDE, SIDE), fmt: str = "PNG") -> bytes:
    return png_bytes(seed, size, fmt)


def _uri(data: bytes, kind: str = "png") -> str:
    return data_uri(data, kind)


def _body(*parts, max_tokens: int = 6) -> dict:
    content = [{"type": "text", "text": PROMPT}] + [{"type": "image_url", "image_url": {"url": u}} for u in parts]
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": max_tokens}


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    return mmproj_f32(tmp_path_factory.mktemp("vl"))


@asynccontextmanager
async def _server(mmproj_path):
    async with vision_server(mmproj_path, ctx=CTX) as (url, model, _):
        yield url, model


def _transformers_greedy(png: bytes, n: int) -> tuple[int, str]:
    """(prompt length, greedy reply text) of transformers on the same chat turn and image."""
    import torch
    import transformers
    from PIL import Image

    src = checkpoint("qwen3vl")
    proc = transformers.AutoImageProcessor.from_pretrained(src)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    image = proc(images=[Image.open(io.BytesIO(png))], return_tensors="pt")
    n_image = int(image["image_grid_thw"].prod()) // 4
    assert n_image == (SIDE // 32) ** 2
    text = (f"<|im_start|>user\n{PROMPT}<|vision_start|>" + "<|image_pad|>" * n_image
            + "<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")["input_ids"]
    kinds = (ids == model.config.image_token_id).long()
    with torch.no_grad():
        out = model.generate(input_ids=ids, mm_token_type_ids=kinds, pixel_values=image["pixel_values"],
                             image_grid_thw=image["image_grid_thw"], max_new_tokens=n, do_sample=False)
    return ids.shape[1], tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


async def test_image_chat_is_transformers_and_reuses_the_prefix_by_image(mmproj):
    first, other = _png(1), _png(2, fmt="JPEG")
    n_prompt, reply = _transformers_greedy(first, 6)
    async with _server(mmproj) as (url, model), httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json=_body(_uri(first)))
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["prompt_tokens"] == n_prompt  # the image's 64 tokens and its two markers counted
        if out["choices"][0]["finish_reason"] == "length":
            assert out["choices"][0]["message"]["content"] == reply
        else:  # a stop token within the six: the reply is the reference's prefix up to it
            assert reply.startswith(out["choices"][0]["message"]["content"])
        # the same image again: the prefix through it and the text after it comes from the cache
        again = (await client.post("/v1/chat/completions", json=_body(_uri(first)))).json()
        assert again["choices"][0]["message"]["content"] == out["choices"][0]["message"]["content"]
        image_end = 3 + 2 + 64  # <|im_start|>user\n, "Describe", <|vision_start|>, the image tokens
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > image_end
        # another image (a JPEG) at the same place: nothing from its first image token on is reused
        third = (await client.post("/v1/chat/completions", json=_body(_uri(other, "jpeg")))).json()
        assert 0 < third["usage"]["prompt_tokens_details"]["cached_tokens"] <= image_end - 64
        assert third["usage"]["prompt_tokens"] == n_prompt
        # refusals, naming the part
        part = "messages[0].content[1]"
        refused = {
            "http URL": _body("https://example.com/cat.png"),
            "bad base64": _body("data:image/png;base64,@@@"),
            "not an image": _body(_uri(b"no picture here at all")),
            "GIF": _body(_uri(_png(3, (32, 32), "GIF"), "gif")),
            "too large": _body(_uri(_png(None, (4097, 4097)))),
        }
        for what, body in refused.items():
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (what, r.text)
            err = r.json()["error"]
            assert err["param"] == part and part in err["message"], (what, err)
        r = await client.post("/v1/chat/completions", json=_body(_uri(first), "data:image/png;base64,@@@"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[2]"
        assert model.vision.store.holds == 0  # every request's images released: answered or refused
        r = await client.post("/v1/chat/completions", json=_body(*[_uri(first)] * 9))
        assert r.status_code == 400 and "more than 8 images" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages[0].content[9]"


async def test_without_an_mmproj_images_are_refused():
    async with _server(None) as (url, _), httpx.AsyncClient(base_url=url, timeout=60) as client:
        r = await client.post("/v1/chat/completions", json=_body(_uri(_png(1))))
        assert r.status_code == 400, r.text
        assert "does not accept image input" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages[0].content[1]"
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 2})
        assert r.status_code == 200, r.text
