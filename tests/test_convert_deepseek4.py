"""``hf2q convert`` for DeepSeek-V4 (official layout) against llama.cpp's converter and runtime, and torch.

One tiny checkpoint (``tests/models/deepseek4.py``) in DeepSeek's own layout: FP8 E4M3 matrices with
E8M0 128×128-block scales, MXFP4-packed routed experts, hash-routed first layers, hyper-connections,
all three compress ratios and an MTP block.

* our reader's decoding of every FP8 / MXFP4 / BF16 tensor equals the float32 values of the
  transformers model it was built from (which torch encoded);
* every tensor (name, type, shape, bytes) and the model metadata equal llama.cpp's
  ``convert_hf_to_gguf.py`` output, for the default F16 export and ``--mtp``;
* stock ``llama-completion`` generates from our file over a prompt long enough to compress;
* MXFP4 repacking matches gguf-py's ``block_mxfp4`` decoder, the 8-bit float tables match torch;
* what cannot be converted or served says so in one line with exit code 3.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models.deepseek4 import CONFIG, deepseek4_checkpoint, load_transformers_model, official_name, with_config
from tests.test_llamacpp_parity import _convert, compare_gguf, llamacpp_reference

# llama.cpp's converter takes ~25 s per run here; bf16 gives the same tensors as f16 (the storage decides the
# types), so it is checked against llama.cpp only when HF2Q_DEEPSEEK4_ALL=1
PARITY = [("f16", ()), ("f16", ("--mtp",))] + ([("bf16", ())] if os.environ.get("HF2Q_DEEPSEEK4_ALL") else [])


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return deepseek4_checkpoint(mtp=True)


@pytest.fixture(scope="module")
def ours_f16(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deepseek4") / "ds4-f16.gguf"
    _convert(checkpoint, "f16", out)
    return out


def test_reader_decodes_the_transformers_values(checkpoint):
    """FP8 blocks, MXFP4 experts and BF16 tensors read back as exactly the model's float32 values."""
    from hf2q.ggml import mxfp4
    from hf2q.sources import fp8
    from hf2q.sources.safetensors_reader import SafetensorsCheckpoint, to_f32

    state = load_transformers_model(checkpoint).state_dict()
    ff, n_exp = CONFIG["moe_intermediate_size"], CONFIG["n_routed_experts"]
    with SafetensorsCheckpoint(checkpoint) as ck:
        def expert(name):
            return mxfp4.decode_packed(ck.raw(f"{name}.weight"), ck.raw(f"{name}.scale"))

        for hf_name, want in state.items():
            name = official_name(hf_name)
            if name.endswith("gate_up_proj"):
                base = name.removesuffix("gate_up_proj")
                got = np.stack([np.concatenate([expert(f"{base}{e}.w1"), expert(f"{base}{e}.w3")]) for e in range(n_exp)])
            elif name.endswith("down_proj"):
                got = np.stack([expert(f"{name.removesuffix('down_proj')}{e}.w2") for e in range(n_exp)])
            elif ck.entry(name).dtype.startswith("I"):
                got = ck.raw(name)
            else:
                got = to_f32(ck.raw(name), ck.entry(name).dtype)
                scale = name.removesuffix(".weight") + ".scale"
                if ck.entry(name).dtype == "F8_E4M3":
                    got = fp8.dequantize_rows(got, to_f32(ck.raw(scale), ck.entry(scale).dtype), 0)
            assert np.array_equal(got, want.numpy()), hf_name
        assert {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32", "I64"} <= {e.dtype for e in ck}


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("quant,args", PARITY, ids=[f"{q}{''.join(a)}" for q, a in PARITY])
def test_matches_llamacpp_byte_for_byte(quant, args, checkpoint, llama_cpp_bin, tmp_path):
    from hf2q.cli import main

    ours = tmp_path / "out.gguf"
    assert main(["convert", str(checkpoint), "--quant", quant, "-o", str(ours), "--no-integrity", *args]) == 0
    assert compare_gguf(ours, llamacpp_reference(checkpoint, quant, args)) == []


@pytest.mark.llamacpp
def test_llama_quantize_refuses_what_we_refuse(checkpoint, llama_cpp_bin, tmp_path):
    """Why only f16/bf16: llama.cpp's own way to q8_0 / q4_k_m stops at the tensors its export already quantized."""
    from tests.tools import llama_cpp

    for quant, stops_at in (("q8_0", "mxfp4"), ("q4_k_m", "q8_0")):
        r = subprocess.run([str(llama_cpp.tool("llama-quantize")), str(llamacpp_reference(checkpoint, "f16")),
                            str(tmp_path / f"{quant}.gguf"), quant, "1"], env=llama_cpp.env(), capture_output=True,
                           text=True, timeout=120, check=False)
        assert r.returncode != 0 and f"requantizing from type {stops_at} is disabled" in r.stdout + r.stderr


def test_bf16_export_equals_f16(checkpoint, ours_f16, tmp_path):
    """The checkpoint's storage fixes every type (BF16 stays BF16, FP8 → Q8_0), as in llama.cpp's export."""
    bf16 = tmp_path / "bf16.gguf"
    _convert(checkpoint, "bf16", bf16)
    assert compare_gguf(bf16, ours_f16) == []


@pytest.mark.slow
@pytest.mark.llamacpp
def test_llama_completion_generates_from_our_file(ours_f16, llama_cpp_bin):
    """Stock llama.cpp loads the file and decodes past a 128-token prompt (every compress ratio runs)."""
    from tests.tools import llama_cpp

    prompt = " ".join(f"item {i} is on shelf {i % 7}." for i in range(40))
    args = [str(llama_cpp.tool("llama-completion")), "-m", str(ours_f16), "-p", prompt, "-n", "8", "-t", "1",
            "-c", "512", "--temp", "0", "-no-cnv", "-v"]
    r = subprocess.run(args, env={**llama_cpp.env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300, check=False, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(prompt) and len(r.stdout) > len(prompt)
    n_prompt = int(r.stderr.split("prompt eval time =")[1].split("/")[1].split()[0])
    assert n_prompt > 128


def test_dry_run_info_and_refusals(checkpoint, ours_f16, cli, tmp_path):
    r = cli("convert", checkpoint, "--quant", "f16", "--dry-run")
    assert r.code == 0, r.err
    for line in ("blk.0.ffn_gate_tid2eid.weight", "blk.3.ffn_down_exps.weight"):
        assert line in r.out
    assert "MXFP4" in r.out and "Q8_0" in r.out and "I32" in r.out and "deepseek4 f16" in r.out
    assert "compressed sparse layers 2, heavily compressed layers 1, hash-routed layers 2" in r.out
    r = cli("convert", checkpoint, "--quant", "q4_k_m", "--dry-run")
    assert r.code == 3 and "llama-quantize refuses to requantize" in r.err
    r = cli("info", ours_f16)
    assert "deepseek4" in r.out and "MXFP4×12" in r.out and "cannot serve it yet" not in r.out
    # our own file runs in the engine (tests/test_engine_deepseek4.py checks its logits on llama.cpp's)
    r = cli("generate", "--model", ours_f16, "--prompt", "hi", "--max-tokens", "4", "--temperature", "0")
    assert r.code == 0 and r.out.strip(), r.err


@pytest.mark.parametrize("change,message", [
    ({"hc_mult": 2}, "hc_mult 2 is not supported"),
    ({"compress_ratios": [0, 4, 64, 4, 0]}, "compress ratio(s) [64] are not supported"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"num_nextn_predict_layers": 0, "_mtp": True}, "--mtp: config.json has no num_nextn_predict_layers"),
    ({"o_lora_rank": 16}, "has shape [64, 1024] but config.json implies [32, 1024]"),
], ids=["hc_mult", "ratio", "scoring", "no-mtp-block", "shape"])
def test_unsupported_variants_exit_3(change, message, checkpoint, cli, tmp_path):
    mtp = change.pop("_mtp", False)
    src = with_config(checkpoint, tmp_path / "variant", **change)
    r = cli("convert", src, "--quant", "f16", "--dry-run", *(["--mtp"] if mtp else []))
    assert r.code == 3, r.err
    assert message in r.err and len(r.err.strip().splitlines()) == 1


def test_float32_block_scales_read_like_e8m0(tmp_path):
    """Older DeepSeek releases store the 128×128 scales as float32: the same weights, the same values."""
    import torch
    from safetensors.torch import save_file

    from hf2q.arch.deepseek4 import BlockScaledQ8
    from hf2q.sources.safetensors_reader import SafetensorsCheckpoint
    from tests.models.deepseek4 import fp8_block_encode

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(3))
    q, scale, deq = fp8_block_encode(w)
    save_file({"a.weight": q, "a.scale": scale, "b.weight": q.clone(), "b.scale": scale.float()}, tmp_path / "m.safetensors")
    with SafetensorsCheckpoint(tmp_path) as ck:
        for name in ("a", "b"):
            src = BlockScaledQ8(((f"{name}.weight", f"{name}.scale"),), (300, 200))
            assert np.array_equal(src.rows(ck, 0, 300), deq.numpy())
            assert np.array_equal(src.rows(ck, 130, 260), deq.numpy()[130:260])


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.randoms(use_true_random=False))
def test_mxfp4_repack_decodes_like_gguf_py(rows, blocks, rnd):
    import gguf

    from hf2q.ggml import mxfp4

    rng = np.random.default_rng(rnd.randrange(1 << 30))
    packed = rng.integers(0, 256, (rows, blocks * 16), dtype=np.uint8)
    exps = rng.integers(100, 150, (rows, blocks), dtype=np.uint8)
    raw = mxfp4.repack_rows(packed, exps)
    want = mxfp4.decode_packed(packed, exps)
    got = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(rows, -1)
    assert np.array_equal(got, want)
    assert np.array_equal(mxfp4.dequantize(raw, blocks * 32), want)


def test_fp8_tables_match_torch():
    import torch

    from hf2q.sources import fp8

    codes = torch.arange(256, dtype=torch.uint8)
    for name, dtype in (("F8_E4M3", torch.float8_e4m3fn), ("F8_E5M2", torch.float8_e5m2),
                        ("F8_E8M0", torch.float8_e8m0fnu)):
        assert np.array_equal(fp8.TABLES[name](), codes.view(dtype).float().numpy(), equal_nan=True), name


def test_report_measures_the_packed_tensors(ours_f16):
    """MXFP4 experts decode (through gguf-py) to exactly the checkpoint's values; FP8 → Q8_0 is measured, not exact."""
    import json

    from hf2q.convert.report import default_path

    rows = {t["name"]: t for t in json.loads(default_path(ours_f16).read_text())["tensors"]}
    experts = [t for t in rows.values() if t["type"] == "MXFP4"]
    assert len(experts) == 3 * CONFIG["num_hidden_layers"] and all(t["rmse"] == 0.0 for t in experts)
    q8 = rows["blk.0.attn_q_b.weight"]
    assert q8["type"] == "Q8_0" and 0 < q8["rmse"] < 0.01 and q8["cosine"] > 0.9999


@pytest.mark.parametrize("edit,message", [
    ("drop-compressor", "the checkpoint lacks blk.2.attn_compressor_ape.weight"),
    ("bad-route", "routes to expert 8 (or below 0) but the model has 8 experts"),
])
def test_incomplete_or_out_of_range_checkpoints_exit_3(edit, message, checkpoint, cli, tmp_path):
    """What llama.cpp's loader would reject or read out of bounds is refused before anything is written."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    if edit == "drop-compressor":
        del tensors["layers.2.attn.compressor.ape"]
    else:
        tensors["layers.0.ffn.gate.tid2eid"][5, 1] = CONFIG["n_routed_experts"]
    src = tmp_path / "edited"
    src.mkdir()
    save_file(tensors, src / "model.safetensors")
    with_config(checkpoint, src)
    r = cli("convert", src, "--quant", "f16", "-o", tmp_path / "out.gguf")
    assert r.code == 3 and message in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert not (tmp_path / "out.gguf").exists()


_FUZZ_KEYS = ("hidden_size", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "index_head_dim",
              "index_n_heads", "n_routed_experts", "num_experts_per_tok", "num_hash_layers", "num_hidden_layers",
              "hc_mult", "moe_intermediate_size", "n_shared_experts", "num_nextn_predict_layers", "compress_ratios",
              "swiglu_limit", "vocab_size")


@settings(max_examples=20, deadline=None)
@given(key=st.sampled_from(_FUZZ_KEYS),
       value=st.one_of(st.integers(-3, 300), st.just(None), st.text(max_size=3), st.floats(allow_nan=True),
                       st.lists(st.sampled_from([0, 4, 128, 7, -1]), max_size=6)))
def test_hostile_config_values_are_one_line_errors(key, value, checkpoint, tmp_path_factory):
    """Whatever one config value becomes, the dry run succeeds or fails with one line and exit 3, never a traceback."""
    from hf2q.cli import main

    src = with_config(checkpoint, tmp_path_factory.mktemp("fuzz"), **{key: value})
    code = main(["convert", str(src), "--quant", "f16", "--dry-run"])
    assert code in (0, 3)


def test_fp8_without_a_family_that_scales_it_is_refused(tiny_checkpoint, cli, tmp_path):
    """Reading FP8 is for families that apply its scales; elsewhere an FP8 weight is still bad input."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("llama")
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    out = tmp_path / "fp8-llama"
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    with_config(src, out)
    r = cli("convert", out, "--quant", "q8_0", "--dry-run")
    assert r.code == 3 and "has dtype F8_E4M3; weights must be floating point" in r.err


def test_fp8_to_q8_0_on_the_pool_is_gguf_pys_q8_0(checkpoint, monkeypatch):
    """The pipeline encodes a block-scaled FP8 matrix on its worker pool (row chunks, four threads):
    the bytes are gguf-py's Q8_0 (what llama.cpp's converter writes) of torch's decoding of the weight."""
    from concurrent.futures import ThreadPoolExecutor

    import gguf
    import torch
    from safetensors import safe_open

    from hf2q.arch.deepseek4 import BlockScaledQ8
    from hf2q.convert import pipeline
    from hf2q.convert.quant_names import parse_gguf_quant

    plan = pipeline.build_plan(checkpoint, parse_gguf_quant("f16"))
    i = next(k for k, t in enumerate(plan.tensors) if t.name == "blk.0.attn_q_b.weight")
    assert isinstance(plan.tensors[i].source, BlockScaledQ8) and plan.tensors[i].shape == (2048, 64)
    written = []

    class Sink:
        def write(self, q):
            written.append(np.array(q))

    class Bar:
        def advance(self, n):
            pass

    calls, encode = [], pipeline.encode
    monkeypatch.setattr(pipeline, "encode", lambda x, *a, **k: calls.append(x.shape[0]) or encode(x, *a, **k))
    timings = dict.fromkeys(("read_s", "quantize_s", "write_s", "error_s"), 0.0)
    try:
        with ThreadPoolExecutor(4) as pool:
            row = pipeline.write_tensor(plan, i, Sink(), 4, timings, Bar(), pool)
    finally:
        plan.checkpoint.close()
    assert len(calls) > 1  # in row chunks on the pool
    with safe_open(str(next(checkpoint.glob("*.safetensors"))), "pt") as f:
        w, s = f.get_tensor("layers.0.attn.wq_b.weight").float(), f.get_tensor("layers.0.attn.wq_b.scale").float()
    want = w * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
    ref = gguf.quants.quantize(want.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(np.concatenate(written).reshape(ref.shape), ref)
    assert row["type"] == "Q8_0" and 0 < row["rmse"] < 0.01
