"""Qwen3-VL's vision encoder (``hf2q/engine/vision/qwen3vl.py``) over our mmproj GGUF, against transformers.

The mmproj is ``hf2q convert --mmproj`` of the tiny dense checkpoint in F32 (its bytes are checked
against llama.cpp's converter in ``test_convert_qwen3vl.py``). The same patches go through
transformers' ``Qwen3VLVisionModel``: the merged image features and both deepstack feature sets must
agree within 1e-4, for a single image and for a two-frame-pair clip on a non-square grid; our
``patchify`` must cut an image exactly as transformers' image processor does.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from hf2q.engine.vision.qwen3vl import Qwen3VLVisionEncoder, bilinear_taps, patchify
from tests.models.qwen3vl import checkpoint

TOL = 1e-4


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """(our encoder over the F32 mmproj, transformers' vision tower, the mmproj's path)."""
    import torch
    import transformers

    from hf2q.convert.mmproj import convert_mmproj
    from hf2q.formats.gguf_file import open_gguf

    src = checkpoint("qwen3vl")
    path = tmp_path_factory.mktemp("mmproj") / "mmproj-f32.gguf"
    convert_mmproj(src, path, "f32")
    model = transformers.AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    return Qwen3VLVisionEncoder(open_gguf(path)), model.model.visual, path


@pytest.mark.parametrize("grid", [(1, 4, 6), (2, 6, 4)], ids=["image", "clip"])
def test_features_match_transformers(encoders, grid):
    import torch

    ours, theirs, _ = encoders
    t, h, w = grid
    patches = np.random.default_rng(sum(grid)).standard_normal((t * h * w, 3 * 2 * 16 * 16)).astype(np.float32)
    with torch.no_grad():
        ref = theirs(torch.tensor(patches), grid_thw=torch.tensor([grid]))
    got = ours(patches, grid)
    assert got.merged.shape == (t * h * w // 4, 64)  # one feature per 2×2 block, in the text width
    assert len(got.deepstack) == 2 == len(ref.deepstack_features)
    merged = ref.pooler_output.numpy()
    assert float(merged.std()) > 0.1
    np.testing.assert_allclose(np.array(got.merged), merged, atol=TOL, rtol=0)
    for a, b in zip(got.deepstack, ref.deepstack_features):
        np.testing.assert_allclose(np.array(a), b.numpy(), atol=TOL, rtol=0)


def test_patchify_is_the_processors_cut(encoders):
    import transformers

    ours, _, _ = encoders
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    proc = transformers.AutoImageProcessor.from_pretrained(checkpoint("qwen3vl"))
    out = proc(images=[image], do_resize=False, return_tensors="np")
    frames = np.stack([ours.normalise(image)] * 2)  # a still image is its own second frame
    rows, grid = patchify(frames, 16, 2)
    assert list(out["image_grid_thw"][0]) == list(grid) == [1, 4, 6]
    np.testing.assert_allclose(rows, out["pixel_values"], atol=1e-5, rtol=0)


def test_position_resampling_keeps_the_table_on_its_own_grid():
    # an 8×8 table resampled to 8×8 is the identity: one tap of weight 1 per patch, in merge-block order
    idx, wts = bilinear_taps(8, 8, 8, 2)
    first = idx[np.arange(64), wts.argmax(axis=1)]
    assert np.allclose(wts.max(axis=1), 1.0)
    assert first[:4].tolist() == [0, 1, 8, 9]  # the first 2×2 block


def test_not_a_qwen3vl_mmproj_is_refused(encoders):
    from hf2q.errors import InputError
    from hf2q.formats.gguf_file import open_gguf
    from hf2q.formats.gguf_keys import Keys

    g = open_gguf(encoders[2])
    g.metadata[Keys.Clip.PROJECTOR_TYPE] = "gemma3"
    with pytest.raises(InputError, match="not a Qwen3-VL mmproj"):
        Qwen3VLVisionEncoder(g)
