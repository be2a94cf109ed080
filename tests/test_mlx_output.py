"""``hf2q convert --format mlx``: the directory equals what ``mlx_lm.convert`` makes from the same
checkpoint (tensor for tensor), loads with ``mlx_lm.load``, generates, and its logits track
transformers' unquantized forward pass."""

from __future__ import annotations

import importlib
import json
import shutil

import numpy as np
import pytest

from hf2q.convert import mlx_policy

PROMPT = "The quick brown fox jumps over the lazy dog because"


def _mlx_lm_reference(src, out, quant: str, group_size: int):
    """mlx-lm's own converter on the same HF folder (the independent reference)."""
    convert = importlib.import_module("mlx_lm.convert")
    q = mlx_policy.parse_mlx_quant(quant)
    kwargs = {"quantize": True, "q_group_size": group_size, "q_bits": q.bits}
    if q.mixed:
        kwargs["quant_predicate"] = "mixed_" + quant.removeprefix("mlx-mixed-").replace("-", "_")
    convert.convert(hf_path=str(src), mlx_path=str(out), **kwargs)


def _weights(path):
    import mlx.core as mx

    out = {}
    for f in sorted(path.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _strip_mode(q: dict) -> dict:
    """mlx-lm omits ``mode: affine`` in some per-layer entries; it is the default."""
    return {k: ({kk: vv for kk, vv in v.items() if kk != "mode"} if isinstance(v, dict) else v)
            for k, v in q.items() if k != "mode"}


CASES = [
    ("llama", "mlx-4", 64),
    ("qwen3_moe", "mlx-4", 64),
    ("llama", "mlx-mixed-2-6", 32),
    ("qwen3", "mlx-8", 32),
    pytest.param("gemma3", "mlx-mixed-3-6", 64, marks=pytest.mark.slow),
    pytest.param("qwen3", "mlx-3", 128, marks=pytest.mark.slow),
    pytest.param("qwen3", "mlx-mixed-3-4", 64, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "mlx-mixed-4-6", 64, marks=pytest.mark.slow),
    pytest.param("gemma3", "mlx-6", 32, marks=pytest.mark.slow),
    pytest.param("llama", "mlx-5", 64, marks=pytest.mark.slow),
    pytest.param("llama", "mlx-2", 128, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family,quant,group_size", CASES)
def test_output_equals_mlx_lm_convert(family, quant, group_size, tiny_checkpoint, tmp_path, cli):
    import mlx.core as mx

    src = tiny_checkpoint(family)
    ours = tmp_path / "ours"
    r = cli("convert", src, "--format", "mlx", "-q", quant, "--group-size", str(group_size), "-o", ours)
    assert r.code == 0, r.err
    assert not (tmp_path / "ours.tmp").exists()
    ref = tmp_path / "ref"
    _mlx_lm_reference(src, ref, quant, group_size)

    a, b = _weights(ours), _weights(ref)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert mx.array_equal(a[k], b[k]).item(), k
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (ours, ref))
    assert _strip_mode(ca["quantization"]) == _strip_mode(cb["quantization"])
    assert ca["quantization_config"] == ca["quantization"]
    # tokenizer and template travel with the weights
    assert (ours / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # the report describes the same tensors
    rep = json.loads((tmp_path / "ours.report.json").read_text())
    assert rep["format"] == "mlx" and rep["quant"] == quant and rep["tensor_count"] == len(
        [k for k in a if not k.endswith((".scales", ".biases"))])
    assert all(t["cosine"] > 0.9 for t in rep["tensors"])


def _hf_logits(src, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _mlx_logits(path, ids):
    import mlx.core as mx
    import mlx_lm

    model, _ = mlx_lm.load(str(path))
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def _cosine(a, b):
    a, b = a.reshape(-1), b.reshape(-1)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("family", ["llama", "qwen3", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_loads_generates_and_tracks_transformers(family, tiny_checkpoint, tmp_path, cli):
    import mlx_lm
    from transformers import AutoTokenizer

    src = tiny_checkpoint(family)
    ids = AutoTokenizer.from_pretrained(src)(PROMPT).input_ids
    ref = _hf_logits(src, ids)
    for quant, min_cos in (("mlx-8", 0.999), ("mlx-4", 0.85)):  # random weights are hard on 4 bits
        out = tmp_path / quant
        assert cli("convert", src, "-q", quant, "-o", out).code == 0  # an mlx-* name implies --format mlx
        got = _mlx_logits(out, ids)
        assert got.shape == ref.shape
        assert _cosine(got, ref) > min_cos, quant
        if quant == "mlx-8":  # 8-bit keeps the greedy choice wherever the reference has a clear margin
            top2 = np.sort(ref, -1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 0.3
            assert clear.sum() >= 3
            assert (got.argmax(-1) == ref.argmax(-1))[clear].all()
    model, tok = mlx_lm.load(str(tmp_path / "mlx-8"))
    text = mlx_lm.generate(model, tok, PROMPT, max_tokens=6)
    assert len(tok.encode(text, add_special_tokens=False)) >= 3


def test_sharded_output_loads_like_one_file(tiny_checkpoint, tmp_path):
    from hf2q.convert.mlx_writer import write_mlx

    src = tiny_checkpoint("qwen3")
    q = mlx_policy.parse_mlx_quant("mlx-4")
    write_mlx(src, tmp_path / "one", q, 64, integrity=False)
    write_mlx(src, tmp_path / "many", q, 64, integrity=False, shard_bytes=1 << 20)
    shards = sorted((tmp_path / "many").glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    ids = [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(_mlx_logits(tmp_path / "one", ids), _mlx_logits(tmp_path / "many", ids))


def test_existing_output_is_replaced_atomically(tiny_checkpoint, tmp_path, cli):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert cli("convert", tiny_checkpoint("llama"), "-q", "mlx-4", "-o", out).code == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.report.json"]


def test_dry_run_prints_plan_without_writing(tiny_checkpoint, tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli("convert", tiny_checkpoint("qwen3_moe"), "-q", "mlx-mixed-3-6", "--dry-run")
    assert r.code == 0
    assert "model.layers.1.mlp.switch_mlp.down_proj.weight" in r.out and "6b/g64" in r.out
    assert "model.layers.0.mlp.gate.weight" in r.out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,code,needle", [
    (["-q", "mlx-7"], 3, "did you mean"),
    (["-q", "mlx-mixed-2-8"], 3, "unknown mlx quantization"),
    (["--format", "mlx", "-q", "q4_k_m"], 3, "unknown mlx quantization"),
    (["--format", "mlx"], 3, "--quant is required"),
    (["-q", "mlx-4", "--group-size", "48"], 2, "invalid choice"),
])
def test_bad_quant_names(argv, code, needle, tiny_checkpoint, tmp_path, cli):
    r = cli("convert", tiny_checkpoint("llama"), *argv, "-o", tmp_path / "o")
    assert r.code == code and needle in r.err
    assert len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_unsupported_family_and_bad_input(tiny_checkpoint, tmp_path, cli):
    r = cli("convert", tiny_checkpoint("bert"), "-q", "mlx-4", "-o", tmp_path / "b")
    assert r.code == 3 and "bert" in r.err and len(r.err.strip().splitlines()) == 1
    r = cli("convert", tmp_path / "missing", "-q", "mlx-4", "-o", tmp_path / "m")
    assert r.code == 3 and "no such directory" in r.err
    # a truncated shard: one-line input error, no output and no temp directory left behind
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint("llama"), bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    r = cli("convert", bad, "-q", "mlx-4", "-o", tmp_path / "t")
    assert r.code == 3 and len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.tmp").exists()


@pytest.mark.slow
def test_smollm2_copy_answers_after_mlx_8(smollm2_hf, tmp_path, cli):
    """A real trained model survives the conversion (8 bits: its weights are already 4-bit values,
    and re-quantizing those at 4 bits with other groups costs a 135M model its answer)."""
    import mlx_lm

    out = tmp_path / "smol"
    assert cli("convert", smollm2_hf, "-q", "mlx-8", "-o", out, "--no-integrity").code == 0
    model, tok = mlx_lm.load(str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    assert "Paris" in mlx_lm.generate(model, tok, prompt, max_tokens=12)
