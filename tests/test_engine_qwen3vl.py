"""Qwen3-VL's language model on our engine (``qwen3vl``, ``qwen3vlmoe``) against transformers.

The F32 GGUFs are our own conversions of the tiny checkpoints (``tests/models/qwen3vl.py``; the
conversion itself is checked byte for byte against llama.cpp in ``test_convert_qwen3vl.py``).

* a text-only prompt, chunked prefill then decode steps: logits within 1e-3 of
  ``Qwen3VLForConditionalGeneration`` (dense and MoE);
* explicit 3-D M-RoPE positions shaped like an image grid, image-feature inputs at those tokens
  and deepstack features after the first layers: logits within 1e-3 of transformers' language model
  given the same ``position_ids``, ``inputs_embeds``, ``visual_pos_masks`` and
  ``deepstack_visual_embeds``;
* ``generate`` runs on the converted file.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from hf2q.engine.kv_cache import ForwardBatch
from hf2q.engine.models.qwen3vl import pair_axes, text_positions
from hf2q.engine.runner import MlxModelRunner
from tests.engine_support import random_tokens
from tests.models.qwen3vl import MROPE_SECTION, checkpoint, f32_gguf

TOL_F32 = 1e-3
CHUNK = 16
PROMPT = 40
DECODE = 6


def _hf_model(shape: str):
    import torch
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(checkpoint(shape), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["qwen3vl", "qwen3vl_moe"])
def pair(request):
    """(our runner, transformers model) for one shape."""
    return MlxModelRunner.load(f32_gguf(request.param)), _hf_model(request.param)


def test_pair_axes_interleave_the_sections():
    axes = pair_axes(MROPE_SECTION, 16)  # sections 6/5/5 of 16 pairs: t h w t h w … then t
    assert axes.tolist() == [0, 1, 2] * 5 + [0]
    assert pair_axes([24, 20, 20], 64).tolist()[57:] == [0, 1, 2, 0, 0, 0, 0]  # past 3·20 pairs: time


def test_text_prompt_logits_match_transformers(pair):
    import torch

    runner, model = pair
    assert runner.arch in ("qwen3vl", "qwen3vlmoe")
    tokens = random_tokens(PROMPT + DECODE, seed=7)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens])).logits[0].numpy()
    assert float(ref.std()) > 0.5  # not a flat reference
    seq = runner.new_sequence()
    errs = []
    for i in range(0, PROMPT, CHUNK):
        out = runner.prefill(seq, tokens[i:min(i + CHUNK, PROMPT)])
        errs.append(np.abs(out - ref[min(i + CHUNK, PROMPT) - 1]).max())
    for j, t in enumerate(tokens[PROMPT:]):
        errs.append(np.abs(runner.decode([seq], [t])[0] - ref[PROMPT + j]).max())
    print(f"{runner.arch}: max |logit error| {max(errs):.2e}")
    assert max(errs) < TOL_F32, max(errs)


def _image_like_positions(n_before: int, grid_h: int, grid_w: int, n_after: int) -> np.ndarray:
    """``[3, L]`` M-RoPE ids of text, one image of ``grid_h × grid_w`` merged tokens, text again
    (transformers' ``get_rope_index`` rule: the image at (t, h, w) offsets, text resuming after the max)."""
    t = np.arange(n_before)
    rows = [np.stack([t, t, t])]
    hh, ww = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    img = np.stack([np.zeros(grid_h * grid_w, int), hh.ravel(), ww.ravel()]) + n_before
    rows.append(img)
    start = img.max() + 1
    t = np.arange(start, start + n_after)
    rows.append(np.stack([t, t, t]))
    return np.concatenate(rows, axis=1)


def test_image_positions_inputs_and_deepstack_match_transformers(pair):
    """The multimodal inputs of the language model, vision encoder aside."""
    import torch

    runner, model = pair
    n_before, gh, gw, n_after = 5, 3, 4, 6
    positions = _image_like_positions(n_before, gh, gw, n_after)
    L = positions.shape[1]
    tokens = random_tokens(L, seed=11)
    mask = np.zeros(L, bool)
    mask[n_before:n_before + gh * gw] = True
    rng = np.random.default_rng(3)
    d = model.config.text_config.hidden_size
    lm = model.model.language_model
    with torch.no_grad():
        embeds = lm.embed_tokens(torch.tensor([tokens])).numpy()
    embeds[0, mask] = rng.standard_normal((int(mask.sum()), d)).astype(np.float32) * 3  # "image features"
    deepstack = [rng.standard_normal((int(mask.sum()), d)).astype(np.float32) for _ in range(2)]
    hf_pos = np.concatenate([np.arange(L)[None], positions])[:, None, :]  # [4, 1, L]: text row, then t/h/w
    with torch.no_grad():
        hidden = lm(inputs_embeds=torch.tensor(embeds), position_ids=torch.tensor(hf_pos),
                    visual_pos_masks=torch.tensor(mask[None]),
                    deepstack_visual_embeds=[torch.tensor(x) for x in deepstack]).last_hidden_state
        ref = model.lm_head(hidden)[0].numpy()
        plain = model(input_ids=torch.tensor([tokens])).logits[0].numpy()
    assert np.abs(ref - plain).max() > 0.1  # the multimodal inputs change the output

    def ours(**kw) -> np.ndarray:
        seq = runner.new_sequence()
        fb = ForwardBatch([seq], L, end_point=True)
        logits = runner.model(mx.array([tokens]), fb, last_only=False, **kw)
        mx.eval(logits, fb.eval_state())
        fb.finish()
        return np.array(logits[0])

    got = ours(positions=mx.array(positions[:, None, :].astype(np.int32)), embeddings=mx.array(embeds),
               visual_mask=mx.array(mask[None]), deepstack=[mx.array(x) for x in deepstack])
    print(f"{runner.arch}: image-shaped inputs, max |logit error| {np.abs(got - ref).max():.2e}")
    assert np.abs(got - ref).max() < TOL_F32
    # the grid positions matter: the same inputs at text positions give other logits
    flat = ours(embeddings=mx.array(embeds), visual_mask=mx.array(mask[None]),
                deepstack=[mx.array(x) for x in deepstack])
    assert np.abs(flat - ref).max() > 10 * TOL_F32
    # explicit text positions rotate exactly as the cache-offset fast path
    text = ours(positions=text_positions(0, L))
    np.testing.assert_allclose(text, ours(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(text, plain, atol=TOL_F32, rtol=0)


def test_generate_runs(cli):
    r = cli("generate", "--model", f32_gguf("qwen3vl_moe"), "--prompt", "Hello", "--max-tokens", "4", "--raw")
    assert r.code == 0, r.err
    assert r.out.strip()


def test_batched_decode_equals_single_decodes(pair):
    """Two sequences at different lengths decoded in one step (an offset array on the fast path)."""
    runner, _ = pair
    a, b = random_tokens(12, seed=1), random_tokens(7, seed=2)
    singles = []
    for prompt in (a, b):
        seq = runner.new_sequence()
        runner.prefill(seq, prompt)
        singles.append(runner.decode([seq], [42])[0])
    seqs = [runner.new_sequence(), runner.new_sequence()]
    for seq, prompt in zip(seqs, (a, b)):
        runner.prefill(seq, prompt)
    both = runner.decode(seqs, [42, 42])
    np.testing.assert_allclose(both, np.stack(singles), atol=1e-4, rtol=0)
