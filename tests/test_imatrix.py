"""hf2q.sources.imatrix: llama.cpp importance matrices in both file formats.

Files are written here from known arrays — the legacy binary layout with ``struct``, the GGUF
layout (``<name>.in_sum2`` / ``<name>.counts`` + ``imatrix.*`` metadata) with the gguf
package — following llama.cpp's ``tools/imatrix/imatrix.cpp``.  The expected weights are
llama-quantize's rule (``tools/quantize/quantize.cpp``: legacy ``sums / ncall``, GGUF
``in_sum2 / lround(count)`` per expert, 1 for an expert never run), and the slow test feeds
the same files to the real ``llama-quantize`` and compares its output bytes with ours.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from hf2q.errors import InputError
from hf2q.sources.imatrix import load_imatrix, read_imatrix, weights_for_tensor


def write_legacy(path: Path, entries: dict[str, tuple[int, np.ndarray]], chunks: int | None = None,
                 dataset: str | None = None) -> Path:
    """llama.cpp's ``save_imatrix_legacy`` layout: entries of (ncall, values already mean·ncall)."""
    out = bytearray(struct.pack("<i", len(entries)))
    for name, (ncall, values) in entries.items():
        raw = name.encode()
        out += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, len(values))
        out += np.asarray(values, dtype="<f4").tobytes()
    if chunks is not None:
        out += struct.pack("<i", chunks)
        if dataset is not None:
            out += struct.pack("<i", len(dataset)) + dataset.encode()
    path.write_bytes(bytes(out))
    return path


def write_gguf(path: Path, entries: dict[str, tuple[np.ndarray, np.ndarray]], metadata: bool = True,
               datasets=("calibration.txt",)) -> Path:
    """llama.cpp's ``save_imatrix`` layout: in_sum2 F32 ne=[n_per_row, n_mat], counts F32 ne=[1, n_mat]."""
    w = gguf.GGUFWriter(str(path), arch="imatrix")
    w.add_string("general.type", "imatrix")
    if metadata:
        w.add_array("imatrix.datasets", list(datasets))
        w.add_uint32("imatrix.chunk_count", 17)
        w.add_uint32("imatrix.chunk_size", 512)
    for name, (sums, counts) in entries.items():
        sums = np.asarray(sums, dtype=np.float32)
        w.add_tensor(f"{name}.in_sum2", sums.reshape(-1, sums.shape[-1]))
        w.add_tensor(f"{name}.counts", np.asarray(counts, dtype=np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_legacy_weights_are_sums_over_ncall(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.gamma(1.0, 3.0, 64).astype(np.float32)
    b = rng.gamma(1.0, 3.0, 96).astype(np.float32)
    f = write_legacy(tmp_path / "m.imatrix", {"blk.0.attn_q.weight": (7, a), "blk.0.ffn_down.weight": (0, b)},
                     chunks=7, dataset="wiki.train.raw")
    got = read_imatrix(f)
    assert got.legacy and got.chunk_count == 7 and got.datasets == ("wiki.train.raw",)
    assert set(got.weights) == {"blk.0.attn_q.weight", "blk.0.ffn_down.weight"}
    want = a / np.float32(7)  # float32 division, as the C
    assert got.weights["blk.0.attn_q.weight"].dtype == np.float32
    assert np.array_equal(got.weights["blk.0.attn_q.weight"], want)
    assert np.array_equal(got.weights["blk.0.ffn_down.weight"], b)  # ncall 0: the raw values


def test_legacy_trailer_is_optional(tmp_path):
    f = write_legacy(tmp_path / "m.dat", {"output.weight": (2, np.array([2.0, 4.0, 6.0]))})
    got = read_imatrix(f)
    assert got.chunk_count == 0 and got.datasets == ()
    assert got.weights["output.weight"].tolist() == [1.0, 2.0, 3.0]


def test_gguf_weights_are_per_expert_means(tmp_path):
    rng = np.random.default_rng(1)
    dense = rng.gamma(1.0, 50.0, (1, 256)).astype(np.float32)
    experts = rng.gamma(1.0, 50.0, (3, 32)).astype(np.float32)
    f = write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": (dense, [40.0]),
                                          "blk.0.ffn_down_exps.weight": (experts, [8.0, 0.0, 2.5])})
    got = read_imatrix(f)
    assert not got.legacy and got.datasets == ("calibration.txt",)
    assert (got.chunk_count, got.chunk_size) == (17, 512)
    assert np.array_equal(got.weights["blk.0.ffn_down.weight"], dense[0] / np.float32(40))
    exps = got.weights["blk.0.ffn_down_exps.weight"]
    assert exps.shape == (3, 32)
    assert np.array_equal(exps[0], experts[0] / np.float32(8))
    assert np.array_equal(exps[1], np.ones(32, np.float32))  # an expert that never ran weighs 1
    assert np.array_equal(exps[2], experts[2] / np.float32(3))  # lround(2.5) = 3, halves away from zero


def test_weights_for_tensor_follows_llama_quantize_size_rule(tmp_path):
    imatrix = {"blk.0.ffn_down_exps.weight": np.arange(96, dtype=np.float32).reshape(3, 32),
               "blk.0.attn_q.weight": np.ones(64, np.float32),
               "token_embd.weight": np.ones(10, np.float32)}
    rows = weights_for_tensor(imatrix, "blk.0.ffn_down_exps.weight", (32, 8, 3))
    assert rows.shape == (3, 32) and rows[2, 0] == 64.0
    assert weights_for_tensor(imatrix, "blk.0.attn_q.weight", (64, 64)).shape == (1, 64)
    assert weights_for_tensor(imatrix, "blk.0.attn_k.weight", (64, 16)) is None
    assert weights_for_tensor(imatrix, "token_embd.weight", (64, 100)) is None  # skipped, as llama-quantize does
    with pytest.raises(InputError, match="has 64 values, the tensor needs 128"):
        weights_for_tensor(imatrix, "blk.0.attn_q.weight", (128, 64))


def test_both_formats_of_one_matrix_agree(tmp_path):
    """The same statistics saved both ways (legacy stores mean·ncall) give the same weights."""
    rng = np.random.default_rng(2)
    sums = rng.gamma(1.0, 10.0, 128).astype(np.float32)
    count, chunk_size = 1024, 512
    ncall = -(-count // chunk_size)
    legacy_values = (sums / np.float32(count)) * np.float32(ncall)
    a = load_imatrix(write_gguf(tmp_path / "m.gguf", {"x.weight": (sums[None], [float(count)])}))
    b = load_imatrix(write_legacy(tmp_path / "m.dat", {"x.weight": (ncall, legacy_values)}))
    np.testing.assert_allclose(a["x.weight"], b["x.weight"], rtol=1e-6)


@pytest.mark.parametrize("content,match", [
    (b"", "not an imatrix"),
    (struct.pack("<i", 0), "no entries"),
    (struct.pack("<ii", 1, 5) + b"ab", "truncated"),
    (struct.pack("<ii", 1, -3), "name of -3 bytes"),
    (struct.pack("<ii", 1, 1) + b"x" + struct.pack("<ii", 1, 0), "0 values"),
    (struct.pack("<ii", 1, 1) + b"x" + struct.pack("<ii", 1, 4) + b"\0" * 8, "truncated"),
    (struct.pack("<ii", 1, 1) + b"x" + struct.pack("<ii", 1, 1) + struct.pack("<f", float("nan")), "non-finite"),
    (struct.pack("<ii", 1, 1) + b"x" + struct.pack("<ii", 1, 1) + struct.pack("<f", -1.0), "negative"),
])
def test_bad_legacy_files_raise_input_error(tmp_path, content, match):
    f = tmp_path / "bad.imatrix"
    f.write_bytes(content)
    with pytest.raises(InputError, match=match):
        load_imatrix(f)


def test_bad_gguf_files_raise_input_error(tmp_path):
    with pytest.raises(InputError, match="cannot read imatrix"):
        load_imatrix(tmp_path / "missing.gguf")
    ok = {"x.weight": (np.ones((1, 32)), [1.0])}
    with pytest.raises(InputError, match="lacks the imatrix metadata"):
        load_imatrix(write_gguf(tmp_path / "nometa.gguf", ok, metadata=False))
    w = gguf.GGUFWriter(str(tmp_path / "unpaired.gguf"), arch="imatrix")
    w.add_array("imatrix.datasets", ["d"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", 1)
    w.add_tensor("x.weight.in_sum2", np.ones((1, 32), np.float32))
    w.add_tensor("y.weight.in_sum2", np.ones((1, 32), np.float16))
    w.add_tensor("y.weight.counts", np.ones((1, 1), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match="must be F32|no counts"):
        load_imatrix(tmp_path / "unpaired.gguf")
    with pytest.raises(InputError, match="32 sums for 3 counts"):
        load_imatrix(write_gguf(tmp_path / "uneven.gguf", {"x.weight": (np.ones((1, 32)), [1.0, 2.0, 3.0])}))
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes((tmp_path / "uneven.gguf").read_bytes()[:40])
    with pytest.raises(InputError):
        load_imatrix(trunc)


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("fmt", ["gguf", "legacy"])
def test_llama_quantize_uses_the_weights_we_read(tmp_path, fmt, smollm2_gguf, llama_cpp_bin):
    """Real llama-quantize (Q4_0, --pure) with an imatrix file covering two tensors: its bytes for
    those tensors equal ``codec.quantize(…, imatrix=weights_for_tensor(load_imatrix(file)))``."""
    from gguf import quants as gguf_quants

    from hf2q.ggml import codec
    from tests.tools import llama_cpp

    src = {t.name: t for t in gguf.GGUFReader(smollm2_gguf).tensors}
    names = ("blk.0.ffn_down.weight", "blk.2.attn_q.weight")
    rng = np.random.default_rng(3)
    if fmt == "gguf":
        entries = {n: (rng.gamma(0.6, 40.0, (1, int(src[n].shape[0]))), [float(rng.integers(200, 900))])
                   for n in names}
        f = write_gguf(tmp_path / "m.gguf", entries)
    else:
        f = write_legacy(tmp_path / "m.imatrix", {n: (int(rng.integers(1, 9)), rng.gamma(0.6, 4.0, int(src[n].shape[0])))
                                                   for n in names}, chunks=3, dataset="d.txt")
    out = tmp_path / "q4_0.gguf"
    subprocess.run([str(llama_cpp_bin / "llama-quantize"), "--allow-requantize", "--pure", "--imatrix", str(f),
                    str(smollm2_gguf), str(out), "Q4_0", "2"], check=True, env=llama_cpp.env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    theirs = {t.name: t for t in gguf.GGUFReader(out).tensors}
    imatrix = load_imatrix(f)
    for name in (*names, "blk.1.attn_q.weight"):  # the last one has no entry: quantized without
        t = src[name]
        x = gguf_quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(-1, int(t.shape[0]))
        w = weights_for_tensor(imatrix, name, [int(v) for v in t.shape])
        ours = codec.quantize(x, gguf.GGMLQuantizationType.Q4_0, imatrix=None if w is None else w[0])
        got = np.asarray(theirs[name].data).reshape(ours.shape)
        assert theirs[name].tensor_type == gguf.GGMLQuantizationType.Q4_0
        assert np.array_equal(ours, got), name
        if w is not None:  # the imatrix did change the result
            assert not np.array_equal(ours, codec.quantize(x, gguf.GGMLQuantizationType.Q4_0))
