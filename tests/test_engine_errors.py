"""Bad input never produces a traceback: one ``hf2q: error:`` line and exit 3."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from hf2q.errors import InputError
from hf2q.formats.gguf_file import open_gguf


def _write(path, arch="llama", tensors=None, tokenizer=True, extra=None):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(64)])
        w.add_token_merges([])
        w.add_eos_token_id(1)
    for k, v in (extra or {}).items():
        w.add_string(k, v)
    rng = np.random.default_rng(0)
    for name, shape, raw_dtype in tensors or [("token_embd.weight", (64, 32), None)]:
        if raw_dtype is None:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
        else:
            w.add_tensor(name, np.zeros(shape, np.uint8), raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_one_line(res):
    assert res.code == 3, res
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hf2q: error:"), res.err
    assert "Traceback" not in res.err


def test_truncated_gguf(smollm2_gguf, tmp_path, cli):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(5_000_000))
    with pytest.raises(InputError, match="truncated|corrupt"):
        open_gguf(bad)
    _assert_one_line(cli("generate", "--model", bad, "--prompt", "hi"))
    _assert_one_line(cli("info", bad))


def test_not_a_gguf_and_corrupt_header(tmp_path, cli):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    _assert_one_line(cli("generate", "--model", junk, "--prompt", "hi"))
    garbled = tmp_path / "garbled.gguf"
    garbled.write_bytes(b"GGUF" + np.array([3, 10**12, 10**12], np.uint64).tobytes()[:-4] + b"\xff" * 64)
    _assert_one_line(cli("info", garbled))
    _assert_one_line(cli("generate", "--model", tmp_path / "missing.gguf", "--prompt", "hi"))


def test_unsupported_architecture(tmp_path, cli):
    path = _write(tmp_path / "rwkv.gguf", arch="rwkv6")
    res = cli("generate", "--model", path, "--prompt", "hi")
    _assert_one_line(res)
    assert "unsupported architecture" in res.err
    res = cli("info", path)
    assert res.code == 3 and "Serve support: rejected — unsupported architecture 'rwkv6'" in res.out


def test_unsupported_tensor_type(tmp_path, cli):
    # IQ4_NL: 18-byte blocks of 32 → a [64, 32] tensor is 64 rows × 18 bytes
    path = _write(tmp_path / "iq.gguf", tensors=[("token_embd.weight", (64, 18), T.IQ4_NL)])
    res = cli("info", path)
    assert res.code == 3 and "unsupported tensor type(s) IQ4_NL" in res.out.splitlines()[-1]
    _assert_one_line(cli("generate", "--model", path, "--prompt", "hi"))


def test_missing_tokenizer_metadata(smollm2_gguf, tmp_path, cli):
    path = _write(tmp_path / "notok.gguf", tokenizer=False)
    res = cli("info", path)
    assert res.code == 3 and "no tokenizer metadata" in res.out.splitlines()[-1]
    res = cli("generate", "--model", path, "--prompt", "hi", "--raw")
    _assert_one_line(res)
    assert "tokenizer" in res.err


def test_prompt_longer_than_context(smollm2_gguf, cli):
    res = cli("generate", "--model", smollm2_gguf, "--prompt", "word " * 200, "--ctx", "64", "--raw")
    _assert_one_line(res)
    assert "context" in res.err


def test_shutil_copy_of_real_file_is_fine(smollm2_gguf, tmp_path):
    copy = tmp_path / "ok.gguf"
    shutil.copy(smollm2_gguf, copy)
    g = open_gguf(copy)
    assert g.arch == "llama" and len(g.tensors) == 272
