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
from tests.models.qwen3vl import checkpoint, f32_gguf

TOL = 1e-4


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """(our encoder over the F32 mmproj, transformers' model, the mmproj's path)."""
    import torch
    import transformers

    from hf2q.convert.mmproj import convert_mmproj
    from hf2q.formats.gguf_file import open_gguf

    src = checkpoint("qwen3vl")
    path = tmp_path_factory.mktemp("mmproj") / "mmproj-f32.gguf"
    convert_mmproj(src, path, "f32")
    model = transformers.AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    return Qwen3VLVisionEncoder(open_gguf(path)), model, path


@pytest.mark.parametrize("grid", [(1, 4, 6), (2, 6, 4)], ids=["image", "clip"])
def test_features_match_transformers(encoders, grid):
    import torch

    ours, model, _ = encoders
    theirs = model.model.visual
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


IMAGE_PAD, VISION_START, VISION_END = 151655, 151652, 151653


def test_prompt_with_an_image_matches_transformers(encoders):
    """Processor cut → our encoder → features spliced into the prompt at M-RoPE grid positions with
    deepstack → our text model, prefill and one decode step after the image, against
    ``Qwen3VLForConditionalGeneration`` given the same image."""
    import mlx.core as mx
    import torch
    import transformers

    from hf2q.engine.kv_cache import ForwardBatch
    from hf2q.engine.models.qwen3vl import text_positions
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.engine.vision.prompt_images import ImageStore, PreparedImage, chunk_positions, image_token
    ours_vision, model, _ = encoders
    src = checkpoint("qwen3vl")
    runner = MlxModelRunner.load(f32_gguf("qwen3vl"))
    image = np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    rows, grid = patchify(np.stack([ours_vision.normalise(image)] * 2), 16, 2)
    n_image = grid[0] * grid[1] * grid[2] // 4
    tokens = [9707, 11, 1879, 25, VISION_START] + [IMAGE_PAD] * n_image + [VISION_END, 3555, 374, 419]
    nxt = 279
    proc = transformers.AutoImageProcessor.from_pretrained(src)
    pixels = proc(images=[image], do_resize=False, return_tensors="pt")

    def reference(ids):
        ids = torch.tensor([ids])
        with torch.no_grad():
            return model(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                         mm_token_type_ids=(ids == IMAGE_PAD).int()).logits[0].numpy()

    ref, ref_next = reference(tokens), reference(tokens + [nxt])[-1]
    with torch.no_grad():
        text_only = model(input_ids=torch.tensor([tokens])).logits[0].numpy()
    assert np.abs(ref - text_only).max() > 0.1  # the image matters

    feats = ours_vision(rows, grid)
    mask = np.asarray(tokens) == IMAGE_PAD
    embeds = np.array(runner.model.embed.rows(mx.array(tokens)))
    embeds[mask] = np.array(feats.merged)
    store = ImageStore()  # the server's M-RoPE ids: the image's tokens name it, as the runtime's prompts do
    store.add(1, PreparedImage(rows, grid, 2))
    ids = iter(range(n_image))
    positions, ends, _ = chunk_positions([image_token(1, next(ids)) if t == IMAGE_PAD else t for t in tokens],
                                         0, 0, store)
    next_pos = len(tokens) + ends[-1][1]
    seq = runner.new_sequence()
    fb = ForwardBatch([seq], len(tokens), end_point=True)
    got = runner.model(mx.array([tokens]), fb, last_only=False, positions=mx.array(positions[:, None, :]),
                       embeddings=mx.array(embeds[None]), visual_mask=mx.array(mask[None]), deepstack=feats.deepstack)
    mx.eval(got, fb.eval_state())
    fb.finish()
    err = np.abs(np.array(got[0]) - ref).max()
    # the token after the prompt continues from the image's M-RoPE id, not from the cache length
    fb = ForwardBatch([seq], 1)
    step = runner.model(mx.array([[nxt]]), fb, positions=text_positions(next_pos, 1))
    mx.eval(step)
    fb.finish()
    err_next = np.abs(np.array(step[0]) - ref_next).max()
    # the same prompt in two chunks cut inside the image: each chunk its slice of ids, inputs and deepstack rows
    cut, seq2, outs = 8, runner.new_sequence(), []
    for lo, hi in ((0, cut), (cut, len(tokens))):
        vis = slice(int(mask[:lo].sum()), int(mask[:hi].sum()))
        fb = ForwardBatch([seq2], hi - lo, end_point=True)
        out = runner.model(mx.array([tokens[lo:hi]]), fb, last_only=False,
                           positions=mx.array(positions[:, None, lo:hi]), embeddings=mx.array(embeds[None, lo:hi]),
                           visual_mask=mx.array(mask[None, lo:hi]), deepstack=[d[vis] for d in feats.deepstack])
        mx.eval(out, fb.eval_state())
        fb.finish()
        outs.append(np.array(out[0]))
    np.testing.assert_allclose(np.concatenate(outs), np.array(got[0]), atol=1e-4, rtol=0)
    print(f"image prompt: max |logit error| {err:.2e}, next step {err_next:.2e}")
    assert err < 1e-3 and err_next < 1e-3
    assert next_pos < len(tokens)  # the 2×3 merged image spans 3 ids, not 6


@pytest.mark.parametrize("size", [(50, 70), (300, 41), (64, 96)])
def test_prepare_is_the_processors_resize_and_cut(encoders, size):
    """Pillow's bicubic resize to the processor's size (a small pixel budget so it shrinks and grows)."""
    import transformers

    from hf2q.engine.vision.qwen3vl import smart_resize

    ours, _, _ = encoders
    budget = {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 12}
    image = np.random.default_rng(size[0]).integers(0, 256, (*size, 3), dtype=np.uint8)
    proc = transformers.AutoImageProcessor.from_pretrained(checkpoint("qwen3vl"), backend="pil", size=budget)
    out = proc(images=[image], return_tensors="np")
    rows, grid = ours.prepare(image, budget["shortest_edge"], budget["longest_edge"])
    assert list(out["image_grid_thw"][0]) == list(grid)
    np.testing.assert_allclose(rows, out["pixel_values"], atol=1e-5, rtol=0)
    h, w = smart_resize(*size, 32, budget["shortest_edge"], budget["longest_edge"])
    assert h % 32 == w % 32 == 0 and budget["shortest_edge"] <= h * w <= budget["longest_edge"]


def test_a_q8_0_mmproj_runs_quantized_and_close(encoders, tmp_path):
    """The Q8_0 projector (as llama.cpp's converter writes it) through MLX's quantized matmuls: near F32's features."""
    from hf2q.convert.mmproj import convert_mmproj
    from hf2q.formats.gguf_file import open_gguf

    f32, _, _ = encoders
    convert_mmproj(checkpoint("qwen3vl"), tmp_path / "q8.gguf", "q8_0")
    q8 = Qwen3VLVisionEncoder(open_gguf(tmp_path / "q8.gguf"))
    assert q8.blocks[0].qkv.quantized and q8.merger.fc1.quantized
    patches = np.random.default_rng(0).standard_normal((24, 3 * 2 * 16 * 16)).astype(np.float32)
    want, got = np.array(f32(patches, (1, 4, 6)).merged), np.array(q8(patches, (1, 4, 6)).merged)
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()  # measured: 0.053 of a 5.0 peak
