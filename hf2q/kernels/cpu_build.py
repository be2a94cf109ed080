"""Compiling the small C kernels of ``hf2q.kernels.cpu_*`` once per machine.

Each kernel module holds its C source as a string; :func:`build_library` compiles it with the
system C compiler into the hf2q cache, keyed by a hash of the source *and* the flags (a cache
shared between machines of different vector ISAs never loads a library built for another),
written atomically so concurrent processes can race safely. The flags target the widest
vector ISA /proc/cpuinfo reports; every kernel keeps a portable C path for the rest.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags() -> list[str]:
    """``-O3`` plus the widest vector ISA this CPU has: AVX-512F, else AVX2/FMA, else portable C.
    ``HF2Q_NO_AVX512=1`` / ``HF2Q_NO_AVX2=1`` step down (the library is cached per flag set)."""
    flags = ["-O3", "-fPIC", "-shared", "-ffp-contract=fast", "-fno-math-errno", "-fassociative-math",
             "-fno-signed-zeros", "-fno-trapping-math"]
    cpu = _cpu_flags()
    if {"avx2", "fma", "f16c"} <= cpu and not os.environ.get("HF2Q_NO_AVX2"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if "avx512f" in cpu and not os.environ.get("HF2Q_NO_AVX512"):
            flags += ["-mavx512f"]
    return flags


def build_library(name: str, source: str) -> ctypes.CDLL | None:
    """Compile ``source`` once with the system C compiler into the hf2q cache (keyed by a hash of
    the source and flags, written atomically) and load it; None when there is no compiler or it fails."""
    from hf2q.paths import cache_root

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc:
        return None
    flags = compile_flags()
    tag = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    lib = out_dir / f"{name}-{tag}.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        src = out_dir / f"{name}-{tag}.{os.getpid()}.c"
        src.write_text(source)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run([cc, *flags, str(src), "-o", str(tmp), "-lm"], check=False, capture_output=True, text=True)
        src.unlink(missing_ok=True)
        if r.returncode != 0:
            return None
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))
