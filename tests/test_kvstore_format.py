"""Block keys and the on-disk block envelope, checked against independent readers.

The file must load with the ``safetensors`` library (its own parser) and its checksum must
match ``hashlib`` over the raw body; block keys must chain exactly as documented.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file

from hf2q.kvstore import BLOCK_TOKENS, block_hashes, model_fingerprint
from hf2q.kvstore.blockfile import (BlockFileError, encode_block_bytes, parse_header, read_block, read_meta,
                                    verify_file)
from hf2q.kvstore.fingerprint import ROOT_PARENT, chain_hash, gguf_content_hash

FP = hashlib.sha256(b"model").hexdigest()


def _arrays(rng, layers=2):
    out = {}
    for i in range(layers):
        out[f"layers.{i}.k"] = rng.standard_normal((3, BLOCK_TOKENS, 8)).astype(np.float16)
        out[f"layers.{i}.v"] = rng.standard_normal((3, BLOCK_TOKENS, 8)).astype(np.float32)
    return out


def _write(path, rng, **over):
    toks = rng.integers(0, 49152, BLOCK_TOKENS).tolist()
    kw = dict(block_hash=chain_hash(ROOT_PARENT, FP, toks), parent_hash=ROOT_PARENT, fingerprint=FP,
              token_ids=toks, arrays=_arrays(rng))
    kw.update(over)
    path.write_bytes(encode_block_bytes(**kw))
    return kw


def test_block_file_loads_with_safetensors_and_checksum_matches_hashlib(tmp_path):
    rng = np.random.default_rng(0)
    p = tmp_path / "b.safetensors"
    kw = _write(p, rng)
    loaded = load_file(str(p))  # the safetensors library's own parser
    assert set(loaded) == set(kw["arrays"])
    for name, arr in kw["arrays"].items():
        assert loaded[name].dtype == arr.dtype and np.array_equal(loaded[name], arr)
    raw = p.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    assert (8 + hlen) % 8 == 0
    header = json.loads(raw[8:8 + hlen])
    md = header["__metadata__"]
    assert md["body_sha256"] == hashlib.sha256(raw[8 + hlen:]).hexdigest()
    assert json.loads(md["token_ids"]) == [int(t) for t in kw["token_ids"]]
    assert md["token_count"] == str(BLOCK_TOKENS) and md["fingerprint"] == FP and md["format_version"] == "1"
    assert json.loads(md["tensors"])["layers.0.k"] == ["F16", [3, BLOCK_TOKENS, 8]]
    meta, arrays = read_block(p)
    assert meta.token_ids == tuple(int(t) for t in kw["token_ids"])
    assert all(np.array_equal(arrays[k], v) for k, v in kw["arrays"].items())


@pytest.mark.parametrize("damage, reason", [
    ("flip_body", "bad-checksum"),
    ("truncate_body", "truncated"),
    ("truncate_header", "truncated"),
    ("version", "wrong-version"),
    ("garbage", "bad-header"),
    ("empty", "truncated"),
    ("append", "bad-header"),
    ("forged_tokens", "bad-chain"),
])
def test_damaged_files_are_rejected_with_a_reason(tmp_path, damage, reason):
    p = tmp_path / "b.safetensors"
    _write(p, np.random.default_rng(1))
    raw = bytearray(p.read_bytes())
    (hlen,) = struct.unpack("<Q", raw[:8])
    if damage == "flip_body":
        raw[8 + hlen + 100] ^= 0x40
    elif damage == "truncate_body":
        raw = raw[:-7]
    elif damage == "truncate_header":
        raw = raw[:8 + hlen // 2]
    elif damage == "version":
        raw = bytearray(bytes(raw).replace(b'"format_version":"1"', b'"format_version":"9"'))
    elif damage == "garbage":
        raw[8:20] = b"\xff" * 12
    elif damage == "empty":
        raw = bytearray()
    elif damage == "append":
        raw += b"\0" * 8
    elif damage == "forged_tokens":  # header edited, body (and its checksum) intact: the key no longer chains
        first = raw[8:8 + hlen].index(b'"token_ids":"[') + len(b'"token_ids":"[')
        raw[8 + first] = ord("9") if raw[8 + first] != ord("9") else ord("8")
    p.write_bytes(bytes(raw))
    with pytest.raises(BlockFileError) as ei:
        verify_file(p)
    assert ei.value.reason == reason


def test_header_only_read_catches_truncation_but_not_bit_flips(tmp_path):
    p = tmp_path / "b.safetensors"
    _write(p, np.random.default_rng(2))
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 1
    p.write_bytes(bytes(raw))
    read_meta(p)  # sizes still consistent
    with pytest.raises(BlockFileError, match="bad-checksum"):
        verify_file(p)
    p.write_bytes(bytes(raw[:-1]))
    with pytest.raises(BlockFileError, match="truncated"):
        read_meta(p)


def test_parse_header_rejects_non_contiguous_offsets(tmp_path):
    p = tmp_path / "b.safetensors"
    _write(p, np.random.default_rng(3))
    raw = p.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    first = sorted(k for k in header if k != "__metadata__")[0]
    b, e = header[first]["data_offsets"]
    header[first]["data_offsets"] = [b + 2, e + 2]
    hb = json.dumps(header).encode()
    with pytest.raises(BlockFileError, match="bad-header"):
        parse_header(struct.pack("<Q", len(hb)) + hb, 8 + len(hb) + len(raw) - 8 - hlen, p)


def test_block_hashes_chain_parent_fingerprint_and_tokens():
    toks = list(range(3 * BLOCK_TOKENS + 17))
    hs = block_hashes(FP, toks)
    assert len(hs) == 3  # the trailing partial block has no key
    parent = ROOT_PARENT
    for i, h in enumerate(hs):  # recompute from the documented definition
        ref = hashlib.sha256(parent.encode() + b"\0" + FP.encode() + b"\0"
                             + np.asarray(toks[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS], "<u4").tobytes())
        assert h == ref.hexdigest()
        parent = h
    # a change in block 1 changes blocks 1 and 2 but not block 0; another model shares nothing
    toks2 = list(toks)
    toks2[BLOCK_TOKENS + 5] += 1
    hs2 = block_hashes(FP, toks2)
    assert hs2[0] == hs[0] and hs2[1] != hs[1] and hs2[2] != hs[2]
    assert not set(block_hashes("other", toks)) & set(hs)
    assert block_hashes(FP, toks[:BLOCK_TOKENS - 1]) == []
    assert chain_hash(ROOT_PARENT, FP, toks[:BLOCK_TOKENS]) == hs[0]


def test_model_fingerprint_covers_content_quant_template_version(tmp_path, monkeypatch):
    monkeypatch.setenv("HF2Q_CACHE", str(tmp_path / "cache"))
    g = tmp_path / "m.gguf"
    g.write_bytes(os.urandom(1 << 16))
    base = model_fingerprint(g, "q4_1", "{{x}}", 1)
    assert gguf_content_hash(g) == hashlib.sha256(g.read_bytes()).hexdigest()
    assert (tmp_path / "cache" / "kv-fingerprints.json").exists()  # memoised
    assert model_fingerprint(g, "q4_1", "{{x}}", 1) == base
    assert model_fingerprint(g, "q8_0", "{{x}}", 1) != base
    assert model_fingerprint(g, "q4_1", "{{y}}", 1) != base
    assert model_fingerprint(g, "q4_1", "{{x}}", 2) != base
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(g.read_bytes())
    assert model_fingerprint(copy, "q4_1", "{{x}}", 1) == base  # content, not path
    data = bytearray(g.read_bytes())
    data[5] ^= 1
    g.write_bytes(bytes(data))
    os.utime(g, ns=(1, 1))  # new mtime → memo entry is stale, content re-hashed
    assert model_fingerprint(g, "q4_1", "{{x}}", 1) != base


def test_fingerprint_of_a_missing_model_is_an_input_error(tmp_path):
    from hf2q.errors import InputError

    with pytest.raises(InputError, match="cannot fingerprint"):
        model_fingerprint(tmp_path / "nope.gguf", None, None, 1)
