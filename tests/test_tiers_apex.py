"""APEX tiers choose from measured sensitivity within their tables (docs/QUALITY.md, "APEX tiers (MoE)").

The conversion's report carries, per planned tensor, the measured relative error at each candidate;
these tests check the plan against the table it starts from, and the measured error against the
error of the tensor actually written, decoded by gguf-py (not our codecs) and compared with the
checkpoint's own weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from safetensors.numpy import load_file

from hf2q.convert import tiers
from hf2q.convert.policy import fallback_type

T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def apex_compact(tiny_checkpoint, tmp_path_factory):
    from hf2q.cli import main

    src = tiny_checkpoint("qwen3_moe")
    out = tmp_path_factory.mktemp("apex") / "moe.gguf"
    assert main(["convert", str(src), "-q", "apex-compact", "-o", str(out), "--no-integrity", "--threads", "1"]) == 0
    return src, out, json.loads(Path(f"{out}.report.json").read_text())


def _tensors(path: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_plan_is_no_worse_than_its_table_and_no_larger(apex_compact):
    _, out, rep = apex_compact
    table = tiers.APEX_TABLES["compact"]
    written = _tensors(out)
    n_layer = 1 + max(int(n.split(".")[1]) for n in written if n.startswith("blk."))
    ours = theirs = ours_bytes = table_bytes = 0.0
    moved = 0
    for e in rep["tier"]["tensors"]:
        t = written[e["name"]]
        want = fallback_type(int(t.shape[0]), tiers.apex_type(table, e["name"], n_layer))
        assert T(t.tensor_type).name == e["type"]
        n = int(np.prod([int(v) for v in t.shape]))
        ours_bytes += tiers.tensor_bytes(T[e["type"]], n)
        table_bytes += tiers.tensor_bytes(want, n)
        if "errors" not in e:
            assert e["type"] == want.name
            continue
        assert want.name in e["errors"]  # the table's own type is always a candidate
        ours += e["importance"] * e["errors"][e["type"]]
        theirs += e["importance"] * e["errors"][want.name]
        moved += e["type"] != want.name
    assert ours_bytes <= table_bytes  # the budget is the smaller of the table's bytes and q3_k_m's
    # a table that fits its budget is the fallback; this one does not fit q3_k_m (tests/test_tiers_budget.py),
    # and the search still ends below it in measured distortion on this model
    assert ours <= theirs
    assert moved > 0  # the measurement changed something on this model


def test_measured_error_is_the_written_tensors_error(apex_compact):
    src, out, rep = apex_compact
    hf = load_file(str(Path(src) / "model.safetensors"))
    written = _tensors(out)
    name = "blk.1.attn_v.weight"
    e = next(e for e in rep["tier"]["tensors"] if e["name"] == name)
    t = written[name]
    x = hf["model.layers.1.self_attn.v_proj.weight"].astype(np.float16).astype(np.float64)
    y = dequantize(t.data, T(t.tensor_type)).reshape(x.shape).astype(np.float64)
    actual = float(((x - y) ** 2).sum() / (x ** 2).sum())
    assert actual == pytest.approx(e["errors"][e["type"]], rel=0.05)  # the sample is the whole (small) tensor


def test_a_tied_embedding_is_planned_as_the_logits_matrix():
    # SmolLM2-style tied models: the embedding is also the output, so the table's output column applies
    for table in tiers.APEX_TABLES.values():
        assert tiers.apex_type(table, "token_embd.weight", 30, tied_output=True) == table.output
        assert tiers.apex_type(table, "token_embd.weight", 30) == table.token_embd
