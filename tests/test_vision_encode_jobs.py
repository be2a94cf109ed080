"""The engine side of serving images (tiny Qwen3-VL, F32): an encode in bounded pieces, and the M-RoPE
shifts of a prefix whose K/V came from elsewhere (the persistent KV store).

* ``begin`` / ``advance`` (one block at a time) / ``finish`` give exactly the one-call encoder's
  features, which ``test_vision_qwen3vl.py`` checks against transformers.
* A prompt with an image, prefilled in one sequence and its K/V moved block by block into a fresh
  one (export/import, as a restore does): after ``plan_images`` the fresh sequence's next chunk
  and decode step give the cold sequence's logits; without it they do not.
* The block key of a block holding an image's tokens names the image: another image, another key.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from hf2q.engine.runner import MlxModelRunner
from hf2q.engine.vision.encode_job import ImageEncodeJob, plan_images
from hf2q.engine.vision.prompt_images import ImageStore, PreparedImage, image_token
from hf2q.engine.vision.qwen3vl import Qwen3VLVisionEncoder, patchify
from tests.engine_support import random_tokens
from tests.models.qwen3vl import checkpoint, f32_gguf


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from hf2q.convert.mmproj import convert_mmproj
    from hf2q.formats.gguf_file import open_gguf

    path = tmp_path_factory.mktemp("mmproj") / "mmproj-f32.gguf"
    convert_mmproj(checkpoint("qwen3vl"), path, "f32")
    runner = MlxModelRunner.load(f32_gguf("qwen3vl"))
    runner.attach_vision(Qwen3VLVisionEncoder(open_gguf(path)), ImageStore())
    return runner


def _add_image(runner, seed: int, h: int = 64, w: int = 96) -> tuple[int, PreparedImage]:
    enc = runner.vision
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    patches, grid = patchify(np.stack([enc.normalise(pixels)] * 2), enc.patch, enc.merge)
    image = PreparedImage(patches, grid, enc.merge)
    runner.images.add(seed, image)
    return seed, image


def test_an_encode_in_pieces_is_the_whole_encode(runner, monkeypatch):
    import mlx.core as mx

    from hf2q.engine.vision import encode_job

    key, image = _add_image(runner, 11)
    monkeypatch.setattr(encode_job, "JOB_PATCH_BLOCKS", len(image.patches))  # one block per job
    whole = runner.vision(image.patches, image.grid)
    job, outcomes = ImageEncodeJob(key), []
    while not outcomes or outcomes[-1] == "running":
        outcomes.append(job.step(runner).outcome)
    assert outcomes == ["running"] * (len(runner.vision.blocks) - 1) + ["encoded"]
    got = runner.images.cached_features(key)
    assert mx.array_equal(got.merged, whole.merged)
    assert all(mx.array_equal(a, b) for a, b in zip(got.deepstack, whole.deepstack, strict=True))
    assert ImageEncodeJob(key).step(runner).outcome == "cached"
    bad = ImageEncodeJob(12345).step(runner)  # an image the store does not hold: its request fails, 400
    assert bad.outcome == "failed" and bad.status == 400 and "does not hold" in bad.message


def test_a_moved_prefix_with_an_image_gets_its_positions_back(runner):
    key, image = _add_image(runner, 21)
    head = random_tokens(5, seed=1) + [image_token(key, i) for i in range(image.n_tokens)] + random_tokens(7, seed=2)
    tail = random_tokens(4, seed=3)
    cold = runner.new_sequence()
    runner.prefill(cold, head)
    want_prefill = runner.prefill(cold, tail)
    want_decode = runner.decode([cold], [42])[0]

    def moved(plan: bool):
        seq = runner.new_sequence()
        src = runner.new_sequence()
        runner.prefill(src, head)
        for a in range(0, len(head), 6):  # blocks of 6 tokens, as a restore imports them
            b = min(a + 6, len(head))
            runner.import_kv(seq, runner.export_kv(src, a, b), b - a)
        if plan:
            jobs = plan_images(runner, seq, head + tail, len(head))
            assert jobs == []  # every image is in the moved prefix: nothing to encode
        return seq

    seq = moved(plan=True)
    assert seq.mrope_shifts == cold.mrope_shifts[:1]
    np.testing.assert_allclose(runner.prefill(seq, tail), want_prefill, atol=1e-4, rtol=0)
    np.testing.assert_allclose(runner.decode([seq], [42])[0], want_decode, atol=1e-4, rtol=0)
    stale = moved(plan=False)  # without the shifts, the text after the image sits at the wrong ids
    assert np.abs(runner.prefill(stale, tail) - want_prefill).max() > 1e-3
    # a restored text-only prefix clears shifts its sequence kept from an earlier prompt's image
    reused = runner.new_sequence()
    reused.mrope_shifts = [(3, -5)]
    assert plan_images(runner, reused, tail + tail, len(tail)) == [] and reused.mrope_shifts == []
    # the images still to prefill are planned once each, in prompt order
    other, _ = _add_image(runner, 22)
    rest = [image_token(other, i) for i in range(6)] + [7] + [image_token(key, 0)]
    assert [j.key for j in plan_images(runner, runner.new_sequence(), head + rest + rest, len(head))] == [other, key]


def test_block_keys_name_the_image():
    from hf2q.kvstore.fingerprint import block_hashes, token_bytes
    from hf2q.kvstore import BLOCK_TOKENS

    text = random_tokens(BLOCK_TOKENS - 4, seed=4)
    one = text + [image_token(1, i) for i in range(4)]
    two = text + [image_token(2, i) for i in range(4)]
    assert block_hashes("fp", one) != block_hashes("fp", two)
    assert block_hashes("fp", one) == block_hashes("fp", list(one))
    assert token_bytes(text) == np.asarray(text, "<u4").tobytes()  # text-only keys as they always were
    with pytest.raises(ValueError, match="negative"):
        token_bytes([1, -1])
