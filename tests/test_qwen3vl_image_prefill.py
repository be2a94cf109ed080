"""A prompt with an image through ``MlxModelRunner`` (tiny Qwen3-VL, F32) against transformers.

The image's tokens are ``hf2q.engine.vision.prompt_images`` ids; the runner encodes the image inside
its prefill call and splices the merged and deepstack features in. The reference is
``Qwen3VLForConditionalGeneration`` given the same patches (``test_vision_qwen3vl.py`` checks that our
cut equals its processor's). Prefill chunks cut through the image; the decode steps after it run at
text positions behind the cache length; a trim back into the text after the image and a second image
at another place keep agreeing.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from hf2q.engine.runner import MlxModelRunner
from hf2q.engine.vision.prompt_images import ImageStore, PreparedImage, content_key, image_token
from hf2q.engine.vision.qwen3vl import Qwen3VLVisionEncoder, patchify
from tests.engine_support import random_tokens
from tests.models.qwen3vl import checkpoint, f32_gguf

TOL = 1e-3
IMAGE_TOKEN = 151655  # the fixture config's image_token_id


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch
    import transformers

    from hf2q.convert.mmproj import convert_mmproj
    from hf2q.formats.gguf_file import open_gguf

    path = tmp_path_factory.mktemp("mmproj") / "mmproj-f32.gguf"
    convert_mmproj(checkpoint("qwen3vl"), path, "f32")
    encoder = Qwen3VLVisionEncoder(open_gguf(path))
    runner = MlxModelRunner.load(f32_gguf("qwen3vl"))
    store = ImageStore()
    runner.attach_vision(encoder, store)
    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint("qwen3vl"), dtype=torch.float32).eval()
    return runner, store, encoder, model


def _image(encoder, store, seed: int, h: int, w: int):
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    patches, grid = patchify(np.stack([encoder.normalise(pixels)] * 2), encoder.patch, encoder.merge)
    image = PreparedImage(patches, grid, encoder.merge)
    key = content_key(pixels.tobytes())
    store.add(key, image)
    return key, image


def _reference(model, pieces) -> np.ndarray:
    """transformers' logits of a prompt of text runs and ``(key, image)`` pieces."""
    import torch

    ids, pixels, grids, kinds = [], [], [], []
    for piece in pieces:
        if isinstance(piece, list):
            ids += piece
            kinds += [0] * len(piece)
        else:
            ids += [IMAGE_TOKEN] * piece[1].n_tokens
            kinds += [1] * piece[1].n_tokens
            pixels.append(piece[1].patches)
            grids.append(piece[1].grid)
    if not pixels:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0].numpy()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([kinds]), pixel_values=torch.tensor(np.concatenate(pixels)),
                    image_grid_thw=torch.tensor(grids))
    return out.logits[0].numpy()


def _ours(pieces) -> list[int]:
    out = []
    for piece in pieces:
        out += piece if isinstance(piece, list) else [image_token(piece[0], i) for i in range(piece[1].n_tokens)]
    return out


def test_image_prompt_prefill_and_decode_match_transformers(setup):
    runner, store, encoder, model = setup
    image = _image(encoder, store, 1, 64, 96)  # a 4×6 patch grid: 2×3 merged tokens
    decode = random_tokens(4, seed=5)
    pieces = [random_tokens(5, seed=3), image, random_tokens(7, seed=4) + decode]
    ref = _reference(model, pieces)
    tokens = _ours(pieces)
    n_prompt = len(tokens) - len(decode)
    filler = random_tokens(n_prompt - 5, seed=9)  # text where the image and the text after it were
    text_only = _reference(model, [tokens[:5] + filler])
    assert np.abs(ref[n_prompt - 1] - text_only[n_prompt - 1]).max() > 0.1  # the image matters
    seq = runner.new_sequence()
    errs = []
    for a in range(0, n_prompt, 4):  # chunks of 4 cut through the image's 6 tokens
        b = min(a + 4, n_prompt)
        errs.append(np.abs(runner.prefill(seq, tokens[a:b]) - ref[b - 1]).max())
    for j, t in enumerate(decode[:-1]):
        errs.append(np.abs(runner.decode([seq], [t])[0] - ref[n_prompt + j]).max())
    print(f"image prompt: max |logit error| {max(errs):.2e}")
    assert max(errs) < TOL, errs
    # back into the text after the image, then on again: the shift is still the image's
    seq.trim(n_prompt - 3)
    again = runner.prefill(seq, tokens[n_prompt - 3:n_prompt])
    assert np.abs(again - ref[n_prompt - 1]).max() < TOL
    # back before the image ended: its shift goes with it, text there runs at plain positions
    seq.trim(5)
    plain = runner.prefill(seq, filler)
    assert np.abs(plain - text_only[-1]).max() < TOL


def test_batched_decode_with_shifted_and_plain_sequences(setup):
    """A sequence behind its length and a text-only one decode in one step, as they do alone."""
    runner, store, encoder, model = setup
    image = _image(encoder, store, 2, 96, 64)  # 3×2 merged tokens, a second image
    pieces = [random_tokens(3, seed=6), image, random_tokens(4, seed=7)]
    tokens, plain = _ours(pieces), random_tokens(9, seed=8)
    singles = []
    for prompt in (tokens, plain):
        seq = runner.new_sequence()
        runner.prefill(seq, prompt)
        singles.append(runner.decode([seq], [42])[0])
    ref = _reference(model, pieces[:2] + [pieces[2] + [42]])
    assert np.abs(singles[0] - ref[-1]).max() < TOL
    seqs = [runner.new_sequence(), runner.new_sequence()]
    for seq, prompt in zip(seqs, (tokens, plain)):
        runner.prefill(seq, prompt)
    both = runner.decode(seqs, [42, 42])
    np.testing.assert_allclose(both, np.stack(singles), atol=1e-4, rtol=0)


def test_text_only_runner_refuses_vision(setup):
    from hf2q.errors import InputError

    runner, _store, encoder, _model = setup
    with pytest.raises(InputError, match="text-only"):
        text = MlxModelRunner.__new__(MlxModelRunner)
        text.model, text.gguf, text.arch = object(), runner.gguf, "llama"
        text.attach_vision(encoder, ImageStore())
