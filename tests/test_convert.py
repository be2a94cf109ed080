"""``hf2q convert`` end to end on tiny checkpoints, checked against independent readers.

References: the ``safetensors`` library (source weights), the tests' plain GGUF parser
(``tests/tools/gguf_read.py``, not hf2q's) and the ``gguf`` package's numpy dequantizers (our output),
``hashlib`` (integrity hashes). Byte parity with llama.cpp
itself lives in ``test_llamacpp_parity.py``; the type policy in ``test_policy.py``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.tools.gguf_read import read_tensors  # gguf-py's reader walks a 49k-262k vocabulary for ~5-50 s


def test_f16_tensors_equal_rounded_source(cli, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    out = tmp_path / "m.gguf"
    res = cli("convert", src, "-q", "f16", "-o", out)
    assert res.code == 0, res.err
    weights = load_file(src / "model.safetensors")
    kv, tensors = read_tensors(out)
    assert kv["general.architecture"] == "llama"
    assert kv["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)
    emb = tensors["token_embd.weight"]
    assert emb.tensor_type == gguf.GGMLQuantizationType.F16
    np.testing.assert_array_equal(emb.as_f32(), weights["model.embed_tokens.weight"].astype(np.float16))
    norm = tensors["blk.1.ffn_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(norm.as_f32(), weights["model.layers.1.post_attention_layernorm.weight"])
    # Q rows are permuted (rotate-half → interleaved) but hold the same values
    q = tensors["blk.0.attn_q.weight"].as_f32()
    hf_q = weights["model.layers.0.self_attn.q_proj.weight"].astype(np.float16).astype(np.float32)
    assert not np.array_equal(q, hf_q)
    np.testing.assert_array_equal(np.sort(q, axis=None), np.sort(hf_q, axis=None))
    assert not (tmp_path / "m.gguf.tmp").exists()


def test_q8_0_is_close_and_report_is_honest(cli, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    out = tmp_path / "q.gguf"
    rep_path = tmp_path / "report.json"
    res = cli("convert", src, "-q", "q8_0", "-o", out, "--json-report", rep_path)
    assert res.code == 0, res.err
    rep = json.loads(rep_path.read_text())
    weights = load_file(src / "model.safetensors")
    _, tensors = read_tensors(out)
    entry = next(t for t in rep["tensors"] if t["name"] == "blk.0.ffn_up.weight")
    t = tensors["blk.0.ffn_up.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and entry["type"] == "Q8_0"
    assert entry["bytes"] == int(t.n_bytes)
    x = weights["model.layers.0.mlp.up_proj.weight"]
    assert x.shape[0] <= 256
    y = t.as_f32()
    rmse = float(np.sqrt(np.mean((x.astype(np.float64) - y) ** 2)))
    assert entry["rmse"] == pytest.approx(rmse, rel=1e-6)  # ≤256 rows: the sample is the whole tensor
    assert rmse < 0.01 * float(np.abs(x).max())
    assert entry["cosine"] > 0.999
    # integrity: every input file hashed, and the hashes are right
    for rel, digest in rep["inputs_sha256"].items():
        assert hashlib.sha256((src / rel).read_bytes()).hexdigest() == digest
    assert "model.safetensors" in rep["inputs_sha256"] and "config.json" in rep["inputs_sha256"]
    assert rep["output_bytes"] == out.stat().st_size
    assert rep["total_tensor_bytes"] == sum(t.n_bytes for t in tensors.values())
    assert set(rep["timings_s"]) >= {"read_s", "quantize_s", "write_s", "total_s"}


def test_no_integrity_skips_hashes(cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "q.gguf"
    assert cli("convert", tiny_checkpoint("llama"), "-q", "q4_0", "-o", out, "--no-integrity").code == 0
    rep = json.loads((tmp_path / "q.gguf.report.json").read_text())
    assert rep["inputs_sha256"] == {} and rep["integrity_checked"] is False


def test_dry_run_plan_matches_the_written_file(cli, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    dry = cli("convert", src, "-q", "q4_k_m", "--dry-run", "-o", tmp_path / "never.gguf")
    assert dry.code == 0, dry.err
    assert not (tmp_path / "never.gguf").exists()
    planned = {}
    for line in dry.out.splitlines()[1:-1]:
        name, *_, qtype, _bpw, nbytes = line.split()
        planned[name] = (qtype, int(nbytes))
    out = tmp_path / "g.gguf"
    assert cli("convert", src, "-q", "q4_k_m", "-o", out, "--no-integrity").code == 0
    _, tensors = read_tensors(out)
    assert planned == {t.name: (t.tensor_type.name, t.n_bytes) for t in tensors.values()}
    assert len({q for q, _ in planned.values()}) >= 3  # a real mix: F32 norms, Q6_K embd, fallbacks
    total = int(dry.out.splitlines()[-1].split()[3])
    assert total == sum(t.n_bytes for t in tensors.values())


def test_sharded_checkpoint_gives_identical_output(cli, tiny_checkpoint, tmp_path):
    """Split the checkpoint into two shards + index.json: the GGUF must not change by a byte."""
    src = tiny_checkpoint("llama")
    sharded = tmp_path / "sharded"
    shutil.copytree(src, sharded)
    (sharded / "model.safetensors").unlink()
    weights = load_file(src / "model.safetensors")
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: weights[k] for k in keys}, sharded / fname)
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert cli("convert", src, "-q", "q5_1", "-o", a, "--no-integrity").code == 0
    assert cli("convert", sharded, "-q", "q5_1", "-o", b, "--no-integrity").code == 0
    (_, ta), (_, tb) = read_tensors(a), read_tensors(b)
    assert list(ta) == list(tb)
    for x, y in zip(ta.values(), tb.values()):
        assert x.data == y.data, x.name


def test_moe_experts_are_stacked(cli, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_moe")
    out = tmp_path / "moe.gguf"
    assert cli("convert", src, "-q", "f32", "-o", out, "--no-integrity").code == 0
    weights = load_file(src / "model.safetensors")
    kv, tensors = read_tensors(out)
    cfg = json.loads((src / "config.json").read_text())
    n_exp = cfg["num_experts"]
    down = tensors["blk.1.ffn_down_exps.weight"].as_f32()
    assert down.shape[0] == n_exp
    fused = "model.layers.1.mlp.experts.down_proj"
    if fused in weights:  # transformers 5 layout: one [E, d, ff] tensor
        np.testing.assert_array_equal(down, weights[fused])
    else:
        for e in range(n_exp):
            np.testing.assert_array_equal(down[e], weights[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])
    assert kv["qwen3moe.expert_count"] == n_exp


def test_gemma_norms_get_plus_one_and_window_metadata(cli, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("gemma3")
    out = tmp_path / "g.gguf"
    assert cli("convert", src, "-q", "f16", "-o", out, "--no-integrity").code == 0
    weights = load_file(src / "model.safetensors")
    kv, tensors = read_tensors(out)
    got = tensors["blk.0.attn_q_norm.weight"].as_f32()
    np.testing.assert_array_equal(got, weights["model.layers.0.self_attn.q_norm.weight"] + np.float32(1))
    cfg = json.loads((src / "config.json").read_text())
    assert kv["gemma3.attention.sliding_window"] == cfg["sliding_window"]


def test_bert_pooling_and_wordpiece(cli, minilm_hf, tmp_path):
    out = tmp_path / "minilm.gguf"
    assert cli("convert", minilm_hf, "-q", "f16", "-o", out, "--no-integrity").code == 0
    kv, tensors = read_tensors(out)
    assert kv["bert.pooling_type"] == int(gguf.PoolingType.MEAN)
    assert kv["tokenizer.ggml.model"] == "bert"
    toks = kv["tokenizer.ggml.tokens"]
    vocab = (Path(minilm_hf) / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert len(toks) == len(vocab)
    i = vocab.index("##ing")
    assert toks[i] == "ing" and toks[vocab.index("hello")] == "\u2581hello"
    assert tensors["position_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_sources_widen_exactly(cli, tiny_checkpoint, tmp_path, dtype):
    """bf16 / f16 checkpoints: the F32 output equals torch's own widening of the stored values."""
    import torch
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    src = tiny_checkpoint("llama")
    half = tmp_path / "half"
    shutil.copytree(src, half)
    tensors = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in load_torch(src / "model.safetensors").items()}
    save_torch(tensors, half / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "h.gguf"
    assert cli("convert", half, "-q", "f32", "-o", out, "--no-integrity").code == 0
    _, written = read_tensors(out)
    got = written["blk.1.ffn_down.weight"].as_f32()
    np.testing.assert_array_equal(got, tensors["model.layers.1.mlp.down_proj.weight"].float().numpy())
