"""``hf2q info``: figures checked against the ``gguf`` package's own reader."""

from __future__ import annotations

import json

import numpy as np
from gguf import GGUFReader


def test_info_smollm2_text_and_json(smollm2_gguf, cli):
    reader = GGUFReader(smollm2_gguf)
    res = cli("info", smollm2_gguf, "--ctx", "4096", "--slots", "3")
    assert res.code == 0
    lines = res.out.strip().splitlines()
    assert lines[-1] == "Serve support: ready"
    assert "llama" in lines[1]
    assert "Q4_1×210" in res.out and "F32×61" in res.out and "Q8_0×1" in res.out
    assert "Chat template:  present" in res.out

    res = cli("info", smollm2_gguf, "--ctx", "4096", "--slots", "3", "--json")
    info = json.loads(res.out.strip().splitlines()[-1])
    assert info["tensor_count"] == len(reader.tensors)
    assert info["tensor_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert info["parameters"] == sum(int(np.prod(t.shape)) for t in reader.tensors)
    assert info["context_length"] == 8192 and info["ctx"] == 4096
    assert info["chat_template"] is True and info["tokenizer"] == "gpt2" and info["vocab_size"] == 49152
    # 30 layers × 3 KV heads × (64 + 64) × element size
    assert info["kv_bytes_per_token"] == 30 * 3 * 128 * info["kv_dtype_bytes"]
    assert info["kv_bytes_per_slot"] == info["kv_bytes_per_token"] * 4096
    assert info["kv_bytes_worst_case"] == info["kv_bytes_per_slot"] * 3
    assert info["serve_support"] == "ready" and info["reject_reason"] is None


def test_info_kv_matches_engine(smollm2_gguf, cli):
    from hf2q.engine.runner import MlxModelRunner

    info = json.loads(cli("info", smollm2_gguf, "--json").out)
    assert info["kv_bytes_per_token"] == MlxModelRunner.load(smollm2_gguf).kv_bytes_per_token


def test_info_gemma_rejections(gemma3_gguf, cli):
    res = cli("info", gemma3_gguf)
    assert res.code == 0 and "Chat template:  absent" in res.out
    assert "Q4_K" in res.out and "Q6_K" in res.out
    res = cli("info", gemma3_gguf, "--kv-cache-budget", "1M")
    assert res.code == 3
    assert res.out.strip().splitlines()[-1].startswith("Serve support: rejected — --kv-cache-budget 1.0 MiB")
    res = cli("info", gemma3_gguf, "--ctx", "100000")
    assert res.code == 3 and "exceeds the model's trained context 32768" in res.out
