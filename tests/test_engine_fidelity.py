"""Every family graph against transformers on the same weights.

Tiny random-weight checkpoints (fp32) → ``hf2q convert -q f32`` → our engine; logits of
a prefill chunk and of the decode steps that follow must equal transformers' forward pass
on the HF checkpoint within 1e-4 max-abs. The prompt (24 tokens) is longer than Gemma3's
tiny sliding window (16), so local-window masking and both RoPE bases are exercised.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from tests.engine_support import convert_f32, load_runner, random_tokens

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            src = tiny_checkpoint(family)
            made[family] = (convert_f32(src, tmp_path_factory.mktemp(family) / f"{family}.gguf"), src)
        return made[family]

    return get


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gemma3"])
def test_decoder_logits_match_transformers(family, tiny_gguf):
    import torch
    import transformers

    gguf, hf_dir = tiny_gguf(family)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = random_tokens(24)
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()
    runner = load_runner(gguf, hf_dir)
    seq = runner.new_sequence()
    first = runner.prefill(seq, tokens[:12])
    assert np.abs(first - ref[11]).max() < TOL
    second = runner.prefill(seq, tokens[12:20])  # a second chunk on top of a cache
    assert np.abs(second - ref[19]).max() < TOL
    for i, t in enumerate(tokens[20:]):
        step = runner.decode([seq], [t])[0]
        assert np.abs(step - ref[20 + i]).max() < TOL, f"decode step {i}"
    assert seq.length == 24


def test_bert_embeddings_match_transformers(tiny_gguf):
    import torch
    import transformers

    gguf, hf_dir = tiny_gguf("bert")
    model = transformers.AutoModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    runner = load_runner(gguf)
    assert runner.is_embedding_model
    batch = [[101, 2054, 2003, 102], [101, 1037, 2158, 2003, 5983, 2833, 1012, 102], [101, 7592, 102]]
    got = runner.embed(batch)  # one padded batch
    for row, tokens in zip(got, batch):
        with torch.no_grad():
            h = model(torch.tensor([tokens])).last_hidden_state[0].mean(0)
        ref = (h / h.norm()).numpy()
        assert np.abs(row - ref).max() < TOL
        assert abs(float(np.linalg.norm(row)) - 1.0) < 1e-5
