"""``hf2q gguf-patch``: metadata changes land as asked (read back with gguf-py's ``GGUFReader``), the
tensor data section is byte-identical, stock llama.cpp still loads the file and generates the same
text, and a failure never leaves a half-written file."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf2q.gguf_patch as gguf_patch
from hf2q.formats.gguf_keys import Keys

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
_TK = Keys.Tokenizer


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Read:
    """What gguf-py's reader sees in a file: its fields, and the data section's offset and hashes."""

    def __init__(self, path: Path):
        r = gguf.GGUFReader(path)
        self.fields = {k: (f.types, f.contents()) for k, f in r.fields.items()}
        with open(path, "rb") as fh:
            fh.seek(r.data_offset)
            self.section = hashlib.sha256(fh.read()).hexdigest()
        self.offset = r.data_offset
        self.tensors = {t.name: hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()
                        for t in r.tensors}

    def __getitem__(self, key: str):
        return self.fields[key][1] if key in self.fields else None

    def same_data(self, other: Read) -> bool:
        return self.section == other.section and self.tensors == other.tensors and len(self.tensors) > 0


@pytest.fixture(scope="module")
def original(smollm2_gguf) -> Read:
    return Read(Path(smollm2_gguf))


@pytest.fixture
def model(smollm2_gguf, tmp_path) -> Path:
    dst = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf, dst)
    return dst


def test_keys_change_as_asked_and_tensor_bytes_do_not(model, original, tmp_path, cli):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    r = cli("gguf-patch", model, "--chat-template", template, "--add-bos", "true", "--bos-id", "1",
            "--set", f"{Keys.General.NAME}=Patched", "--set", "hf2q.test.ratio:f64=0.25",
            "--set", "hf2q.test.count=7", "--drop", Keys.General.LICENSE)
    assert r.code == 0, r.err
    assert f"{Keys.General.NAME}: " in r.out and "→ 'Patched'" in r.out and "(dropped)" in r.out
    after = Read(model)
    assert after[_TK.CHAT_TEMPLATE] == TEMPLATE
    assert after[_TK.ADD_BOS] is True and after[_TK.BOS_ID] == 1
    assert after[Keys.General.NAME] == "Patched" and after[Keys.General.LICENSE] is None
    assert after.fields["hf2q.test.ratio"] == ([gguf.GGUFValueType.FLOAT64], 0.25)
    assert after.fields["hf2q.test.count"] == ([gguf.GGUFValueType.UINT32], 7)
    assert after.fields[_TK.BOS_ID][0] == [gguf.GGUFValueType.UINT32]
    untouched = {k for k in original.fields if not k.startswith("GGUF.")} - {_TK.CHAT_TEMPLATE, _TK.ADD_BOS, _TK.BOS_ID, Keys.General.NAME,
                                        Keys.General.LICENSE}
    assert {k: after.fields[k] for k in untouched} == {k: original.fields[k] for k in untouched}
    assert after.same_data(original)  # the data section and every tensor, byte for byte
    assert after.offset != original.offset and after.offset % 32 == 0  # the section moved, still aligned
    assert not list(tmp_path.glob("*.tmp"))

    # shrinking the header moves the section back; still the same bytes
    r = cli("gguf-patch", model, "--drop", _TK.CHAT_TEMPLATE, "--drop", "hf2q.test.ratio")
    assert r.code == 0, r.err
    shrunk = Read(model)
    assert shrunk[_TK.CHAT_TEMPLATE] is None and shrunk["hf2q.test.ratio"] is None
    assert shrunk.same_data(original) and shrunk.offset < after.offset


def _complete(model: Path) -> str:
    from tests.tools import llama_cpp

    args = [str(llama_cpp.tool("llama-completion")), "-m", str(model), "-p", "The capital of France is", "-n", "6",
            "-t", "2", "--temp", "0", "-no-cnv"]
    done = subprocess.run(args, env=llama_cpp.env(), capture_output=True, text=True, timeout=300, check=False,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_stock_llama_cpp_loads_the_patched_file(llama_cpp_bin, smollm2_gguf, tmp_path, cli):
    out = tmp_path / "patched.gguf"
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE * 40, encoding="utf-8")  # several KiB more header
    r = cli("gguf-patch", smollm2_gguf, "-o", out, "--chat-template", template, "--set", f"{Keys.General.NAME}=x")
    assert r.code == 0, r.err
    assert f"{_TK.CHAT_TEMPLATE}: " in r.out
    assert _complete(out) == _complete(Path(smollm2_gguf))


def test_dry_run_prints_the_diff_and_writes_nothing(model, cli):
    sha, mtime = _sha(model), model.stat().st_mtime_ns
    r = cli("gguf-patch", model, "--dry-run", "--add-eos", "true", "--set", f"{Keys.General.NAME}=Other")
    assert r.code == 0, r.err
    assert f"{_TK.ADD_EOS}: " in r.out and "→ true" in r.out and "→ 'Other'" in r.out and "nothing written" in r.out
    assert _sha(model) == sha and model.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in model.parent.iterdir()) == ["model.gguf"]
    # a value the file already has is no change: nothing is written
    assert cli("gguf-patch", model, "--set", "hf2q.test.x:u8=3").code == 0
    sha, mtime = _sha(model), model.stat().st_mtime_ns
    r = cli("gguf-patch", model, "--set", "hf2q.test.x=3")
    assert r.code == 0 and "nothing to change" in r.out
    assert _sha(model) == sha and model.stat().st_mtime_ns == mtime


def test_bad_input_is_one_line_exit_3(model, tmp_path, cli):
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model\n" * 4)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model.read_bytes()[:100_000])
    for bad in (text, cut, tmp_path / "missing.gguf"):
        r = cli("gguf-patch", bad, "--set", f"{Keys.General.NAME}=x")
        assert r.code == 3, (bad, r.err)
        assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err
    assert cut.stat().st_size == 100_000


@pytest.mark.parametrize("argv", [
    ("--set", f"{Keys.General.ALIGNMENT}=64"),          # would move every tensor
    ("--set", f"{_TK.LIST}=a"),                          # an array
    ("--set", f"{_TK.ADD_BOS}=maybe"),                   # not a bool
    ("--set", f"{_TK.BOS_ID}=-1"),                       # does not fit u32
    ("--set", f"{Keys.General.NAME}:u32=x"),             # contradicts the file's type
    ("--set", "novalue"),
    ("--drop", "no.such.key"),
    ("--set", f"{Keys.General.NAME}=a", "--drop", Keys.General.NAME),
])
def test_impossible_changes_are_usage_errors(model, cli, argv):
    sha = _sha(model)
    r = cli("gguf-patch", model, *argv)
    assert r.code == 2, (argv, r.err)
    assert len(r.err.strip().splitlines()) == 1
    assert _sha(model) == sha


def test_an_interrupted_write_leaves_the_original_intact(model, tmp_path, cli, monkeypatch):
    sha = _sha(model)
    real_copy = gguf_patch._copy_data

    def dies_midway(src, start, out):
        with open(src, "rb") as fh:
            fh.seek(start)
            out.write(fh.read(5 << 20))
        out.flush()
        assert os.path.getsize(out.name) > 5 << 20  # a half-written temp file exists at this point
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_patch, "_copy_data", dies_midway)
    r = cli("gguf-patch", model, "--set", f"{Keys.General.NAME}=x")
    assert r.code == 130
    assert _sha(model) == sha
    r = cli("gguf-patch", model, "-o", tmp_path / "copy.gguf", "--set", f"{Keys.General.NAME}=x")
    assert r.code == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # no temp, no half copy
    monkeypatch.setattr(gguf_patch, "_copy_data", real_copy)
    assert cli("gguf-patch", model, "--set", f"{Keys.General.NAME}=x").code == 0
    assert gguf.GGUFReader(model).fields[Keys.General.NAME].contents() == "x"


# ---- any scalar of any type round-trips through gguf-py's reader ----------------------------------

_VALUES = {
    "u8": st.integers(0, 255), "i8": st.integers(-128, 127), "u16": st.integers(0, 65535),
    "i16": st.integers(-32768, 32767), "u32": st.integers(0, 2**32 - 1), "i32": st.integers(-2**31, 2**31 - 1),
    "u64": st.integers(0, 2**64 - 1), "i64": st.integers(-2**63, 2**63 - 1),
    "f32": st.floats(width=32, allow_nan=False), "f64": st.floats(allow_nan=False),
    "bool": st.booleans(), "str": st.text(max_size=40),
}


def _small_gguf(path: Path) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("small")
    w.add_uint32("hf2q.test.keep", 5)
    rng = np.random.default_rng(0)
    for i in range(3):
        w.add_tensor(f"t{i}", rng.standard_normal((4, 8 * (i + 1))).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), tname=st.sampled_from(sorted(_VALUES)))
def test_any_scalar_round_trips(tmp_path, cli, data, tname):
    src, out = tmp_path / "small.gguf", tmp_path / "out.gguf"
    if not src.exists():
        _small_gguf(src)
    value = data.draw(_VALUES[tname])
    text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)
    r = cli("gguf-patch", src, "-o", out, "--set", f"hf2q.test.value:{tname}={text}")
    assert r.code == 0, r.err
    types, got = Read(out).fields["hf2q.test.value"]
    assert types == [gguf_patch.TYPE_NAMES[tname]]
    assert got == value  # f32 draws are exact in float32; repr round-trips f64
    patched, before = Read(out), Read(src)
    assert patched["hf2q.test.keep"] == 5
    assert patched.same_data(before)


def test_in_place_through_a_symlink_patches_the_target_and_keeps_its_mode(model, tmp_path, cli):
    model.chmod(0o640)
    link = tmp_path / "link.gguf"
    link.symlink_to(model)
    r = cli("gguf-patch", link, "--set", f"{Keys.General.NAME}=linked")
    assert r.code == 0, r.err
    assert link.is_symlink() and link.resolve() == model.resolve()
    assert (model.stat().st_mode & 0o777) == 0o640
    assert gguf.GGUFReader(model).fields[Keys.General.NAME].contents() == "linked"


_SLOW_PATCH = """
import sys, time
import hf2q.gguf_patch as gp
from hf2q.cli import main

def slow_copy(src, start, out):
    with open(src, "rb") as fh:
        fh.seek(start)
        while chunk := fh.read(1 << 20):
            out.write(chunk)
            out.flush()
            time.sleep(0.05)

gp._copy_data = slow_copy
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_patch_leaves_the_original_intact(model, cli):
    """SIGKILL mid-copy: the original is untouched (only the temp beside it was being written), and
    the next patch overwrites the stale temp."""
    sha = _sha(model)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PATCH, "gguf-patch", str(model), "--set",
                             f"{Keys.General.NAME}=killed"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = model.with_name(model.name + ".tmp")
    deadline = time.monotonic() + 60
    while not (tmp.exists() and tmp.stat().st_size > 4 << 20) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert tmp.exists() and 0 < tmp.stat().st_size < model.stat().st_size  # it died mid-write
    assert _sha(model) == sha
    assert cli("gguf-patch", model, "--set", f"{Keys.General.NAME}=after").code == 0
    assert not tmp.exists()
    assert gguf.GGUFReader(model).fields[Keys.General.NAME].contents() == "after"
