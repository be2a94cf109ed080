"""Real models: SmolLM2 (Q4_1 GGUF) against transformers on the dequantized weights, and
MiniLM embeddings against transformers / sentence-transformers' known similarity."""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


def _chat_prompt(gguf):
    from hf2q.text.chat_template import ChatTemplate
    from hf2q.text.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(gguf)
    text = ChatTemplate.from_gguf(gguf).render([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    return tok, tok.encode(text)


def test_smollm2_64_greedy_tokens_equal_transformers(smollm2_gguf, smollm2_hf):
    import torch
    import transformers

    from hf2q.engine.runner import MlxModelRunner

    tok, prompt = _chat_prompt(smollm2_gguf)
    runner = MlxModelRunner.load(smollm2_gguf)
    seq = runner.new_sequence()
    logits = runner.prefill(seq, prompt)
    ours = []
    for _ in range(64):  # no early stop: compare 64 tokens even past <|im_end|>
        ours.append(int(np.argmax(logits)))
        logits = runner.decode([seq], [ours[-1]])[0]

    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    theirs = out[0, len(prompt):].tolist()
    assert ours == theirs
    assert "Paris" in tok.decode(ours)


def test_smollm2_batched_greedy_equals_single(smollm2_gguf):
    from hf2q.engine.runner import MlxModelRunner

    runner = MlxModelRunner.load(smollm2_gguf)
    _, base = _chat_prompt(smollm2_gguf)
    prompts = [base, base[:-4], base + base[:9], base[5:]]
    single = []
    for p in prompts:
        s = runner.new_sequence()
        t = int(np.argmax(runner.prefill(s, p)))
        toks = [t]
        for _ in range(11):
            toks.append(int(np.argmax(runner.decode([s], [toks[-1]])[0])))
        single.append(toks)
    seqs = [runner.new_sequence() for _ in prompts]
    cur = [int(np.argmax(runner.prefill(s, p))) for s, p in zip(seqs, prompts)]
    batched = [[t] for t in cur]
    for _ in range(11):
        cur = [int(t) for t in np.argmax(runner.decode(seqs, cur), -1)]
        for row, t in zip(batched, cur):
            row.append(t)
    assert batched == single


def test_minilm_embeddings(minilm_hf, tmp_path):
    import torch
    import transformers

    from hf2q.cli import main
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.text.tokenizer import GGUFTokenizer

    gguf = tmp_path / "minilm-f32.gguf"
    assert main(["convert", str(minilm_hf), "-q", "f32", "-o", str(gguf), "--no-integrity"]) == 0
    runner = MlxModelRunner.load(gguf)
    tok = GGUFTokenizer.from_gguf(gguf)
    sentences = ["A man is eating food.", "A man is eating a piece of bread."]
    ids = [tok.encode(s) for s in sentences]
    ours = runner.embed(ids)

    hf_tok = transformers.AutoTokenizer.from_pretrained(minilm_hf)
    model = transformers.AutoModel.from_pretrained(minilm_hf, dtype=torch.float32).eval()
    refs = []
    for s in sentences:
        enc = hf_tok(s, return_tensors="pt")
        assert enc["input_ids"][0].tolist() == ids[len(refs)]
        with torch.no_grad():
            h = model(**enc).last_hidden_state[0].mean(0)
        refs.append((h / h.norm()).numpy())
    for a, b in zip(ours, refs):
        assert float(a @ b) >= 0.9999
    sim = float(ours[0] @ ours[1])
    assert abs(sim - float(refs[0] @ refs[1])) < 1e-4
    assert 0.74 < sim < 0.77  # the model card's ≈ 0.755
