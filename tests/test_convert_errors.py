"""Bad input never yields a traceback or a partial output: one ``hf2q: error:`` line + the documented code.

Each case builds a broken copy of the tiny Llama checkpoint in ``tmp_path`` and checks the
exit code (3 input, 1 runtime), that stderr is exactly one line, and that neither ``OUT``
nor ``OUT.tmp`` exists afterwards.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def llama_copy(tiny_checkpoint, tmp_path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), dst)
    return dst


def _assert_failed(res, code: int, out: Path, *needles: str) -> None:
    assert res.code == code, (res.code, res.err)
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hf2q: error: "), res.err
    assert "Traceback" not in res.err
    for n in needles:
        assert n in lines[0], lines[0]
    assert not out.exists()
    assert not out.with_name(out.name + ".tmp").exists()


def test_missing_config(cli, llama_copy, tmp_path):
    (llama_copy / "config.json").unlink()
    out = tmp_path / "o.gguf"
    _assert_failed(cli("convert", llama_copy, "-q", "q8_0", "-o", out), 3, out, "config.json")


def test_invalid_config_json(cli, llama_copy, tmp_path):
    (llama_copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    out = tmp_path / "o.gguf"
    _assert_failed(cli("convert", llama_copy, "-q", "q8_0", "-o", out), 3, out, "invalid JSON")


def test_unknown_architecture_lists_supported(cli, llama_copy, tmp_path):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o.gguf"
    res = cli("convert", llama_copy, "-q", "q8_0", "-o", out)
    _assert_failed(res, 3, out, "FancyNewForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM", "BertModel")


def test_truncated_safetensors(cli, llama_copy, tmp_path):
    st = llama_copy / "model.safetensors"
    size = st.stat().st_size
    with open(st, "r+b") as f:
        f.truncate(size - 1000)
    out = tmp_path / "o.gguf"
    _assert_failed(cli("convert", llama_copy, "-q", "q8_0", "-o", out), 3, out, "truncated")


def test_dtype_mismatched_safetensors(cli, llama_copy, tmp_path):
    """The header claims F16 for a tensor whose byte range holds F32 data."""
    st = llama_copy / "model.safetensors"
    raw = st.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[name]["dtype"] = "F16"
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new)) if len(new) <= n else b""
    assert len(new) == n
    st.write_bytes(raw[:8] + new + raw[8 + n:])
    out = tmp_path / "o.gguf"
    _assert_failed(cli("convert", llama_copy, "-q", "q8_0", "-o", out), 3, out, name, "mismatch")


def test_unknown_quant_suggests(cli, llama_copy, tmp_path):
    out = tmp_path / "o.gguf"
    _assert_failed(cli("convert", llama_copy, "-q", "q4_km", "-o", out), 3, out, "did you mean", "q4_k_m")


def test_unwritable_output(cli, llama_copy, tmp_path):
    out = tmp_path / "no-such-dir" / "o.gguf"
    _assert_failed(cli("convert", llama_copy, "-q", "q8_0", "-o", out), 1, out, "does not exist")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only directories")
def test_read_only_output_dir(cli, llama_copy, tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    out = d / "o.gguf"
    try:
        _assert_failed(cli("convert", llama_copy, "-q", "q8_0", "-o", out), 1, out, "not writable")
    finally:
        d.chmod(0o700)


def test_disk_full_leaves_nothing(cli, llama_copy, tmp_path, monkeypatch):
    """ENOSPC in the middle of the tensor data: exit 1, temp file removed, no output."""
    from hf2q.convert import gguf_writer

    real_write = gguf_writer.GGUFStream.write
    calls = {"n": 0}

    def full_after_a_few(self, data):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(gguf_writer.GGUFStream, "write", full_after_a_few)
    out = tmp_path / "o.gguf"
    _assert_failed(cli("convert", llama_copy, "-q", "q8_0", "-o", out), 1, out, "disk full")
    assert calls["n"] > 3
    assert list(tmp_path.glob("*.tmp")) == []


def test_missing_src_is_usage_error(cli, tmp_path):
    res = cli("convert", "-q", "q8_0")
    assert res.code == 2 and res.err.startswith("hf2q: error:")


def test_bad_input_through_a_subprocess(tmp_path):
    """The installed entry point behaves the same: one line, exit 3, no traceback."""
    out = tmp_path / "o.gguf"
    r = subprocess.run([sys.executable, "-m", "hf2q", "convert", str(tmp_path / "nope"), "-q", "q8_0",
                        "-o", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert r.returncode == 3
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("hf2q: error:"), r.stderr
    assert not out.exists()
