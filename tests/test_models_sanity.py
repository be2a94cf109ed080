"""The test models are what they claim to be: transformers loads them, their tokenizers are
the real ones (checked against llama.cpp's own tokenizer vectors where the sdist has them),
and the HF copies of the real GGUFs hold the GGUF's dequantised weights and still answer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.models import tiny

TEXT = "Hello world! Ünïcödé — 日本語, tabs\tand  spaces\n<tag> 12345 café"


def _load(family, path):
    import torch
    import transformers

    auto = transformers.AutoModel if family == "bert" else transformers.AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_tiny_checkpoint_loads_and_runs(family, tiny_checkpoint):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    path = tiny_checkpoint(family)
    cfg = json.loads((path / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(TEXT, add_special_tokens=False).input_ids
    # the embedding covers every id the tokenizer can produce
    assert cfg["vocab_size"] >= len(tok) and max(ids) < cfg["vocab_size"]
    if tiny.spec(family)["tokenizer"] != "qwen3":  # Qwen checkpoints pad the embedding past the tokenizer
        assert cfg["vocab_size"] == len(tok)
    # no tensor is constant (a dropped norm/bias would otherwise go unnoticed) and all are fp32
    weights = load_file(path / "model.safetensors")
    assert all(w.dtype == np.float32 for w in weights.values())
    assert all(float(w.std()) > 1e-3 for w in weights.values() if w.size > 1)

    model = _load(family, path)
    with torch.no_grad():
        out = model(torch.tensor([ids[:16]]))
    hidden = out.last_hidden_state if family == "bert" else out.logits
    assert torch.isfinite(hidden).all()
    if family != "bert":
        assert hidden.shape == (1, min(16, len(ids)), cfg["vocab_size"])
        assert float(hidden[0, -1].std()) > 0.5  # logits spread (see tiny._perturb)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_tiny_tokenizer_round_trips(family, tiny_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint(family))
    ids = tok(TEXT, add_special_tokens=False).input_ids
    text = tok.decode(ids)
    if family == "bert":  # uncased WordPiece normalises: compare what it keeps
        assert text.replace(" ", "") == tok.backend_tokenizer.normalizer.normalize_str(TEXT).replace(" ", "") \
            .replace("\t", "").replace("\n", "")
    else:
        assert text == TEXT


@pytest.mark.parametrize("family,markers", [
    ("llama", ["<|im_start|>user\nHi there<|im_end|>", "<|im_start|>assistant\n"]),
    ("qwen3", ["<|im_start|>user\nHi there<|im_end|>", "<|im_start|>assistant\n"]),
    ("qwen3_moe", ["<|im_start|>user\nHi there<|im_end|>", "<|im_start|>assistant\n"]),
])
def test_tiny_chat_template_renders(family, markers, tiny_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint(family))
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                   add_generation_prompt=True)
    for m in markers:
        assert m in text


def test_qwen3_tokenizer_matches_llama_cpp_vectors(tiny_checkpoint):
    """Our tokenizer.json, built from ggml-vocab-qwen2.gguf, tokenizes like llama.cpp's reference output."""
    from transformers import AutoTokenizer

    from tests.models.tokenizer_files import llama_cpp_models_dir

    models = llama_cpp_models_dir()
    inputs = (models / "ggml-vocab-qwen2.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = (models / "ggml-vocab-qwen2.gguf.out").read_text().split("\n")
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen3"))
    pairs = list(zip(inputs, expected))
    assert len(pairs) > 30
    for text, ids in pairs:
        assert tok(text, add_special_tokens=False).input_ids == [int(x) for x in ids.split()], repr(text)
    # Qwen3's added tokens sit at their real ids and are single tokens
    assert tok("<think>x</think><|im_end|>", add_special_tokens=False).input_ids == [151667, 87, 151668, 151645]


def test_tiny_shapes_match_the_real_layouts(tiny_checkpoint):
    g = json.loads((tiny_checkpoint("gemma3") / "config.json").read_text())
    assert {"sliding_attention", "full_attention"} <= set(g["layer_types"]) and g["sliding_window"] < 64
    assert g["num_key_value_heads"] == 1 and g["tie_word_embeddings"] and "rope_local_base_freq" in g
    # the flat key mlx-lm reads must describe the same layer pattern as transformers' layer_types
    pattern = g["sliding_window_pattern"]
    assert g["layer_types"] == ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                for i in range(g["num_hidden_layers"])]
    q = json.loads((tiny_checkpoint("qwen3") / "config.json").read_text())
    assert q["num_attention_heads"] * q["head_dim"] != q["hidden_size"]  # as in Qwen3-0.6B
    assert q["num_attention_heads"] > q["num_key_value_heads"]
    m = json.loads((tiny_checkpoint("qwen3_moe") / "config.json").read_text())
    assert m["num_experts"] == 4 and m["num_experts_per_tok"] == 2 and not m["tie_word_embeddings"]
    ll = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    assert ll["tie_word_embeddings"] and ll["num_attention_heads"] > ll["num_key_value_heads"]


def test_tiny_build_is_deterministic(tmp_path):
    """Rebuilding gives byte-identical weights (the cache key is only the family + version)."""
    from tests.models.tiny import _build, checkpoint

    _build("bert", tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == (checkpoint("bert") / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------- HF copies of real GGUFs

@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_hf_copy_holds_the_gguf_weights(which, request):
    """The copy's FFN weights equal gguf-py's dequantisation of the GGUF (no permutation on FFN tensors). The
    file is read with the tests' plain parser: gguf-py's reader walks Gemma's 262k-token vocabulary for ~15 s."""
    import gguf
    from safetensors import safe_open

    from tests.tools.gguf_read import read_gguf

    hf = request.getfixturevalue(f"{which}_hf")
    _, by_name = read_gguf(request.getfixturevalue(f"{which}_gguf"))
    (weights,) = hf.glob("*.safetensors")  # the copies are single-file
    with safe_open(weights, "np") as s:
        for layer in (0, 5):
            for gguf_name, hf_name in (("ffn_down", "mlp.down_proj"), ("ffn_gate", "mlp.gate_proj")):
                qtype, ne, data = by_name[f"blk.{layer}.{gguf_name}.weight"]
                ref = gguf.dequantize(np.frombuffer(data, np.uint8), qtype).reshape(list(reversed(ne)))
                got = s.get_tensor(f"model.layers.{layer}.{hf_name}.weight").astype(np.float32)
                np.testing.assert_array_equal(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("which,chat,prompt,answer", [
    ("smollm2", True, "What is the capital of France?", "Paris"),
    # the 270m base model (and stock llama.cpp on the GGUF) continue a bare "…France is" with prose
    ("gemma3", False, "The capital of France is Paris. The capital of Germany is", "Berlin"),
])
def test_hf_copy_still_answers(which, chat, prompt, answer, request):
    import torch
    from transformers import AutoTokenizer

    path = request.getfixturevalue(f"{which}_hf")
    tok = AutoTokenizer.from_pretrained(path)
    model = _load("llm", path)
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8 if chat else 3, do_sample=False)
    assert answer in tok.decode(out[0, ids.shape[1]:])


# ---------------------------------------------------------------------------- tokenizers vs llama.cpp

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_gguf_derived_tokenizers_match_llama_cpp(which, llama_cpp_bin, request):
    """The tokenizer folders made from the GGUFs tokenize like stock llama.cpp does on the same GGUF
    (llama-server's /tokenize), over llama.cpp's own tokenizer test strings."""
    import subprocess
    import time

    import httpx
    from transformers import AutoTokenizer

    from tests.models.tokenizer_files import llama_cpp_models_dir, tokenizer_dir
    from tests.tools import llama_cpp

    gguf_path = request.getfixturevalue(f"{which}_gguf")
    port = _free_port()
    proc = subprocess.Popen([str(llama_cpp_bin / "llama-server"), "-m", str(gguf_path), "--port", str(port),
                             "-t", "1", "-c", "256"], env=llama_cpp.env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "llama-server did not start"
            time.sleep(0.5)
        tok = AutoTokenizer.from_pretrained(tokenizer_dir(which))
        texts = (llama_cpp_models_dir() / "ggml-vocab-llama-bpe.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
        texts += [TEXT, "2024-11-29 12345 ½ 3.14159"]
        for text in texts:
            ref = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": False},
                             timeout=30).json()["tokens"]
            assert tok(text, add_special_tokens=False).input_ids == ref, repr(text)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
