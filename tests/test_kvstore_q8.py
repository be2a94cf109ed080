"""Optional 8-bit payloads: error bounded by half a quantization step, half the bytes, same API."""

from __future__ import annotations

import hashlib

import numpy as np
from safetensors.numpy import load_file

from hf2q.kvstore import BLOCK_TOKENS, BlockStore, KVBlock
from hf2q.kvstore.q8 import SCALE_SUFFIX, dequantize_rows, quantize_rows

FP = hashlib.sha256(b"q8").hexdigest()


def test_row_quantization_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 64, 64)) * rng.uniform(0.01, 20, (3, 64, 1))).astype(np.float16)
    x[1, 5] = 0  # an all-zero row
    q, s = quantize_rows(x)
    assert q.dtype == np.int8 and s.dtype == np.float16 and s.shape == (3, 64, 1)
    y = dequantize_rows(q, s, np.float16)
    step = s.astype(np.float32)
    err = np.abs(y.astype(np.float32) - x.astype(np.float32))
    # half a step, plus float16 rounding of the reconstruction
    assert np.all(err <= step / 2 + np.abs(x.astype(np.float32)) * 2.0 ** -10 + 1e-7)
    assert np.all(y[1, 5] == 0) and np.abs(q).max() == 127
    # the per-row maximum is exact up to the f16 scale
    i = np.argmax(np.abs(x[0, 0].astype(np.float32)))
    assert abs(float(y[0, 0, i]) - float(x[0, 0, i])) <= abs(float(x[0, 0, i])) * 2e-3


def test_q8_store_halves_bytes_and_reads_back_in_engine_dtype(tmp_path):
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 50000, BLOCK_TOKENS).tolist()
    arrays = {f"layers.{i}.{kv}": rng.standard_normal((3, BLOCK_TOKENS, 64)).astype(np.float16)
              for i in range(2) for kv in "kv"}
    sizes = {}
    for kind in ("kv", "kv-q8"):
        root = tmp_path / kind
        with BlockStore.open(root, FP, payload_kind=kind) as store:
            (span,) = store.spans(toks)
            meta = store.write(KVBlock.from_span(span, toks, arrays))
            sizes[kind] = meta.file_bytes
            out = store.read(store.longest_prefix(toks)[0])
            assert out.keys() == arrays.keys() and all(out[k].dtype == np.float16 for k in out)
            err = max(float(np.max(np.abs(out[k].astype(np.float32) - arrays[k].astype(np.float32))))
                      for k in out)
            assert (err == 0) if kind == "kv" else (0 < err < 0.03)
        raw = load_file(str(meta.path))  # still a plain safetensors file
        if kind == "kv-q8":
            assert raw["layers.0.k"].dtype == np.int8 and raw["layers.0.k" + SCALE_SUFFIX].shape == (3, BLOCK_TOKENS, 1)
    assert 0.5 < sizes["kv-q8"] / sizes["kv"] < 0.53
    # a q8 server reads exact blocks and vice versa
    with BlockStore.open(tmp_path / "kv-q8", FP) as store:
        assert store.read(store.longest_prefix(toks)[0])["layers.1.v"].dtype == np.float16


def test_f16_payload_halves_float32_blocks_rounding_to_nearest(tmp_path):
    """``kv-f16``: the CPU engine's float32 KV stored as float16 (read back as float32, rounded);
    what does not fit float16's range, or is already exact, stays bit for bit."""
    rng = np.random.default_rng(2)
    toks = rng.integers(0, 50000, BLOCK_TOKENS).tolist()
    arrays = {f"layers.{i}.{kv}": (rng.standard_normal((3, BLOCK_TOKENS, 64)) * 4).astype(np.float32)
              for i in range(2) for kv in "kv"}
    arrays["layers.0.v"][0, 0, 0] = 1e6  # beyond float16: this tensor is kept as float32
    arrays["exact"] = rng.standard_normal((2, 8)).astype(np.float16).astype(np.float32)
    sizes = {}
    for kind in ("kv", "kv-f16"):
        with BlockStore.open(tmp_path / kind, FP, payload_kind=kind) as store:
            (span,) = store.spans(toks)
            meta = store.write(KVBlock.from_span(span, toks, arrays))
            sizes[kind] = meta.file_bytes
            out = store.read(store.longest_prefix(toks)[0])
        assert all(out[k].dtype == np.float32 for k in arrays)
        for name, arr in arrays.items():
            lossless = kind == "kv" or name in ("layers.0.v", "exact")
            want = arr if lossless else arr.astype(np.float16).astype(np.float32)
            assert np.array_equal(out[name], want), (kind, name)
        raw = load_file(str(meta.path))
        assert raw["layers.1.k"].dtype == (np.float16 if kind == "kv-f16" else np.float32)
        assert raw["layers.0.v"].dtype == np.float32 and raw["exact"].dtype == np.float16
    assert 0.6 < sizes["kv-f16"] / sizes["kv"] < 0.63  # 3 of the 4 big tensors halved
