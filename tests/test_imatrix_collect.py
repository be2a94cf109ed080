"""The importance-matrix accumulator, writer and chunking, against llama-imatrix's definitions written
out longhand here (``tools/imatrix/imatrix.cpp``: Σ x² per column, one count per row; per expert for
an expert-stacked product), and the command's refusals. The comparison with llama-imatrix itself is
``test_imatrix_collect_llamacpp.py``."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q.errors import InputError
from hf2q.quality.imatrix_collect import MIN_ROWS, ImatrixCollector
from hf2q.quality.scores import windows
from hf2q.sources.imatrix import read_imatrix, write_imatrix


def raw_entries(path) -> tuple[dict, dict]:
    """``({tensor name: (ne, float32 values)}, {key: value})`` straight from the GGUF container."""
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: (tuple(int(d) for d in t.shape), np.array(t.data, dtype=np.float32).reshape(-1))
               for t in r.tensors}
    keys = {}
    for k, f in r.fields.items():
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            keys[k] = [bytes(f.parts[i]).decode() for i in f.data]
        elif f.types == [gguf.GGUFValueType.STRING]:
            keys[k] = bytes(f.parts[f.data[0]]).decode()
        elif f.data:
            keys[k] = f.parts[f.data[0]].tolist()[0]
    return tensors, keys


def test_dense_sums_squares_per_column_and_counts_rows():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(20, 8)).astype(np.float32), rng.normal(size=(2, 17, 8)).astype(np.float32)
    c = ImatrixCollector()
    c.dense("blk.0.attn_q.weight", a)
    c.dense("blk.0.attn_q.weight", b)  # leading dims are rows
    sums, counts = c.result()["blk.0.attn_q.weight"]
    want = (a.astype(np.float64) ** 2).sum(0) + (b.reshape(-1, 8).astype(np.float64) ** 2).sum(0)
    assert sums.shape == (1, 8) and sums.dtype == np.float32
    np.testing.assert_allclose(sums[0], want, rtol=1e-6)
    assert counts.tolist() == [54.0]


def test_small_batches_and_non_block_weights_are_not_collected():
    x = np.ones((MIN_ROWS - 1, 4), np.float32)
    c = ImatrixCollector()
    c.dense("blk.0.ffn_up.weight", x)  # llama-imatrix ignores products over < 16 rows
    c.dense("output.weight", np.ones((64, 4), np.float32))
    c.dense("token_embd.weight", np.ones((64, 4), np.float32))
    assert c.result() == {}
    c.dense("blk.0.ffn_up.weight", np.ones((MIN_ROWS, 4), np.float32))
    assert c.result()["blk.0.ffn_up.weight"][1].tolist() == [MIN_ROWS]


def longhand_experts(x: np.ndarray, ids: np.ndarray, n_expert: int):
    """imatrix.cpp's MUL_MAT_ID loop: for every slot and token, add the slot's input to its expert."""
    n, k = ids.shape
    sums, counts = np.zeros((n_expert, x.shape[2])), np.zeros(n_expert)
    for slot in range(k):
        for row in range(n):
            e = ids[row, slot]
            counts[e] += 1
            sums[e] += x[row, slot % x.shape[1]].astype(np.float64) ** 2
    return sums, counts


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), n_expert=st.integers(1, 6), n_in=st.integers(1, 9), shared=st.booleans(),
       seed=st.integers(0, 2 ** 16), calls=st.integers(1, 3))
def test_experts_count_each_routed_token_for_its_expert(n, n_expert, n_in, shared, seed, calls):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, n_expert + 1))
    c = ImatrixCollector()
    want_s, want_c = np.zeros((n_expert, n_in)), np.zeros(n_expert)
    for _ in range(calls):
        ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n)])
        x = rng.normal(size=(n, 1 if shared else k, n_in)).astype(np.float32)
        c.experts("blk.3.ffn_down_exps.weight", x, ids, n_expert)
        s, cnt = longhand_experts(x, ids, n_expert)
        want_s += s
        want_c += cnt
    sums, counts = c.result()["blk.3.ffn_down_exps.weight"]
    assert counts.tolist() == want_c.tolist()
    np.testing.assert_allclose(sums, want_s, rtol=1e-6)


def test_non_finite_inputs_are_refused():
    x = np.ones((MIN_ROWS, 3), np.float32)
    x[2, 1] = np.inf
    with pytest.raises(InputError, match="not finite"):
        ImatrixCollector().dense("blk.0.attn_k.weight", x)


def test_writer_layout_and_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    dense = rng.gamma(1.0, 2.0, (1, 32)).astype(np.float32)
    experts = rng.gamma(1.0, 2.0, (4, 16)).astype(np.float32)
    counts = np.array([5, 0, 7, 12], np.float32)
    out = write_imatrix(tmp_path / "m.imatrix.gguf", {"blk.1.ffn_down_exps.weight": (experts, counts),
                                                    "blk.0.attn_q.weight": (dense, np.array([9.0]))},
                        datasets=("calibration",), chunk_count=3, chunk_size=128)
    assert not list(tmp_path.glob("*.tmp"))
    tensors, keys = raw_entries(out)
    assert list(tensors) == ["blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts",
                             "blk.1.ffn_down_exps.weight.in_sum2", "blk.1.ffn_down_exps.weight.counts"]
    assert tensors["blk.1.ffn_down_exps.weight.in_sum2"][0] == (16, 4)  # ne = [n_per_row, n_mat]
    assert tensors["blk.1.ffn_down_exps.weight.counts"][0] == (1, 4)
    assert tensors["blk.0.attn_q.weight.in_sum2"][0] == (32,) and tensors["blk.0.attn_q.weight.counts"][0] == (1,)
    assert keys[gguf.Keys.General.TYPE] == "imatrix"
    assert keys[gguf.Keys.IMatrix.DATASETS] == ["calibration"]
    assert (keys[gguf.Keys.IMatrix.CHUNK_COUNT], keys[gguf.Keys.IMatrix.CHUNK_SIZE]) == (3, 128)
    back = read_imatrix(out)
    assert (back.datasets, back.chunk_count, back.chunk_size) == (("calibration",), 3, 128)
    np.testing.assert_array_equal(back.weights["blk.0.attn_q.weight"], dense[0] / np.float32(9))
    w = back.weights["blk.1.ffn_down_exps.weight"]
    np.testing.assert_array_equal(w[1], np.ones(16, np.float32))  # an expert that never ran
    np.testing.assert_array_equal(w[3], experts[3] / np.float32(12))


def test_chunks_are_llama_imatrix_chunks():
    tokens = list(range(100, 1100))
    chunks = windows(tokens, 128, None, bos_id=1).tolist()
    assert len(chunks) == 1000 // 128  # the remainder is dropped
    assert all(len(c) == 128 and c[0] == 1 for c in chunks)
    assert chunks[2][1:] == tokens[2 * 128 + 1:3 * 128]
    assert windows(tokens, 128, None, bos_id=None)[1][0] == tokens[128]
    assert len(windows(tokens, 128, 3, bos_id=1)) == 3
    with pytest.raises(ValueError, match="at least 1024"):
        windows(tokens, 512, None, bos_id=1)


def test_command_refusals(cli, tmp_path, tiny_checkpoint):
    src = tiny_checkpoint("llama")
    assert cli("imatrix", str(tmp_path / "absent"), "-o", tmp_path / "x.gguf").code == 3
    assert cli("imatrix", str(src), "--corpus", "no-such-corpus", "-o", tmp_path / "x.gguf").code == 3
    assert cli("imatrix", str(src), "-o", tmp_path / "nodir" / "x.gguf").code == 3
    assert cli("imatrix", str(src), "-o", tmp_path / "x.gguf", "--n-ctx", "4").code == 2
    short = tmp_path / "short.txt"
    short.write_text("only a few words here\n")
    r = cli("imatrix", str(src), "--corpus", short, "-o", tmp_path / "x.gguf", "--n-ctx", "64")
    assert r.code == 3 and "tokenizes to" in r.err and len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".hf2q-imatrix-*"))
    both = cli("convert", str(src), "-q", "q4_k_m", "--imatrix", "x.gguf", "--imatrix-corpus", "calibration")
    assert both.code == 2 and "not both" in both.err
    assert cli("convert", str(src), "-q", "q4_k_m", "--imatrix-n-ctx", "128").code == 2
    assert cli("convert", str(src), "-q", "q4_k_m", "--imatrix-corpus", "nope", "-o", tmp_path / "o.gguf").code == 3


def test_command_writes_a_readable_matrix_and_a_json_summary(cli, tmp_path, tiny_checkpoint):
    import json

    out = tmp_path / "tiny.imatrix.gguf"
    r = cli("imatrix", str(tiny_checkpoint("qwen3_moe")), "-o", out, "--n-ctx", "64", "--chunks", "2", "--json")
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    assert (summary["chunks"], summary["n_ctx"], summary["dataset"]) == (2, 64, "calibration")
    m = read_imatrix(out)
    assert (m.chunk_count, m.chunk_size) == (2, 64)
    tensors, _ = raw_entries(out)
    router = tensors["blk.0.ffn_gate_inp.weight.counts"][1]
    experts = tensors["blk.0.ffn_gate_exps.weight.counts"][1]
    assert router.tolist() == [128.0]  # one count per token for a plain product
    assert experts.size == 4 and experts.sum() == 128 * 2  # top-2 of 4: two routed slots per token
    assert not list(tmp_path.glob(".hf2q-imatrix-*"))  # the temporary F16 conversion is gone
    from hf2q.engine import layers

    assert layers._observer is None  # the run took its observer out again
