"""``serve --model VL --model TEXT`` with a vision projector: images through the vision model only.

* Which projector each model serves with (``several.assign_mmprojs``): ``--mmproj`` goes to the one
  model it fits; a projector beside a vision model by name is found; a text model gets none;
  ``--mmproj`` that fits no model is refused.
* The real server process (``hf2q serve``) with the tiny Qwen3-VL F32 GGUF and SmolLM2: an image to
  the vision model is answered as transformers does; the same image to SmolLM2 is a 400 naming
  the part; SmolLM2's text answers still come.
"""

from __future__ import annotations

import io

import httpx
import pytest

from tests.models.qwen3vl import checkpoint, f32_gguf
from tests.models.qwen3vl_serve import data_uri, png
from tests.serve_support import hf2q_server


def _image_body(model: str, image: bytes) -> dict:
    content = [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": data_uri(image)}}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """The tiny Qwen3-VL GGUF with its projector beside it (as llama.cpp's converter names it)."""
    from hf2q.convert.mmproj import convert_mmproj

    d = tmp_path_factory.mktemp("vl")
    (d / "tiny-vl.gguf").symlink_to(f32_gguf("qwen3vl"))
    convert_mmproj(checkpoint("qwen3vl"), d / "mmproj-tiny-vl-f32.gguf", "f32")
    return d


def test_each_model_gets_the_projector_that_fits_it(vl_dir, smollm2_gguf, tmp_path):
    from hf2q.api.several import assign_mmprojs
    from hf2q.errors import InputError
    from hf2q.formats.gguf_file import open_gguf

    projector = vl_dir / "mmproj-tiny-vl-f32.gguf"
    headers = {"vl": open_gguf(vl_dir / "tiny-vl.gguf"), "smol": open_gguf(smollm2_gguf)}
    assert assign_mmprojs(headers, None) == {"vl": projector}  # found beside it
    elsewhere = tmp_path / "projector.gguf"
    elsewhere.symlink_to(projector)
    assert assign_mmprojs(headers, elsewhere) == {"vl": elsewhere}  # named: the model it fits
    with pytest.raises(InputError, match="fits none of the models"):
        assign_mmprojs({"smol": headers["smol"]}, elsewhere)


@pytest.mark.slow
def test_two_models_one_with_vision_over_http(vl_dir, smollm2_gguf, tmp_path):
    import torch
    import transformers
    from PIL import Image

    image_png = png(1)
    src = checkpoint("qwen3vl")
    proc = transformers.AutoImageProcessor.from_pretrained(src)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    image = proc(images=[Image.open(io.BytesIO(image_png))], return_tensors="pt")
    ids = tok("<|im_start|>user\nDescribe<|vision_start|>" + "<|image_pad|>" * 64
              + "<|vision_end|><|im_end|>\n<|im_start|>assistant\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = ref.generate(input_ids=ids, mm_token_type_ids=(ids == ref.config.image_token_id).long(),
                           pixel_values=image["pixel_values"], image_grid_thw=image["image_grid_thw"],
                           max_new_tokens=6, do_sample=False)
    want = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    args = ["--model", str(vl_dir / "tiny-vl.gguf"), "--model", str(smollm2_gguf), "--models-memory", "4G",
            "--ctx", "512", "--slots", "1"]
    with hf2q_server(args, tmp_path) as url, httpx.Client(base_url=url, timeout=120) as client:
        r = client.post("/v1/chat/completions", json=_image_body("tiny-vl", image_png))
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["usage"]["prompt_tokens"] == ids.shape[1]
        text = got["choices"][0]["message"]["content"]
        assert text == want if got["choices"][0]["finish_reason"] == "length" else want.startswith(text)
        r = client.post("/v1/chat/completions", json=_image_body(smollm2_gguf.stem, image_png))
        assert r.status_code == 400, r.text
        assert "does not accept image input" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages[0].content[1]"
        r = client.post("/v1/chat/completions", json={"model": smollm2_gguf.stem, "max_tokens": 3,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
    log = (tmp_path / "serve.log").read_text()
    assert "tiny-vl: vision projector" in log and "found beside the model" in log
