"""Slot KV caches: a batched decode over caches of different lengths equals single decodes;
trimming to a prefix and export/import of KV reproduce the cold computation."""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from tests.engine_support import convert_f32, load_runner, random_tokens


@pytest.fixture(scope="module")
def runners(tiny_checkpoint, tmp_path_factory):
    out = {}
    for family in ("llama", "gemma3"):
        src = tiny_checkpoint(family)
        out[family] = load_runner(convert_f32(src, tmp_path_factory.mktemp(family) / "m.gguf"), src)
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_decode_equals_single_decodes(family, runners):
    r = runners[family]
    prompts = [random_tokens(n, seed=n) for n in (3, 11, 20, 7)]  # gemma3 window is 16
    batch = [r.new_sequence() for _ in prompts]
    alone = [r.new_sequence() for _ in prompts]
    first = [int(np.argmax(r.prefill(s, p))) for s, p in zip(batch, prompts)]
    for s, p in zip(alone, prompts):
        r.prefill(s, p)
    tok_b, tok_a = list(first), list(first)
    for _ in range(6):
        logits_b = r.decode(batch, tok_b)
        logits_a = np.stack([r.decode([s], [t])[0] for s, t in zip(alone, tok_a)])
        np.testing.assert_allclose(logits_b, logits_a, atol=1e-4, rtol=0)
        tok_b = [int(t) for t in np.argmax(logits_b, -1)]
        tok_a = [int(t) for t in np.argmax(logits_a, -1)]
        assert tok_b == tok_a
    assert [s.length for s in batch] == [len(p) + 6 for p in prompts]


def test_trim_reuses_a_prefix(runners):
    r = runners["llama"]
    tokens = random_tokens(30, seed=3)
    cold = r.new_sequence()
    ref = r.prefill(cold, tokens)
    warm = r.new_sequence()
    r.prefill(warm, tokens[:20] + random_tokens(10, seed=9))  # diverges after 20 tokens
    warm.trim(20)
    assert warm.length == 20
    np.testing.assert_allclose(r.prefill(warm, tokens[20:]), ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError):
        warm.trim(31)


def test_export_import_roundtrip(runners):
    r = runners["llama"]  # every layer exported as rows; a windowed model's blocks: test_kvstore_window_engine.py
    tokens = random_tokens(25, seed=4)
    src = r.new_sequence()
    r.prefill(src, tokens)
    ref = r.decode([src], [7])[0]
    dst = r.new_sequence()
    for a, b in ((0, 16), (16, 25)):
        arrays = r.export_kv(src, a, b)
        assert arrays["k.0"].dtype == np.float32 and arrays["k.0"].shape[1] == b - a
        r.import_kv(dst, arrays, b - a)
    assert dst.length == 25
    np.testing.assert_allclose(r.decode([dst], [7])[0], ref, atol=1e-5, rtol=0)


def test_kv_bytes_accounting(runners):
    r = runners["llama"]
    s = r.new_sequence()
    assert s.nbytes == 0
    r.prefill(s, random_tokens(5))
    cfg = r.model.cfg
    assert r.kv_bytes_per_token == cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * r.dtype.size
    assert s.nbytes == s.capacity * r.kv_bytes_per_token and s.capacity >= 5
    s.trim(0)
    assert s.nbytes == 0


def test_prompt_beyond_context_is_input_error(runners):
    from hf2q.errors import InputError

    r = runners["llama"]
    s = r.new_sequence()
    with pytest.raises(InputError, match="context"):
        r.prefill(s, [5] * (r.n_ctx + 1))
    with pytest.raises(InputError, match="vocabulary"):
        r.prefill(s, [r.vocab_size])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_host_decode_equals_mlx_decode(family, runners):
    """The CPU host decode step (numpy + C kernel) and the MLX graph give the same logits."""
    r = runners[family]
    if r.host_decoder is None:
        pytest.skip("host decode path not active on this backend")
    host = r.host_decoder
    prompts = [random_tokens(n, seed=100 + n) for n in (5, 18)]
    a = [r.new_sequence() for _ in prompts]
    b = [r.new_sequence() for _ in prompts]
    for s1, s2, p in zip(a, b, prompts):
        r.prefill(s1, p)
        r.prefill(s2, p)
    toks = [3, 9]
    try:
        for _ in range(4):
            la = r.decode(a, toks)
            r.host_decoder = None
            lb = r.decode(b, toks)
            r.host_decoder = host
            np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)
            toks = [int(t) for t in np.argmax(la, -1)]
    finally:
        r.host_decoder = host
