"""Crafted HF directories (``tests/tools/crafted_hf.py``) through the real ``hf2q convert`` command line.

A broken checkpoint — config against tensors, safetensors headers, the shard index, the
tokenizer, a quant name for the other format — must exit with its documented code and one
``hf2q: error:`` line naming the problem, before any output exists: no GGUF, no ``.tmp``, no
report. The controls must convert, and gguf-py (llama.cpp's own reader) must read back the
tensors the checkpoint holds. Hypothesis then mutates config values and header fields of the
valid checkpoint: every outcome is a success or a one-line exit 3, never an internal error.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from tests.tools import crafted_hf

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, crafted_hf.CraftedCheckpoint]:
    return {c.name: c for c in crafted_hf.build_cases(tmp_path_factory.mktemp("crafted"))}


def _argv(case: crafted_hf.CraftedCheckpoint, out: Path) -> list[str]:
    return ["convert", str(case.path), *(a.replace(crafted_hf.OUT, str(out)) for a in case.convert_args)]


def _leftovers(out_dir: Path) -> list[str]:
    return sorted(p.name for p in out_dir.iterdir())


def test_the_contract(cases):
    """What the reliability bench relies on: ≥ 25 distinct cases, valid controls among them, every case an
    HF directory whose arguments name the output through the placeholder."""
    assert len(cases) >= 25 and len({c.path for c in cases.values()}) == len(cases)
    assert sum(c.convert_exit == 0 for c in cases.values()) >= 1
    for c in cases.values():
        assert (c.path / "config.json").is_file() and crafted_hf.OUT in c.convert_args
        assert c.convert_exit in (0, 2, 3) and bool(c.needle) == (c.convert_exit != 0)


def test_build_is_deterministic(tmp_path):
    a = crafted_hf.build_cases(tmp_path / "a")
    b = crafted_hf.build_cases(tmp_path / "b")
    for x, y in zip(a, b):
        files = sorted(p.relative_to(x.path) for p in x.path.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(y.path) for p in y.path.rglob("*") if p.is_file())
        assert all((x.path / f).read_bytes() == (y.path / f).read_bytes() for f in files), x.name


@pytest.mark.parametrize("name", [n for n, (_, _, code, _) in crafted_hf._CASES.items() if code != 0])
def test_bad_input_is_one_line_and_leaves_nothing(cli, cases, tmp_path, name):
    case = cases[name]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = cli(*_argv(case, out_dir / "model.gguf"))
    assert res.code == case.convert_exit, (res.code, res.err)
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hf2q: error: "), res.err
    assert "Traceback" not in res.err and "internal error" not in res.err
    assert case.needle in lines[0], lines[0]
    assert _leftovers(out_dir) == []


@pytest.mark.parametrize("name", [n for n, (_, _, code, _) in crafted_hf._CASES.items() if code == 0])
def test_controls_convert_and_read_back(cli, cases, tmp_path, name):
    case = cases[name]
    out = tmp_path / "model.gguf"
    res = cli(*_argv(case, out))
    assert res.code == 0, res.err
    # the checkpoint as the safetensors library reads it, the GGUF as gguf-py (llama.cpp's reader) does
    hf: dict[str, np.ndarray] = {}
    for f in sorted(case.path.glob("*.safetensors")):
        hf.update(load_file(f))
    reader = gguf.GGUFReader(out)
    got = {t.name: t for t in reader.tensors}
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE]
    assert bytes(arch.parts[arch.data[0]]).decode() == json.loads((case.path / "config.json").read_text())[
        "architectures"][0].removesuffix("ForCausalLM").lower()
    assert tuple(reversed(got["token_embd.weight"].shape.tolist())) == hf["model.embed_tokens.weight"].shape
    assert tuple(reversed(got["blk.1.attn_k.weight"].shape.tolist())) == \
        hf["model.layers.1.self_attn.k_proj.weight"].shape
    np.testing.assert_array_equal(np.asarray(got["output_norm.weight"].data), hf["model.norm.weight"])  # F32 as is
    assert {f"blk.{b}.attn_norm.weight" for b in range(crafted_hf.LAYERS)} <= set(got)


_TIMED_MAIN = """
import resource, sys, time
from hf2q.cli import main
import hf2q.convert.pipeline  # imported before the clock starts: the check is timed, not the imports
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
code = main(sys.argv[1:])
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0)
sys.exit(code)
"""


def test_billion_layers_fails_fast_with_bounded_memory(cases, tmp_path):
    """The real entry point under a 2 GiB address-space limit: one line, exit 3, in well under a second
    and without growing (it used to build a name table for 10⁹ layers: 4 GiB in 47 s)."""
    case = cases["num_hidden_layers_1e9"]
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    r = subprocess.run([sys.executable, "-c", _TIMED_MAIN, *_argv(case, out_dir / "model.gguf")], capture_output=True,
                       text=True, cwd=ROOT, timeout=120, check=False, preexec_fn=limit,
                       env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("hf2q: error: ") and "num_hidden_layers" in r.stderr
    seconds, grown_kib = r.stdout.split()
    assert float(seconds) < 5, seconds  # the bug took 47 s; a loaded CI box can take a second
    assert int(grown_kib) < 64 << 10, grown_kib  # under 64 MiB of peak RSS growth
    assert _leftovers(out_dir) == []


def test_tokenizer_larger_than_the_embedding(cli, tmp_path):
    """Without vocab_size in the config only the token list tells: a token beyond the embedding's rows is
    refused (the tokenizer is read, so its pre-tokenizer warning may come first)."""
    t = crafted_hf.qwen3_tensors()
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:200]
    cfg = {k: v for k, v in crafted_hf.qwen3_config().items() if k != "vocab_size"}
    src = crafted_hf.write_checkpoint(tmp_path / "m", cfg=cfg, tensors=t)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = cli("convert", src, "-q", "q8_0", "-o", out_dir / "m.gguf")
    assert res.code == 3
    errors = [ln for ln in res.err.splitlines() if ln.startswith("hf2q: error: ")]
    assert errors == [res.err.splitlines()[-1]] and f"{crafted_hf.VOCAB} tokens" in errors[0] and "200 rows" in errors[0]
    assert "Traceback" not in res.err and _leftovers(out_dir) == []


def test_generate_without_a_prompt_is_a_usage_error(cli, tmp_path):
    for argv in (("generate",), ("generate", "--model", str(tmp_path / "m.gguf"))):
        res = cli(*argv)
        assert res.code == 2, (argv, res.code, res.err)
        assert res.err.strip().count("\n") == 0 and "--prompt" in res.err


# --------------------------------------------------------------------------- fuzzing
_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "vocab_size", "head_dim", "rope_theta", "rms_norm_eps", "max_position_embeddings", "rope_scaling")
_VALUES = st.one_of(st.integers(-2**40, 2**40), st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32, 48, 259, 10**9]),
                    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                    st.text(max_size=5), st.lists(st.integers(), max_size=2),
                    st.dictionaries(st.sampled_from(["rope_type", "factor", "rope_theta", "original_max_position_embeddings",
                                                     "low_freq_factor", "high_freq_factor"]),
                                    st.one_of(st.integers(-5, 5), st.sampled_from(["yarn", "linear", "llama3"]),
                                              st.floats(0, 8)), max_size=4))


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory) -> Path:
    return crafted_hf.write_checkpoint(tmp_path_factory.mktemp("fuzz") / "base")


def _fuzz_dir(base: Path, tmp: Path) -> Path:
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    return tmp


def _assert_clean(res, out_dir: Path) -> None:
    assert res.code in (0, 3), (res.code, res.err)
    if res.code:
        lines = [ln for ln in res.err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("hf2q: error: "), res.err
        assert "internal error" not in res.err
        assert _leftovers(out_dir) == []


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(changes=st.dictionaries(st.sampled_from(_KEYS), _VALUES, min_size=1, max_size=3))
def test_fuzzed_config_values(cli, fuzz_base, tmp_path_factory, changes):
    d = _fuzz_dir(fuzz_base, tmp_path_factory.mktemp("cfg") / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    out_dir = d.parent / "out"
    out_dir.mkdir()
    _assert_clean(cli("convert", d, "--dry-run", "-q", "q8_0", "-o", out_dir / "m.gguf"), out_dir)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(tensor=st.sampled_from(sorted(crafted_hf.llama_tensors())),
       field=st.sampled_from(["dtype", "shape", "data_offsets"]),
       value=st.one_of(_VALUES, st.lists(st.integers(-4, 300000), min_size=1, max_size=3),
                       st.sampled_from(["F32", "F16", "BF16", "I8", "F8_E4M3", "U64"])))
def test_fuzzed_safetensors_header(cli, fuzz_base, tmp_path_factory, tensor, field, value):
    d = _fuzz_dir(fuzz_base, tmp_path_factory.mktemp("st") / "m")
    tensors = crafted_hf.llama_tensors()
    header = crafted_hf.safetensors_header(tensors)
    header[tensor][field] = value
    crafted_hf.write_safetensors(d / "model.safetensors", tensors, header)
    out_dir = d.parent / "out"
    out_dir.mkdir()
    _assert_clean(cli("convert", d, "-q", "q8_0", "-o", out_dir / "m.gguf"), out_dir)


def test_valid_header_edit_still_converts(cli, fuzz_base, tmp_path):
    """The fuzz harness itself: an unedited header written by ``write_safetensors`` converts (exit 0)."""
    d = _fuzz_dir(fuzz_base, tmp_path / "m")
    tensors = crafted_hf.llama_tensors()
    crafted_hf.write_safetensors(d / "model.safetensors", tensors, crafted_hf.safetensors_header(tensors))
    out = tmp_path / "m.gguf"
    assert cli("convert", d, "-q", "f32", "-o", out).code == 0
    reader = gguf.GGUFReader(out)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    np.testing.assert_array_equal(np.asarray(embd.data).reshape(tensors["model.embed_tokens.weight"].shape),
                                  tensors["model.embed_tokens.weight"])
