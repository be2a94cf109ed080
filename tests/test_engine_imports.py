"""Importing ``hf2q.engine`` changes nothing in the process: no environment variable, no BLAS
library mapped. The fast CPU BLAS is loaded by an explicit call (``hf2q.engine.factory``) made by
whoever is about to build a runner. Checked in fresh interpreters, read from ``/proc/self/maps``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, os, sys
import numpy  # numpy maps its own (symbol-prefixed) OpenBLAS: part of the baseline

def blas():
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "/" in line and "blas" in line.rsplit("/", 1)[-1].lower()}

env, maps = dict(os.environ), blas()
for name in sys.argv[1].split(","):
    __import__(name)
if sys.argv[2] == "prepare":
    from hf2q.engine.factory import prepare_mlx
    prepare_mlx()
print(json.dumps({"env": sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)),
                  "blas": sorted(blas() - maps), "mlx": "mlx" in sys.modules}))
"""

#: the engine modules that do not import MLX themselves (the serve pre-flight and tensor-parallel planning use them)
PURE = ("hf2q.engine", "hf2q.engine.factory", "hf2q.engine.device_probe", "hf2q.engine.memory_plan",
        "hf2q.engine.tensor_parallel", "hf2q.engine.tp_launch", "hf2q.engine.protocol", "hf2q.engine.generate")


def _probe(modules, then: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_")}  # as a fresh shell has it
    env.pop("HF2Q_NO_FAST_BLAS", None)
    r = subprocess.run([sys.executable, "-c", _PROBE, ",".join(modules), then], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env, check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_importing_the_engine_has_no_side_effects():
    got = _probe(PURE)
    assert got == {"env": [], "blas": [], "mlx": False}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_importing_the_runner_loads_only_what_mlx_itself_links():
    got = _probe(["hf2q.engine.runner"])
    assert got["env"] == [] and got["mlx"] is True
    assert not any("openblas" in Path(p).name for p in got["blas"]), got  # MLX's own reference BLAS only


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_the_explicit_preload_is_what_loads_openblas():
    """The probe sees a preload when there is one: prepare_mlx maps cmeel's OpenBLAS and sets its thread variables."""
    from hf2q.kernels import cpu_blas

    if not cpu_blas.status().startswith("openblas"):
        pytest.skip(f"no fast BLAS here ({cpu_blas.status()})")
    got = _probe(["hf2q.engine"], "prepare")
    assert any(Path(p).name == "libopenblas.so.0" for p in got["blas"]), got
    assert {"OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT"} <= set(got["env"])
