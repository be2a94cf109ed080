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

from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q.engine.runner import MlxModelRunner
from hf2q.engine.vision.prompt_images import ImageStore, PreparedImage, chunk_positions, content_key, image_token
from hf2q.engine.vision.qwen3vl import Qwen3VLVisionEncoder, patchify
from tests.engine_support import random_tokens
from tests.models.qwen3vl import checkpoint, f32_gguf

TOL = 1e-3
IMAGE_TOKEN = 151655  # the fixture config's image_token_id


@pytest.fixture(scope="module", params=["qwen3vl", "qwen3vl_moe"])
def setup(request, tmp_path_factory):
    import torch
    import transformers

    from hf2q.convert.mmproj import convert_mmproj
    from hf2q.formats.gguf_file import open_gguf

    path = tmp_path_factory.mktemp("mmproj") / "mmproj-f32.gguf"
    convert_mmproj(checkpoint(request.param), path, "f32")
    encoder = Qwen3VLVisionEncoder(open_gguf(path))
    runner = MlxModelRunner.load(f32_gguf(request.param))
    store = ImageStore()
    runner.attach_vision(encoder, store)
    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint(request.param),
                                                                     dtype=torch.float32).eval()
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
    print(f"{runner.arch} image prompt: max |logit error| {max(errs):.2e}")
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


def test_text_only_runner_refuses_vision(smollm2_gguf):
    from hf2q.errors import InputError

    runner = MlxModelRunner.load(smollm2_gguf)
    with pytest.raises(InputError, match="text-only model"):
        runner.attach_vision(object(), ImageStore())
    seq = runner.new_sequence()
    with pytest.raises(InputError, match="outside the vocabulary"):  # image ids only where images are served
        runner.prefill(seq, [1, image_token(0, 0)])


@pytest.fixture(scope="module")
def rope_index():
    """transformers' ``get_rope_index`` of the tiny checkpoint's config (random weights: only its rule is used)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(checkpoint("qwen3vl"))
    return transformers.Qwen3VLModel(config).get_rope_index


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_chunked_positions_are_the_whole_prompts(rope_index, data):
    """However a prompt of text and images is cut into chunks, the chunks' M-RoPE ids (each from the
    shift the previous ones left) are transformers' ``get_rope_index`` of the whole prompt."""
    import torch

    merge = 2
    store, tokens, marked, grids = ImageStore(), [], [], []
    for k in range(data.draw(st.integers(1, 3), label="images")):
        n_text = data.draw(st.integers(0 if k == 0 else 1, 4))  # text (a vision_start at least) between images
        tokens += random_tokens(n_text, seed=k) if n_text else []
        marked += [0] * n_text
        grid = (1, 2 * data.draw(st.integers(1, 4)), 2 * data.draw(st.integers(1, 4)))
        image = PreparedImage(np.zeros((0, 1)), grid, merge)
        store.add(k, image)
        tokens += [image_token(k, i) for i in range(image.n_tokens)]
        marked += [IMAGE_TOKEN] * image.n_tokens
        grids.append(grid)
    tail = data.draw(st.integers(0, 4))
    tokens += random_tokens(tail, seed=9) if tail else []
    marked += [0] * tail
    is_image = torch.tensor([marked]) == IMAGE_TOKEN
    want, _ = rope_index(torch.tensor([marked]), is_image.int(), image_grid_thw=torch.tensor(grids))
    want = want[:, 0].numpy()
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(tokens) - 1), max_size=4)) if len(tokens) > 1 else []))
    got, shift = [], 0
    for a, b in zip([0, *cuts], [*cuts, len(tokens)]):
        pos, ends, _ = chunk_positions(tokens[a:b], a, shift, store)
        got.append(pos)
        shift = ends[-1][1] if ends else shift
    np.testing.assert_array_equal(np.concatenate(got, axis=1), want)
    # a draft that copies a few of an image's tokens and then text (speculative decoding) is no error
    store.add(7, PreparedImage(np.zeros((0, 1)), (1, 4, 4), merge))  # 2×2 merged tokens
    pos, ends, runs = chunk_positions([image_token(7, 1), image_token(7, 2), 5, image_token(7, 9)], 3, 0, store)
    assert not ends and [r[1].tolist() for r in runs] == [[1, 2]]
    assert pos[:, 2].tolist() == [5] * 3 and pos[:, 3].tolist() == [6] * 3  # text ids, and a stray id as text


def test_pipelined_decode_after_an_image_follows_the_shift(setup, monkeypatch):
    """The MLX graph's device-sampled, pipelined decode (a GPU's path; here without the CPU host step)
    after an image: greedy tokens chained through ``PendingTokens`` are transformers' argmax."""
    from hf2q.engine.sampling.device import DeviceSampler
    from hf2q.sched.contracts import SamplingParams

    runner, store, encoder, model = setup
    monkeypatch.setenv("HF2Q_NO_HOST_DECODE", "1")
    graph = MlxModelRunner.load(runner.gguf)
    assert graph.pipelines_decode
    graph.attach_vision(encoder, store)
    image = _image(encoder, store, 3, 64, 64)
    prompt = _ours([random_tokens(4, seed=10), image, random_tokens(3, seed=11)])
    seq = graph.new_sequence()
    first = int(np.argmax(graph.prefill(seq, prompt)))
    sampler = [DeviceSampler(SamplingParams(temperature=0.0))]
    pending, fed = graph.decode_async([seq], [first], sampler), [first]
    for _ in range(3):
        nxt = graph.decode_async([seq], pending, sampler)
        fed.append(int(pending.result()[0][0]))
        pending = nxt
    fed.append(int(pending.result()[0][0]))
    ref = _reference(model, [random_tokens(4, seed=10), image, random_tokens(3, seed=11) + fed[:-1]])
    assert fed == [int(t) for t in ref[len(prompt) - 1:].argmax(axis=1)]


def test_the_store_evicts_only_released_images():
    from hf2q.errors import InputError

    rows = lambda: np.zeros((16, 64), np.float32)  # noqa: E731  4 KiB of patch rows
    store = ImageStore(capacity=2 * rows().nbytes)
    for key in range(4):
        store.add(key, PreparedImage(rows(), (1, 4, 4), 2))
    assert store.holds == 4 and all(store.get(k) for k in range(4))  # held: kept beyond the capacity
    store.release([0, 1, 2])
    with pytest.raises(InputError, match="does not hold"):
        store.get(0)  # the oldest released one went; two images' worth stay
    assert store.get(2) is not None and store.get(3) is not None and store.holds == 1
