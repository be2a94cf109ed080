"""Building the C kernels (``hf2q.kernels.cpu_build``): once per process and sources, and loudly when it fails.

A broken compiler here is a shell script standing in for ``cc``: it prints a message of its own
and exits 1, so the tests can tell the compiler's words from ours. A counting wrapper around the
real compiler tells how many compiles ran.
"""

from __future__ import annotations

import logging
import shutil
import stat
import threading
from pathlib import Path

import hf2q.engine  # noqa: F401 (the BLAS before MLX, as serving has it)
import mlx.core as mx
import numpy as np
import pytest

from hf2q import doctor
from hf2q.kernels import (cpu_attention, cpu_build, cpu_decode_ops, cpu_pool, cpu_qmatvec, cuda_gated_delta,
                          cuda_q8_attention, cuda_qmv)

BROKEN_MESSAGE = "fakecc: error: this toolchain is broken on purpose"


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache and a process that has not loaded cpu_qmatvec yet (restored after);
    the other libraries loaded first, as a server would have them (every kernel module imported, so each
    library is registered)."""
    import importlib

    for name in doctor.KERNEL_MODULES:
        importlib.import_module(f"hf2q.kernels.{name}")
    for other in cpu_build.LIBRARIES.values():
        other.load()
    monkeypatch.setenv("HF2Q_CACHE", str(tmp_path / "cache"))
    lib = cpu_qmatvec.LIBRARY
    saved = (lib._done, lib._lib, lib.failure, lib.off_reason)
    lib.reset()
    yield lib
    lib._done, lib._lib, lib.failure, lib.off_reason = saved


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and r.name == cpu_build.__name__]


def test_a_broken_compiler_warns_once_falls_back_and_doctor_shows_it(fresh, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(_script(tmp_path / "fakecc", f'echo "{BROKEN_MESSAGE}" >&2\necho "a second line" >&2\nexit 1\n')))
    caplog.set_level(logging.WARNING, logger=cpu_build.__name__)

    assert cpu_qmatvec.kernel() is None
    assert cpu_qmatvec.kernel() is None  # asked again: no second build, no second warning
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert "cpu_qmatvec" in warnings[0].getMessage() and BROKEN_MESSAGE in warnings[0].getMessage()
    assert BROKEN_MESSAGE in fresh.failure and "a second line" in fresh.failure
    err = next((tmp_path / "cache" / "kernels").glob("cpu_qmatvec-*.err"))
    assert BROKEN_MESSAGE in err.read_text() and str(err) in warnings[0].getMessage()

    # the fallback: a quantized layer keeps MLX's matmul, and its result is still the right one
    from gguf import GGMLQuantizationType, quants

    from hf2q.engine.layers import Linear
    from hf2q.formats.gguf_file import GGUFTensor

    rng = np.random.default_rng(7)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0)
    layer = Linear(GGUFTensor(name="w", qtype=GGMLQuantizationType.Q8_0, shape=(48, 64), data=raw, nbytes=raw.nbytes),
                   mx.float32)
    assert layer._host is None
    x = rng.standard_normal((1, 1, 64)).astype(np.float32)
    want = x[0].astype(np.float64) @ quants.dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float64).T
    np.testing.assert_allclose(np.array(layer(mx.array(x)))[0], want, rtol=1e-4, atol=1e-4)

    check = doctor.check_kernel_builds()
    assert check.status == "warn"
    assert "cpu_qmatvec FAILED" in check.detail and BROKEN_MESSAGE in check.detail
    states = check.data["kernels"]
    assert states["cpu_qmatvec"]["status"] == "failed" and BROKEN_MESSAGE in states["cpu_qmatvec"]["detail"]
    assert len(_warnings(caplog)) == 1  # doctor reads the recorded failure, it does not warn again


def test_no_compiler_at_all_is_a_failure_too(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    caplog.set_level(logging.WARNING, logger=cpu_build.__name__)
    assert cpu_qmatvec.kernel() is None
    assert fresh.status() == ("failed", fresh.failure)
    assert "no C compiler" in fresh.failure and len(_warnings(caplog)) == 1


def test_threads_asking_at_once_share_one_build(fresh, monkeypatch, tmp_path):
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no C compiler")
    calls = tmp_path / "calls"
    monkeypatch.setenv("CC", str(_script(tmp_path / "countingcc", f'echo x >> "{calls}"\nexec "{real}" "$@"\n')))
    start = threading.Barrier(8)
    got = []

    def ask():
        start.wait()
        got.append(cpu_qmatvec.kernel())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and got[0] is not None and all(lib is got[0] for lib in got)
    assert calls.read_text().count("x") == 1
    assert fresh.status() == ("ok", "")


def test_the_cache_is_keyed_by_the_sources_and_flags(monkeypatch, tmp_path):
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("HF2Q_CACHE", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    monkeypatch.setenv("CC", str(_script(tmp_path / "countingcc", f'echo x >> "{calls}"\nexec "{real}" "$@"\n')))
    src = tmp_path / "src"
    src.mkdir()
    (src / "answer.h").write_text("#define ANSWER 41\n")
    (src / "probe.c").write_text('#include "answer.h"\nint answer(void) { return ANSWER; }\n')

    def answer():
        import ctypes

        return ctypes.CDLL(str(cpu_build.compile_library("probe", src / "probe.c"))).answer()

    first = cpu_build.compile_library("probe", src / "probe.c")
    assert cpu_build.compile_library("probe", src / "probe.c") == first  # same sources: the cached build
    assert answer() == 41 and calls.read_text().count("x") == 1
    (src / "answer.h").write_text("#define ANSWER 42\n")  # a header changes: a new build
    assert cpu_build.compile_library("probe", src / "probe.c") != first and answer() == 42
    monkeypatch.setattr(cpu_build, "compile_flags", lambda: ["-O1", "-fPIC", "-shared"])  # other flags: another
    assert cpu_build.compile_library("probe", src / "probe.c") != first
    assert calls.read_text().count("x") == 3


def test_every_kernel_source_is_a_file_shipped_with_the_package():
    import tomllib

    data = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["hf2q.kernels"]
    shipped = {p for pattern in patterns for p in cpu_build.CSRC.parent.glob(pattern)}
    sources = [lib.source for lib in cpu_build.LIBRARIES.values()] + [
        k.KERNEL.path for k in (cuda_qmv, cuda_gated_delta, cuda_q8_attention)]
    assert {Path(s).name for s in sources} >= {"cpu_pool.c", "cpu_qmatvec.c", "cpu_decode_ops.c", "cpu_attention.c",
                                                "cuda_qmv.cu", "cuda_gated_delta.cu", "cuda_q8_attention.cu"}
    for s in sources:
        assert s.is_file() and s in shipped, s
    for header in cpu_build.CSRC.glob("*.h"):
        assert header in shipped, header


def test_doctor_reports_every_kernel_build(monkeypatch):
    """With a working compiler every host kernel builds; the CUDA one applies only on a CUDA device."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    monkeypatch.delenv("HF2Q_NO_CPU_KERNELS", raising=False)
    check = doctor.check_kernel_builds()
    states = check.data["kernels"]
    assert set(states) == set(doctor.KERNEL_MODULES) == {*cpu_build.LIBRARIES, "cuda_qmv"}
    for name in ("cpu_pool", "cpu_qmatvec", "cpu_decode_ops", "cpu_attention"):
        assert states[name] == {"status": "ok", "detail": ""}, name
    on_cuda = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    assert states["cuda_qmv"]["status"] == ("ok" if on_cuda else "not applicable")
    assert check.status == "ok" and "built: cpu_pool, cpu_qmatvec, cpu_decode_ops, cpu_attention" in check.detail
