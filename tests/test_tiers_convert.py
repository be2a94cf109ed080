"""Mixed-bit tier conversions end to end: stock llama.cpp loads and generates from them.

The oracle is llama.cpp itself — ``llama-completion`` must load each tier's file and generate,
and a dynamic tier must fit in the bytes ``llama-quantize`` spends on the mix it is sized
against (its reference GGUF, built by ``test_llamacpp_parity.llamacpp_reference``). The dry
run must predict the written file tensor for tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from hf2q.convert import tiers
from tests.test_convert_imatrix import imatrix_for
from tests.test_llamacpp_parity import _generate, llamacpp_reference, read_gguf

T = gguf.GGMLQuantizationType


def _convert(cli, src: Path, quant: str, out: Path, *extra) -> dict:
    r = cli("convert", src, "--quant", quant, "-o", out, "--no-integrity", "--threads", "1", *extra)
    assert r.code == 0, r.err
    return json.loads(Path(str(out) + ".report.json").read_text())


def _quantized_bytes(path: Path) -> int:
    _, tensors = read_gguf(path)
    return sum(len(b) for q, _, b in tensors.values() if q not in (T.F32,))


def _check_file_matches_report(out: Path, rep: dict, ftype: int) -> dict:
    kv, tensors = read_gguf(out)
    assert kv[gguf.Keys.General.FILE_TYPE] == ftype
    for e in rep["tier"]["tensors"]:
        assert tensors[e["name"]][0].name == e["type"], e["name"]
    return tensors


@pytest.mark.parametrize("quant, ref", [("dynamic-q2", "q2_k"), ("dynamic-q4", "q4_k_m")])
def test_dynamic_tier_fits_the_fixed_mix_and_generates(quant, ref, cli, tiny_checkpoint, llama_cpp_bin, tmp_path):
    src = tiny_checkpoint("llama")
    out = tmp_path / f"{quant}.gguf"
    rep = _convert(cli, src, quant, out)
    plan = rep["tier"]
    assert plan["kind"] == "dynamic" and plan["reference_mix"] == ref and not plan["imatrix_weighted"]
    measured = [e for e in plan["tensors"] if "errors" in e]
    assert measured and all(set(e["errors"]) >= {e["type"]} for e in measured)
    from hf2q.convert.quant_names import parse_gguf_quant
    _check_file_matches_report(out, rep, int(parse_gguf_quant(quant).ftype))
    theirs = llamacpp_reference(src, ref)
    assert _quantized_bytes(out) <= _quantized_bytes(theirs)
    assert len(_generate(llama_cpp_bin, out, "Hello", n=8)) > len("Hello")


@pytest.mark.parametrize("family, quant", [
    ("qwen3_moe", "apex-balanced"), ("qwen3_moe", "dynamic-q3"),
    pytest.param("gemma4_moe", "apex-compact", marks=pytest.mark.slow),
    pytest.param("qwen35_moe", "apex-quality", marks=pytest.mark.slow)])
def test_moe_tiers_load_and_generate(family, quant, cli, tiny_checkpoint, llama_cpp_bin, tmp_path):
    src = tiny_checkpoint(family)
    out = tmp_path / "moe.gguf"
    rep = _convert(cli, src, quant, out)
    from hf2q.convert.quant_names import parse_gguf_quant
    tensors = _check_file_matches_report(out, rep, int(parse_gguf_quant(quant).ftype))
    assert all(q == T.F32 for name, (q, _, _) in tensors.items() if "ffn_gate_inp" in name)  # the router
    if quant.startswith("apex"):  # measured choice within each table entry's window, within the table's bytes
        # and within those the mix of the tier's size class spends (hf2q's mix: byte for byte llama-quantize's,
        # tests/test_llamacpp_parity.py, and it also covers families llama.cpp's converter refuses in tiny form)
        from hf2q.convert.tier_plan import reference_mix
        _convert(cli, src, reference_mix(parse_gguf_quant(quant)).name, tmp_path / "mix.gguf")
        _, theirs = read_gguf(tmp_path / "mix.gguf")
        table = tiers.APEX_TABLES[tiers.apex_level(quant)]
        n_layer = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
        from hf2q.convert.policy import fallback_type
        planned = {e["name"] for e in rep["tier"]["tensors"]}
        table_bytes = ours = mix_bytes = 0
        for name, (q, ne, _) in tensors.items():
            if name not in planned:
                continue
            want = fallback_type(ne[0], tiers.apex_type(table, name, n_layer, "output.weight" not in tensors))
            n = int(np.prod(ne))
            table_bytes += tiers.tensor_bytes(want, n)
            ours += tiers.tensor_bytes(q, n)
            mix_bytes += len(theirs[name][2])
            assert q == want or abs(tiers.bits_per_weight(q) - tiers.bits_per_weight(want)) <= tiers.APEX_WINDOW_BPW
        assert ours <= min(table_bytes, mix_bytes) == rep["tier"]["budget_bytes"] + sum(
            tiers.tensor_bytes(T[e["type"]], int(np.prod(tensors[e["name"]][1])))
            for e in rep["tier"]["tensors"] if "errors" not in e)
    assert len(_generate(llama_cpp_bin, out, "Hello", n=8)) > len("Hello")


@pytest.mark.slow
def test_apex_i_takes_the_imatrix(cli, tiny_checkpoint, llama_cpp_bin, tmp_path):
    src = tiny_checkpoint("qwen3_moe")
    im = imatrix_for(llamacpp_reference(src, "f16"), tmp_path / "m.imatrix.gguf")
    rep = _convert(cli, src, "apex-i-balanced", tmp_path / "i.gguf", "--imatrix", str(im))
    plain = _convert(cli, src, "apex-balanced", tmp_path / "p.gguf")
    assert rep["tier"]["imatrix_weighted"] and not plain["tier"]["imatrix_weighted"]
    # the imatrix weights the measured errors the plan is chosen from
    assert [e.get("errors") for e in rep["tier"]["tensors"]] != [e.get("errors") for e in plain["tier"]["tensors"]]
    assert len(_generate(llama_cpp_bin, tmp_path / "i.gguf", "Hello", n=8)) > len("Hello")


def test_dry_run_predicts_the_file(cli, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    r = cli("convert", src, "--quant", "dynamic-q3", "--dry-run")
    assert r.code == 0, r.err
    assert r.out == cli("convert", src, "--quant", "dynamic-q3", "--dry-run").out  # deterministic
    rows = {}
    for line in r.out.splitlines()[1:]:
        if m := re.match(r"(\S+)\s+\[[^\]]*\]\s+(\S+)\s+([\d.]+)\s+(\d+)", line):
            rows[m[1]] = (m[2], float(m[3]), int(m[4]))
    assert "tier dynamic-q3:" in r.out and "q3_k_m's quantized tensors" in r.out
    out = tmp_path / "d.gguf"
    _convert(cli, src, "dynamic-q3", out)
    _, tensors = read_gguf(out)
    assert set(rows) == set(tensors)
    for name, (q, ne, data) in tensors.items():
        assert rows[name][0] == q.name and rows[name][2] == len(data), name
        n = 1
        for d in ne:
            n *= d
        assert rows[name][1] == pytest.approx(8 * len(data) / n, abs=0.005)


@pytest.mark.slow
def test_smollm2_dynamic_q4_is_no_bigger_than_q4_k_m_and_answers(smollm2_hf, llama_cpp_bin, cli, tmp_path):
    out = tmp_path / "smol.gguf"
    _convert(cli, smollm2_hf, "dynamic-q4", out)
    assert _quantized_bytes(out) <= _quantized_bytes(llamacpp_reference(smollm2_hf, "q4_k_m"))
    text = _generate(llama_cpp_bin, out, "The capital of France is", n=12)
    assert "Paris" in text
