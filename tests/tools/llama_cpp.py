"""Build stock llama.cpp from the llama-cpp-python 0.3.36 sdist (PyPI) — our test-time oracle.

Used to generate byte-exact quantizer fixtures, to check that our GGUFs load and generate
in stock llama.cpp, and as the peer in benchmarks. Nothing of llama.cpp is committed: the
sdist is fetched into the hf2q cache and built there.

    python -m tests.tools.llama_cpp          # build (idempotent) and print the bin dir

Build flags: ``-DGGML_NATIVE=OFF`` with AVX2/FMA/F16C, and AVX-512 only where the CPU has it —
some machines advertise AMX but trap its instructions (a native build dies with SIGILL on
quantized models), others lack AVX-512. The build directory records that choice
(``isa.txt``); a cached build made for another choice is thrown away and built again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf2q.fetch import LLAMA_CPP_SDIST, fetch  # noqa: E402
from hf2q.kernels.cpu_info import cpu_flags  # noqa: E402
from hf2q.paths import cache_root  # noqa: E402

#: the programs the tests run (each built into ``bin_dir()``)
TOOLS = ["llama-quantize", "llama-cli", "llama-completion", "llama-server", "llama-bench", "llama-simple",
         "llama-imatrix", "llama-perplexity", "llama-embedding", "llama-mtmd-cli", "llama-tokenize"]
TARGETS = [*TOOLS, "ggml-base", "ggml-cpu", "llama"]


def source_dir() -> Path:
    return fetch(LLAMA_CPP_SDIST)


def _has_avx512() -> bool:
    return {"avx512f", "avx512bw", "avx512vl"} <= (cpu_flags() or set())


def build_dir() -> Path:
    return cache_root() / "llama.cpp-build"


def isa() -> str:
    """The instruction set the oracle is built for here: AVX-512 where the CPU has it, unless
    ``HF2Q_LLAMA_ISA=avx2`` asks for the build an AVX2-only host gets (its rounding, on this host)."""
    forced = os.environ.get("HF2Q_LLAMA_ISA", "")
    if forced and forced not in ("avx2", "avx512"):
        raise RuntimeError(f"HF2Q_LLAMA_ISA={forced}: expected avx2 or avx512")
    return forced or ("avx512" if _has_avx512() else "avx2")


def bin_dir() -> Path:
    """The built tools; ``HF2Q_LLAMA_BIN`` points at another build (a CUDA one on a GPU machine)."""
    env = os.environ.get("HF2Q_LLAMA_BIN")
    return Path(env) if env else build_dir() / "bin"


def tool(name: str) -> Path | None:
    p = bin_dir() / name
    return p if p.exists() else None


def _built_for_this_cpu() -> bool:
    if os.environ.get("HF2Q_LLAMA_BIN"):
        return True
    stamp = build_dir() / "isa.txt"
    return stamp.exists() and stamp.read_text().strip() == isa()


def built_isa() -> str:
    """The instruction set the build in use was made for (its ``isa.txt``), ``unknown`` without one."""
    try:
        return (bin_dir().parent / "isa.txt").read_text().strip()
    except OSError:
        return "unknown"


def available() -> bool:
    return _built_for_this_cpu() and all(
        (bin_dir() / t).exists() for t in ("llama-quantize", "llama-completion", "llama-bench"))


def build(jobs: int | None = None, targets=TARGETS) -> Path:
    """Build the tools once; a cached build that lacks some (an older target list) gets just those."""
    missing = [t for t in targets if t in TOOLS and not (bin_dir() / t).exists()]
    if available() and not missing:
        return bin_dir()
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is required to build llama.cpp")
    src, out = source_dir(), build_dir()
    if out.exists() and not _built_for_this_cpu():  # built for another CPU (or before the stamp)
        shutil.rmtree(out)
    if available():  # configured and built before: only the missing tools
        targets = missing
    cfg = ["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
           "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
           f"-DGGML_AVX512={'ON' if isa() == 'avx512' else 'OFF'}",
           "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
           "-DGGML_OPENMP=ON", f"-DCMAKE_RUNTIME_OUTPUT_DIRECTORY={out / 'bin'}",
           f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out / 'bin'}"]
    subprocess.run(cfg, check=True, stdout=subprocess.DEVNULL)
    jobs = jobs or os.cpu_count() or 2
    for t in targets:
        subprocess.run(["cmake", "--build", str(out), "--config", "Release", "-j", str(jobs), "--target", t],
                       check=False, stdout=subprocess.DEVNULL)
    lacking = [t for t in TOOLS if not (bin_dir() / t).exists()]
    if lacking:
        raise RuntimeError(f"llama.cpp build incomplete in {out}: {', '.join(lacking)} missing")
    (out / "isa.txt").write_text(isa() + "\n")
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
    print(f"{build()} (built for {isa()}, {os.cpu_count()} CPUs)")
