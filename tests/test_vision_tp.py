"""Images at tensor parallelism 2 on CPU (tiny Qwen3-VL, F32): rank 0 encodes, the followers take the
features with the first prefill command that reads them (``hf2q.engine.vision.tp_images``).

The reference is the same GGUF and projector on one rank: a prompt of text, an image and text
prefilled in chunks that cut the image, then greedy decode steps after it (text behind the cache
length); and the prompt's K/V moved into a fresh sequence (export/import, as a persistent-KV
restore does) whose shifts ``plan_images`` sets on every rank — the next chunk and decode step agree.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.models.qwen3vl import checkpoint, f32_gguf
from tests.test_tp_multihost import ROOT

CTX = 256

DRIVER = r"""
import sys
import numpy as np
sys.path.insert(0, {root!r})
from hf2q.engine import tp_launch
path, mmproj, out = sys.argv[1], sys.argv[2], sys.argv[3]
runner = tp_launch.runner_factory(path, 2, {ctx})()
from tests.test_vision_tp import scenario
result = scenario(runner, mmproj)
np.savez(out, sends=runner._sent_images.sends, **result)
runner.close()
"""


def scenario(runner, mmproj: str) -> dict[str, np.ndarray]:
    from hf2q.engine.vision.encode_job import plan_images
    from hf2q.engine.vision.prompt_images import ImageStore, PreparedImage, image_token, warm_up_images
    from hf2q.engine.vision.qwen3vl import Qwen3VLVisionEncoder, patchify
    from hf2q.formats.gguf_file import open_gguf
    from tests.engine_support import random_tokens

    enc = Qwen3VLVisionEncoder(open_gguf(mmproj), runner.dtype)
    store = ImageStore()
    runner.attach_vision(enc, store)
    warm_up_images(runner)  # what serve does before ready: an image through every rank
    pixels = np.random.default_rng(5).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    patches, grid = patchify(np.stack([enc.normalise(pixels)] * 2), enc.patch, enc.merge)
    image = PreparedImage(patches, grid, enc.merge)
    store.add(77, image)
    head = random_tokens(5, seed=1) + [image_token(77, i) for i in range(image.n_tokens)] + random_tokens(7, seed=2)
    tail = random_tokens(4, seed=3)
    seq = runner.new_sequence()
    chunks = [runner.prefill(seq, head[a:a + 4]) for a in range(0, len(head), 4)]  # 4-token chunks cut the image
    out = {"chunks": np.stack(chunks), "tail": runner.prefill(seq, tail)}
    tok, steps = int(out["tail"].argmax()), []
    for _ in range(3):
        steps.append(runner.decode([seq], [tok])[0])
        tok = int(steps[-1].argmax())
    out["decode"] = np.stack(steps)
    moved = runner.new_sequence()
    runner.import_kv(moved, runner.export_kv(seq, 0, len(head)), len(head))
    assert plan_images(runner, moved, head + tail, len(head)) == []
    out["moved_tail"] = runner.prefill(moved, tail)
    out["moved_decode"] = runner.decode([moved], [42])[0]
    return out


@pytest.mark.slow
def test_two_ranks_serve_an_image_as_one_rank(tmp_path, monkeypatch):
    from hf2q.convert.mmproj import convert_mmproj
    from hf2q.engine.runner import MlxModelRunner

    mmproj = tmp_path / "mmproj-f32.gguf"
    convert_mmproj(checkpoint("qwen3vl"), mmproj, "f32")
    model = f32_gguf("qwen3vl")
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT), ctx=CTX))
    run = subprocess.run([sys.executable, str(script), str(model), str(mmproj), str(tmp_path / "tp.npz")], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    with np.load(tmp_path / "tp.npz") as z:
        tp = {k: z[k] for k in z.files}
    monkeypatch.setenv("HF2Q_NO_HOST_DECODE", "1")  # rank 0 of a group runs the MLX graph
    ref = scenario(MlxModelRunner.load(model, ctx=CTX), str(mmproj))
    for key in ("chunks", "tail", "decode", "moved_tail", "moved_decode"):
        scale = float(np.abs(ref[key]).max())
        np.testing.assert_allclose(tp[key], ref[key], rtol=0, atol=1e-4 * scale, err_msg=key)
        np.testing.assert_array_equal(tp[key].argmax(-1), ref[key].argmax(-1), err_msg=key)
    np.testing.assert_allclose(tp["moved_tail"], tp["tail"], rtol=0, atol=1e-4 * float(np.abs(tp["tail"]).max()))
    assert int(tp["sends"]) == 2  # the warm-up image and the prompt's, each once for all the chunks that cut it


@pytest.mark.slow
async def test_served_at_two_ranks_answers_an_image_as_one_rank(tmp_path):
    """``hf2q serve --mmproj --tensor-parallel 2`` (a real process) and the one-rank server, same image
    request through a real HTTP client: the same T=0 reply, and the same image prefix reused after it."""
    import httpx
    import trio

    from tests.models.qwen3vl_serve import data_uri, mmproj_f32, png, vision_server
    from tests.serve_support import hf2q_server

    mmproj = mmproj_f32(tmp_path)
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                                      {"type": "image_url", "image_url": {"url": data_uri(png(1))}}]}],
            "temperature": 0, "max_tokens": 6}

    def ask(url: str) -> list[dict]:
        with httpx.Client(base_url=url, timeout=120) as client:
            return [client.post("/v1/chat/completions", json=body).json() for _ in range(2)]

    async with vision_server(mmproj, slots=1, ctx=512) as (url, _, _):
        want = await trio.to_thread.run_sync(ask, url)
    args = ["--model", str(f32_gguf("qwen3vl")), "--mmproj", str(mmproj), "--tensor-parallel", "2",
            "--ctx", "512", "--slots", "1"]
    with hf2q_server(args, tmp_path) as url:
        got = ask(url)
    for g, w in zip(got, want, strict=True):
        assert g["choices"][0]["message"]["content"] == w["choices"][0]["message"]["content"]
        assert g["usage"] == w["usage"]
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 64  # through the image
