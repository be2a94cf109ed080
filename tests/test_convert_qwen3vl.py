"""``hf2q convert`` (and ``--mmproj``) for Qwen3-VL against llama.cpp's converter, quantizer and runtime.

Two tiny random checkpoints (``tests/models/qwen3vl.py``): dense ``Qwen3VLForConditionalGeneration``
and the MoE one with its experts in the Hub's transposed layout.

* the text GGUF (``qwen3vl`` / ``qwen3vlmoe``: M-RoPE sections, deepstack count, stacked experts)
  equals llama.cpp's ``convert_hf_to_gguf.py`` (+ ``llama-quantize``) tensor for tensor;
* the mmproj (``clip``, ``qwen3vl_merger``) equals its ``--mmproj`` output, in F16 and Q8_0;
* stock ``llama-completion`` loads our text GGUF and generates what it generates from its own, and
  ``llama-mtmd-cli`` runs an image through our pair as through its own;
* ``--dry-run`` lists both files' tensors; ``info`` knows the family; bad inputs are one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.qwen3vl import checkpoint, per_expert_checkpoint
from tests.test_llamacpp_parity import _convert, _ref_dir, _source_key, compare_gguf, llamacpp_reference, read_gguf

TEXT_PARITY = [("qwen3vl", "f16"), ("qwen3vl", "q4_k_m"), ("qwen3vl_moe", "q8_0")]  # dense f16: the shared fixture
MMPROJ_PARITY = [("qwen3vl", "f16"), ("qwen3vl", "q8_0"), ("qwen3vl", "bf16"), ("qwen3vl_moe", "f16")]


@pytest.fixture(scope="module")
def dense_f16(tmp_path_factory) -> tuple[Path, Path]:
    """The dense checkpoint converted once to F16 with its mmproj at an explicit path: (model, mmproj)."""
    d = tmp_path_factory.mktemp("qwen3vl")
    out, side = d / "m.gguf", d / "side" / "vision.gguf"
    side.parent.mkdir()
    from hf2q.cli import main

    code = main(["convert", str(checkpoint("qwen3vl")), "--quant", "f16", "-o", str(out), "--mmproj",
                 "--mmproj-output", str(side), "--no-integrity"])
    assert code == 0
    return out, side


def _llamacpp_mmproj(src: Path, outtype: str) -> Path:
    """llama.cpp's ``--mmproj`` GGUF of ``src`` (built once, cached beside the text references)."""
    from tests.tools import llama_cpp

    out = _ref_dir() / f"{src.name}-{_source_key(src)}-mmproj-{outtype}.gguf"
    if out.exists():
        return out
    env = llama_cpp.env()
    env["PYTHONPATH"] = str(llama_cpp.gguf_py_dir())
    tmp = out.with_suffix(".tmp.gguf")
    r = subprocess.run([sys.executable, str(llama_cpp.convert_script()), str(src), "--outtype", outtype, "--mmproj",
                        "--outfile", str(tmp)], env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"llama.cpp --mmproj convert failed: {r.stderr[-2000:]}"
    tmp.rename(out)
    return out


@pytest.mark.parametrize("shape,quant", TEXT_PARITY)
@pytest.mark.llamacpp
@pytest.mark.slow
def test_text_gguf_matches_llamacpp(shape, quant, llama_cpp_bin, tmp_path, request):
    """Every tensor and the model metadata equal llama.cpp's (the dense F16 file is the shared fixture)."""
    src = checkpoint(shape)
    if (shape, quant) == ("qwen3vl", "f16"):
        ours = request.getfixturevalue("dense_f16")[0]
    else:
        ours = tmp_path / "out.gguf"
        _convert(src, quant, ours)
    assert compare_gguf(ours, llamacpp_reference(src, quant)) == []
    kv, tensors = read_gguf(ours)
    arch = kv["general.architecture"]
    assert arch == ("qwen3vlmoe" if shape == "qwen3vl_moe" else "qwen3vl")
    assert kv[f"{arch}.rope.dimension_sections"] == [6, 5, 5, 0] and kv[f"{arch}.n_deepstack_layers"] == 2
    assert not any(n.startswith(("v.", "mm.")) for n in tensors)
    if shape == "qwen3vl_moe":  # experts as ggml {d, ff, E} / {ff, d, E}: d = 64, ff = 48, 4 experts
        assert tensors["blk.0.ffn_gate_exps.weight"][1] == [64, 48, 4]
        assert tensors["blk.0.ffn_down_exps.weight"][1] == [48, 64, 4]


@pytest.mark.llamacpp
@pytest.mark.parametrize("shape,kind", MMPROJ_PARITY)
def test_mmproj_matches_llamacpp(shape, kind, llama_cpp_bin, tmp_path):
    from hf2q.convert.mmproj import convert_mmproj

    src = checkpoint(shape)
    ours = tmp_path / "mmproj.gguf"
    convert_mmproj(src, ours, kind)
    assert compare_gguf(ours, _llamacpp_mmproj(src, kind)) == []
    kv, tensors = read_gguf(ours)
    assert kv["general.architecture"] == "clip" and kv["general.type"] == "mmproj"
    assert kv["clip.projector_type"] == "qwen3vl_merger"
    assert kv["clip.vision.is_deepstack_layers"] == [True, False, True]
    # the deepstack mergers are named by the encoder block they tap (0 and 2), the Conv3D split in two
    assert {"v.deepstack.0.fc1.weight", "v.deepstack.2.fc2.weight", "v.patch_embd.weight",
            "v.patch_embd.weight.1", "v.position_embd.weight", "mm.0.weight", "mm.2.weight"} <= set(tensors)


@pytest.mark.llamacpp
def test_per_expert_layout_matches_llamacpp_and_the_fused_one(llama_cpp_bin, tmp_path):
    """One 2-D tensor per expert: llama.cpp's bytes, and the same experts as the fused Hub layout gives."""
    _convert(per_expert_checkpoint(), "f16", tmp_path / "per-expert.gguf")
    for reference in (per_expert_checkpoint(), checkpoint("qwen3vl_moe")):  # its own, then the fused file
        assert compare_gguf(tmp_path / "per-expert.gguf", llamacpp_reference(reference, "f16")) == []


def _complete(model: Path, prompt: str) -> str:
    from tests.tools import llama_cpp

    args = [str(llama_cpp.tool("llama-completion")), "-m", str(model), "-p", prompt, "-n", "8", "-t", "1",
            "--temp", "0", "-no-cnv"]
    r = subprocess.run(args, env={**llama_cpp.env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300, check=False, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.slow
@pytest.mark.llamacpp
def test_stock_llamacpp_generates_from_our_text_gguf(llama_cpp_bin, tmp_path, cli):
    """One ``convert --mmproj`` call writes both files; llama-completion runs the text one as its own."""
    src = checkpoint("qwen3vl_moe")
    ours = tmp_path / "model-q8_0.gguf"
    r = cli("convert", src, "--quant", "q8_0", "-o", ours, "--mmproj", "--no-integrity")
    assert r.code == 0, r.err
    mmproj = tmp_path / f"mmproj-{src.name}-q8_0.gguf"
    assert mmproj.is_file() and f"wrote {mmproj}" in r.out
    kv, tensors = read_gguf(mmproj)  # a Q8_0 projector (its bytes: test_mmproj_matches_llamacpp)
    assert kv["general.architecture"] == "clip" and kv["general.file_type"] == 7 and len(tensors) == 58
    prompt = "The capital of France is"
    text = _complete(ours, prompt)
    assert text.startswith(prompt) and len(text) > len(prompt)
    assert text == _complete(llamacpp_reference(src, "q8_0"), prompt)


def test_dry_run_and_info_know_both_files(cli, tmp_path, dense_f16):
    src = checkpoint("qwen3vl")
    r = cli("convert", src, "--quant", "q4_k_m", "--mmproj", "--dry-run")
    assert r.code == 0, r.err
    assert "qwen3vl q4_k_m" in r.out and "blk.0.attn_q_norm.weight" in r.out
    assert "mmproj total: 58 tensors" in r.out and "— clip f16" in r.out
    assert "v.patch_embd.weight.1" in r.out and "v.deepstack.2.fc1.weight" in r.out
    assert not list(tmp_path.iterdir())
    out, side = dense_f16
    assert side.is_file() and not list(out.parent.glob("mmproj-*"))  # --mmproj-output replaced the default
    r = cli("info", "--json", out)
    info = json.loads(r.out)
    assert info["serve_support"] == "ready", info
    r = cli("info", out)
    assert "Family:         qwen3vl" in r.out
    r = cli("info", side)  # the projector is recognised, and refused as a model of its own
    assert r.code == 3 and "Family:         clip (mmproj)" in r.out
    assert "Projector:      qwen3vl_merger: 3 blocks of 32, patch 16, 2 deepstack, into a text width of 64" in r.out
    assert "vision projector (mmproj)" in r.out


def test_bad_inputs_are_one_line_errors(cli, tmp_path, tiny_checkpoint):
    r = cli("convert", tiny_checkpoint("qwen3"), "--quant", "q8_0", "--mmproj", "--dry-run")
    assert r.code == 3 and "no vision tower" in r.err and "Traceback" not in r.err
    r = cli("convert", checkpoint("qwen3vl"), "--quant", "q8_0", "--mmproj-output", tmp_path / "x.gguf")
    assert r.code == 2 and "--mmproj-output needs --mmproj" in r.err
    r = cli("convert", checkpoint("qwen3vl"), "--format", "mlx", "--quant", "mlx-4", "--mmproj")
    assert r.code == 2 and "--mmproj applies to a single GGUF conversion" in r.err
    # the projector's directory is checked before the text model is written
    missing = tmp_path / "nowhere" / "mmproj.gguf"
    r = cli("convert", checkpoint("qwen3vl"), "--quant", "q8_0", "-o", tmp_path / "m.gguf", "--mmproj",
            "--mmproj-output", missing)
    assert r.code != 0 and "nowhere" in r.err and "Traceback" not in r.err and not (tmp_path / "m.gguf").exists()
    # a MoE checkpoint saved in transformers' in-memory expert layout is refused, not misread
    import numpy as np
    from safetensors.numpy import load_file, save_file

    good = checkpoint("qwen3vl_moe")
    bad = tmp_path / "internal-layout"
    bad.mkdir()
    tensors = load_file(str(good / "model.safetensors"))
    for k in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[k] = np.ascontiguousarray(tensors[k].transpose(0, 2, 1))
    save_file(tensors, str(bad / "model.safetensors"))
    for f in good.iterdir():
        if f.name != "model.safetensors":
            os.symlink(f, bad / f.name)
    r = cli("convert", bad, "--quant", "q8_0", "--dry-run")
    assert r.code == 3 and "Hub layout" in r.err and "Traceback" not in r.err
    cfg = json.loads((good / "config.json").read_text())
    del cfg["text_config"]["rope_parameters"]["mrope_section"], cfg["text_config"]["rope_scaling"]["mrope_section"]
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    r = cli("convert", bad, "--quant", "q8_0", "--dry-run")
    assert r.code == 3 and "mrope_section" in r.err
    # a projector needs the image mean/std of preprocessor_config.json
    (bad / "config.json").unlink()
    (bad / "config.json").symlink_to(good / "config.json")
    (bad / "preprocessor_config.json").unlink()
    (bad / "preprocessor_config.json").write_text(json.dumps({"image_std": [0.5, 0.5, 0.5]}))
    r = cli("convert", bad, "--quant", "q8_0", "--mmproj", "--dry-run")
    assert r.code == 3 and "image_mean" in r.err and "Traceback" not in r.err


def _mtmd(model: Path, mmproj: Path, image: Path) -> str:
    from tests.tools import llama_cpp

    args = [str(llama_cpp.tool("llama-mtmd-cli")), "-m", str(model), "--mmproj", str(mmproj), "--image", str(image),
            "-p", "Describe this image.", "-n", "8", "--temp", "0", "-t", "1"]
    r = subprocess.run(args, env={**llama_cpp.env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300, check=False, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mtmd batch encoding done" in r.stderr  # the image went through the vision tower
    return r.stdout


@pytest.mark.slow
@pytest.mark.llamacpp
def test_stock_mtmd_runs_our_pair(llama_cpp_bin, dense_f16, tmp_path):
    """``llama-mtmd-cli`` (built beside the other tools when present) loads our text GGUF with our mmproj,
    encodes an image and generates what it generates from llama.cpp's own pair."""
    from tests.tools import llama_cpp

    if llama_cpp.tool("llama-mtmd-cli") is None:
        pytest.skip("llama-mtmd-cli is not built (cmake --build <build dir> --target llama-mtmd-cli)")
    import numpy as np
    from PIL import Image

    image = tmp_path / "image.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(image)
    src = checkpoint("qwen3vl")
    ours = _mtmd(*dense_f16, image)
    assert ours.strip()
    assert ours == _mtmd(llamacpp_reference(src, "f16"), _llamacpp_mmproj(src, "f16"), image)


def test_hub_expert_columns_read_bf16_in_any_slab(tmp_path):
    """``ExpertColumns`` (the fused Hub experts read by columns) on a bf16 tensor, in slabs that cross experts."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from hf2q.arch.qwen3vl import ExpertColumns
    from hf2q.sources.safetensors_reader import SafetensorsCheckpoint

    e, d, ff = 3, 5, 4
    w = torch.randn(e, d, 2 * ff, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    want = w.float().numpy()
    ck = SafetensorsCheckpoint(tmp_path)
    up = ExpertColumns("w", ff, (e, ff, d))
    rows = np.concatenate([up.rows(ck, lo, min(lo + 5, e * ff)) for lo in range(0, e * ff, 5)])
    np.testing.assert_array_equal(rows, want[:, :, ff:].transpose(0, 2, 1).reshape(e * ff, d))
    ck.close()
