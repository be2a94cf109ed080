"""``hf2q doctor``: every reported fact matches what the test finds out on its own."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import shutil

import pytest

from hf2q import doctor


def _checks(out: str) -> dict:
    data = json.loads(out)
    return data, {c["name"]: c for c in data["checks"]}


def test_json_report_matches_the_environment(cli, monkeypatch, tmp_path):
    import mlx.core as mx

    cache = tmp_path / "cache"
    (cache / "pypi-models" / "some-model").mkdir(parents=True)
    (cache / "pypi-models" / "some-model" / "w.gguf").write_bytes(b"x" * 1000)
    (cache / "repos" / "org__name").mkdir(parents=True)
    (cache / "repos" / "org__name" / "model.safetensors").write_bytes(b"y" * 24)
    (cache / "repos" / "org__name.tmp-123").mkdir()  # an interrupted download is not listed
    monkeypatch.setenv("HF2Q_CACHE", str(cache))

    r = cli("doctor", "--json")
    assert r.code == 0, r.out
    data, c = _checks(r.out)
    assert data["ok"] is True
    assert c["python"]["data"]["version"] == platform.python_version() and c["python"]["core"]
    assert c["mlx"]["status"] == "ok"
    assert c["mlx"]["data"]["version"] == mx.__version__
    assert c["mlx"]["data"]["device"] == str(mx.default_device())
    assert c["core libraries"]["data"]["versions"]["gguf"] == importlib.metadata.version("gguf")
    free = shutil.disk_usage(tmp_path).free
    assert abs(c["disk"]["data"]["free_bytes"] - free) < 512 << 20
    entries = {(e["kind"], e["name"]): e["bytes"] for e in c["model cache"]["data"]["entries"]}
    assert entries == {("pypi-models", "some-model"): 1000, ("repos", "org__name"): 24}
    for mod in ("torch", "transformers", "mlx_lm", "llguidance"):
        assert (c["optional"]["data"]["versions"][mod] is not None) == (importlib.util.find_spec(mod) is not None)
    assert c["llama.cpp"]["status"] == "warn"  # nothing built in this empty cache


def test_llama_cpp_build_is_detected(cli, llama_cpp_bin, monkeypatch):
    monkeypatch.setenv("HF2Q_CACHE", str(llama_cpp_bin.parent.parent))
    _, c = _checks(cli("doctor", "--json").out)
    assert c["llama.cpp"]["status"] == "ok"
    assert c["llama.cpp"]["data"]["tools"]["llama-quantize"] == str(llama_cpp_bin / "llama-quantize")


@pytest.mark.skipif(platform.system() != "Linux" or shutil.which("ldd") is None, reason="needs Linux ldd")
def test_blas_check_names_the_blas_mlx_links(cli):
    """The BLAS that ``ldd`` says MLX's native library links is the one doctor reports."""
    import subprocess
    from pathlib import Path

    import mlx.core as mx

    lib = Path(mx.__file__).parent / "lib" / "libmlx.so"
    ldd = subprocess.run(["ldd", str(lib if lib.exists() else mx.__file__)], capture_output=True, text=True, check=True).stdout
    linked = [line.split()[0] for line in ldd.splitlines() if "blas" in line.split()[0].lower()]
    assert linked, ldd
    _, c = _checks(cli("doctor", "--json").out)
    reported = [Path(p).name for p in c["blas"]["data"]["libraries"]]
    assert all(name in reported for name in linked)
    if c["mlx"]["data"]["backend"] == "cpu" and all("openblas" not in n for n in reported):
        assert c["blas"]["status"] == "warn"


def test_text_output_and_failing_core_check(cli, monkeypatch):
    r = cli("doctor")
    assert r.code == 0 and "core checks passed" in r.out and "mlx" in r.out

    real_import = doctor._import

    def broken(name):
        if name == "mlx.core":
            raise ImportError("libmlx.so: cannot open shared object file")
        return real_import(name)

    monkeypatch.setattr(doctor, "_import", broken)
    r = cli("doctor")
    assert r.code == 1 and "core checks FAILED" in r.out and "FAIL  mlx" in r.out
    r = cli("doctor", "--json")
    data, c = _checks(r.out)
    assert r.code == 1 and data["ok"] is False and c["mlx"]["status"] == "fail"


@pytest.mark.parametrize("free,status", [(1 << 30, "warn"), (100 << 30, "ok")])
def test_low_disk_is_a_warning_not_a_failure(free, status, monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(200 << 30, 0, free))
    c = doctor.check_disk(tmp_path / "not" / "yet")
    assert c.status == status and not c.core and c.data["free_bytes"] == free


def _doctor_in_fresh_process(**env_extra) -> dict:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_") and k != "HF2Q_NO_FAST_BLAS"}
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-m", "hf2q", "doctor", "--json"], capture_output=True, text=True,
                       timeout=300, env=env, check=False)
    assert r.returncode == 0, r.stderr
    return _checks(r.stdout)[1]["blas"]


@pytest.mark.skipif(platform.system() != "Linux", reason="Linux CPU wheels only")
def test_blas_check_reports_the_openblas_hf2q_preloads():
    """With cmeel-openblas installed, doctor does hf2q's own preload and names that library (the one
    the package ships) and its version — no "reference BLAS" warning."""
    import os

    try:
        dist = importlib.metadata.distribution("cmeel-openblas")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("cmeel-openblas is not installed")
    shipped = [os.path.realpath(dist.locate_file(f)) for f in dist.files or () if f.name == "libopenblas.so.0"]
    assert shipped
    blas = _doctor_in_fresh_process()
    assert blas["status"] == "ok", blas
    assert blas["data"]["in_use"] in shipped
    assert blas["data"]["vendor"].startswith(f"OpenBLAS {dist.version.split('.post')[0]}"), blas


@pytest.mark.skipif(platform.system() != "Linux" or shutil.which("ldd") is None, reason="needs Linux ldd")
def test_blas_check_warns_when_mlx_is_left_on_its_reference_blas():
    """Without the preload MLX calls the BLAS its own library links (``ldd``): that one is named, with a warning."""
    import subprocess
    from pathlib import Path

    import mlx.core as mx

    lib = Path(mx.__file__).parent / "lib" / "libmlx.so"
    ldd = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, check=True).stdout
    linked = [line.split()[0] for line in ldd.splitlines() if line.split()[0].startswith("libblas")]
    if not linked:
        pytest.skip(f"this MLX links no reference BLAS: {ldd}")
    blas = _doctor_in_fresh_process(HF2Q_NO_FAST_BLAS="1")
    assert blas["status"] == "warn" and "reference BLAS" in blas["detail"]
    assert Path(blas["data"]["in_use"]).name == linked[0]
