"""``hf2q convert --imatrix``: importance-weighted GGUF quantization, checked against llama-quantize.

No ``llama-imatrix`` is built here, so the importance matrix is written in llama.cpp's GGUF imatrix
layout from known random statistics (``tests/test_imatrix.write_gguf``). The oracle is llama.cpp's
own pipeline: ``convert_hf_to_gguf.py --outtype f16`` (cached by ``test_llamacpp_parity``) then
``llama-quantize --imatrix FILE F16 OUT MIX``; our ``hf2q convert --quant MIX --imatrix FILE`` must
equal it tensor for tensor (types and bytes) and in every metadata key, ``quantize.imatrix.*``
included. A 3-D expert tensor (tiny qwen3_moe) checks per-expert weights.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.test_imatrix import write_gguf, write_legacy
from tests.test_llamacpp_parity import compare_gguf, llamacpp_reference, read_gguf

IMATRIX_KEYS = ("quantize.imatrix.file", "quantize.imatrix.dataset", "quantize.imatrix.entries_count",
                "quantize.imatrix.chunks_count")


def imatrix_for(ref_f16: Path, out: Path, skip=(), seed: int = 0) -> Path:
    """A GGUF imatrix with an entry for every 2-D/3-D ``blk.*`` / ``output`` weight of ``ref_f16``
    (names in ``skip`` left out): heavy-tailed column sums, one row + count per expert."""
    _, tensors = read_gguf(ref_f16)
    rng = np.random.default_rng(seed)
    entries = {}
    for name, (_, ne, _) in sorted(tensors.items()):
        if name in skip or len(ne) < 2 or not (name.startswith("blk.") or name == "output.weight"):
            continue
        n_expert = ne[2] if len(ne) > 2 else 1
        sums = rng.gamma(0.5, 30.0, (n_expert, ne[0])).astype(np.float32)
        counts = rng.integers(100, 2000, n_expert).astype(np.float32)
        if n_expert > 1:
            counts[-1] = 0  # an expert the calibration never routed to: weights of 1
        entries[name] = (sums, counts)
    return write_gguf(out, entries, datasets=("calib-wiki.txt",))


def llama_quantize(f16: Path, out: Path, mix: str, imatrix: Path) -> subprocess.CompletedProcess:
    from tests.tools import llama_cpp

    return subprocess.run([str(llama_cpp.tool("llama-quantize")), "--imatrix", str(imatrix), str(f16), str(out),
                           mix, "2"], env=llama_cpp.env(), capture_output=True, text=True, check=False)


def convert(cli, src: Path, quant: str, out: Path, imatrix: Path):
    return cli("convert", src, "--quant", quant, "--imatrix", str(imatrix), "-o", out, "--no-integrity")


@pytest.fixture(scope="module")
def smollm2_setup(smollm2_hf, llama_cpp_bin, tmp_path_factory):
    d = tmp_path_factory.mktemp("smollm2-imatrix")
    f16 = llamacpp_reference(smollm2_hf, "f16")
    # one tensor without an entry: llama-quantize then quantizes it unweighted (not required in q2_k_s)
    return smollm2_hf, f16, imatrix_for(f16, d / "smollm2.imatrix.gguf", skip=("blk.1.attn_q.weight",))


def quantize_both_equal(cli, src, f16, quant: str, imatrix, tmp_path):
    """``llama-quantize --imatrix`` of llama.cpp's F16 and ``hf2q convert --imatrix`` of the HF source:
    asserts the two GGUFs are equal and returns ours."""
    theirs = tmp_path / "theirs.gguf"
    r = llama_quantize(f16, theirs, quant.upper(), imatrix)
    assert r.returncode == 0, r.stderr[-2000:]
    ours = tmp_path / "ours.gguf"
    res = convert(cli, src, quant, ours, imatrix)
    assert res.code == 0, res.err
    assert compare_gguf(ours, theirs) == []
    return ours


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("quant", ["q4_k_m", "q2_k_s", "q4_0"])
def test_smollm2_matches_llama_quantize_with_imatrix(quant, smollm2_setup, cli, tmp_path):
    src, f16, imatrix = smollm2_setup
    ours = quantize_both_equal(cli, src, f16, quant, imatrix, tmp_path)
    kv, tensors = read_gguf(ours)
    assert kv["quantize.imatrix.file"] == str(imatrix)
    assert kv["quantize.imatrix.dataset"] == "calib-wiki.txt"
    assert kv["quantize.imatrix.chunks_count"] == 17
    assert kv["quantize.imatrix.entries_count"] == 30 * 7 - 1
    if quant == "q4_k_m":  # the imatrix did shape the result: the plain conversion differs
        _, plain = read_gguf(llamacpp_reference(src, quant))
        name = "blk.3.ffn_down.weight"
        assert plain[name][0] == tensors[name][0] and plain[name][2] != tensors[name][2]
        assert plain["blk.1.attn_q.weight"] == tensors["blk.1.attn_q.weight"]  # no entry: unweighted
    elif quant == "q2_k_s":
        assert tensors["blk.5.ffn_down.weight"][0].name == "Q2_K"
    else:  # with an imatrix llama.cpp gives q4_0's first n_layer/8 ffn_down Q4_1 (without: Q4_0)
        assert [tensors[f"blk.{i}.ffn_down.weight"][0].name for i in (2, 3)] == ["Q4_1", "Q4_0"]


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("quant", ["q4_k_m", "q2_k_s"])
def test_moe_experts_each_get_their_own_weights(quant, tiny_checkpoint, llama_cpp_bin, cli, tmp_path):
    """qwen3_moe's ``ffn_*_exps`` are [ne0, ne1, n_expert]: expert e's rows use imatrix row e."""
    src = tiny_checkpoint("qwen3_moe")
    f16 = llamacpp_reference(src, "f16")
    imatrix = imatrix_for(f16, tmp_path / "moe.imatrix.gguf", seed=1)
    ours = quantize_both_equal(cli, src, f16, quant, imatrix, tmp_path)
    _, tensors = read_gguf(ours)
    _, plain = read_gguf(llamacpp_reference(src, "q2_k" if quant == "q2_k_s" else quant))
    experts = [n for n, (_, ne, _) in tensors.items() if len(ne) == 3]
    assert experts, "no expert tensor in the tiny MoE"
    weighted = [n for n in experts if tensors[n][0].name != "Q8_0"]  # Q8_0 ignores importance weights
    assert weighted and all(tensors[n][2] != plain[n][2] for n in weighted)  # the imatrix did change them
    # and per expert: expert 1 quantized with expert 0's weights would not give these bytes
    from hf2q.ggml import codec
    from hf2q.sources.imatrix import load_imatrix, weights_for_tensor

    name = weighted[0]
    qtype, ne, raw = tensors[name]
    _, f16_tensors = read_gguf(f16)
    x = np.frombuffer(f16_tensors[name][2], dtype="<f2").astype(np.float32).reshape(ne[2], ne[1], ne[0])
    w = weights_for_tensor(load_imatrix(imatrix), name, ne)
    ours_rows = np.frombuffer(raw, np.uint8).reshape(ne[2], ne[1], -1)
    assert np.array_equal(codec.quantize(x[1], qtype, imatrix=w[1]), ours_rows[1])
    assert not np.array_equal(codec.quantize(x[1], qtype, imatrix=w[0]), ours_rows[1])


def test_q2_k_s_without_imatrix_is_refused(tiny_checkpoint, cli, tmp_path):
    res = cli("convert", tiny_checkpoint("llama"), "--quant", "q2_k_s", "-o", tmp_path / "o.gguf")
    assert res.code == 3 and "--imatrix" in res.err
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.slow
@pytest.mark.llamacpp
def test_q2_k_s_with_a_missing_entry_fails_like_llama_quantize(smollm2_setup, cli, tmp_path):
    """SmolLM2's blk.5.ffn_down (1536 columns) is Q2_K in a q2_k_s file and must have an entry."""
    src, f16, _ = smollm2_setup
    imatrix = imatrix_for(f16, tmp_path / "partial.gguf", skip=("blk.5.ffn_down.weight",))
    r = llama_quantize(f16, tmp_path / "theirs.gguf", "Q2_K_S", imatrix)
    assert r.returncode != 0 and "blk.5.ffn_down.weight" in (r.stdout + r.stderr)
    res = convert(cli, src, "q2_k_s", tmp_path / "o.gguf", imatrix)
    assert res.code == 3 and "blk.5.ffn_down.weight" in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1
    assert not (tmp_path / "o.gguf").exists()


def test_bad_imatrix_files_exit_3(tiny_checkpoint, cli, tmp_path):
    src = tiny_checkpoint("llama")
    garbage = tmp_path / "garbage.imatrix"
    garbage.write_bytes(b"\x01\x00\x00\x00\xff\xff")
    wrong_size = write_legacy(tmp_path / "wrong.imatrix", {"blk.0.attn_q.weight": (1, np.ones(7))})
    for f in (tmp_path / "missing.imatrix", garbage, wrong_size):
        res = convert(cli, src, "q4_k_m", tmp_path / "o.gguf", f)
        assert res.code == 3, (f, res.err)
        assert len(res.err.strip().splitlines()) == 1 and "Traceback" not in res.err
        assert not (tmp_path / "o.gguf").exists()


def test_imatrix_changes_only_weighted_tensors(tiny_checkpoint, cli, tmp_path):
    """Without an llama.cpp build: an entry for one tensor changes that tensor's bytes only
    (our own plain conversion is the llama.cpp-identical baseline checked elsewhere)."""
    src = tiny_checkpoint("llama")
    plain = tmp_path / "plain.gguf"
    assert cli("convert", src, "--quant", "q4_k_m", "-o", plain, "--no-integrity").code == 0
    kv0, t0 = read_gguf(plain)
    ne0 = t0["blk.0.attn_q.weight"][1][0]
    rng = np.random.default_rng(5)
    f = write_legacy(tmp_path / "one.imatrix", {"blk.0.attn_q.weight": (3, rng.gamma(0.5, 9.0, ne0))},
                     chunks=3, dataset="d.txt")
    weighted = tmp_path / "weighted.gguf"
    assert convert(cli, src, "q4_k_m", weighted, f).code == 0
    kv1, t1 = read_gguf(weighted)
    changed = sorted(n for n in t0 if t0[n][2] != t1[n][2])
    assert changed == ["blk.0.attn_q.weight"]
    assert {k: kv1[k] for k in IMATRIX_KEYS} == {"quantize.imatrix.file": str(f), "quantize.imatrix.dataset": "d.txt",
                                                 "quantize.imatrix.entries_count": 1,
                                                 "quantize.imatrix.chunks_count": 3}
    assert not any(k.startswith("quantize.") for k in kv0)
