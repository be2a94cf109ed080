"""Give MLX's CPU backend an optimised BLAS (STYLE.md pitfall 12).

MLX's Linux CPU wheel links the reference netlib BLAS: float32 matmul runs at ~2 GFLOP/s.
MLX calls plain ``cblas_sgemm``; if a library exporting that symbol is loaded into the
global symbol scope *before* MLX makes its first call, the dynamic linker binds MLX to
it instead. We use the OpenBLAS that the ``cmeel-openblas`` wheel ships unprefixed
(numpy's bundled OpenBLAS prefixes its symbols, so it cannot serve).

That library declares a dependency on ``libgfortran.so.5``, which a bare machine may
lack. The MLX wheel bundles a libgfortran under a hashed name; we copy it once into the
hf2q cache with its SONAME rewritten to ``libgfortran.so.5`` (same-length-or-shorter
string patch of the dynamic string table) and load it first, so the loader finds the
dependency already present. Everything is best effort: any failure leaves MLX on its
own BLAS and :func:`status` says why. ``HF2Q_NO_FAST_BLAS=1`` disables it;
``HF2Q_BLAS_THREADS`` (or ``OPENBLAS_NUM_THREADS``) sets its thread count (default 1:
spinning OpenBLAS threads collapse on a machine whose cores are shared).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from pathlib import Path

_STATE: dict[str, str] = {"blas": "not attempted"}


def _site_dirs() -> list[Path]:
    return [Path(p) for p in sys.path if p.endswith("site-packages")]


def _find(pattern: str) -> Path | None:
    for d in _site_dirs():
        hits = sorted(glob.glob(str(d / pattern)))
        if hits:
            return Path(hits[0])
    return None


def _patched_gfortran(src: Path, cache: Path) -> Path:
    out = cache / "libgfortran.so.5"
    if out.exists():
        return out
    data = bytearray(src.read_bytes())
    old = src.name.encode() + b"\0"
    new = b"libgfortran.so.5"
    at = data.find(old)
    if at < 0 or len(new) >= len(old):
        raise OSError(f"cannot find SONAME {src.name} to patch")
    data[at:at + len(old)] = new + b"\0" * (len(old) - len(new))
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, out)
    return out


def preload() -> str:
    """Load OpenBLAS globally (idempotent). Returns a one-line status."""
    if _STATE["blas"] != "not attempted":
        return _STATE["blas"]
    if os.environ.get("HF2Q_NO_FAST_BLAS"):
        _STATE["blas"] = "disabled by HF2Q_NO_FAST_BLAS"
        return _STATE["blas"]
    # OpenBLAS busy-waits between calls; with more threads than idle cores (a shared box,
    # or load that arrives after start-up) throughput collapses 20-50x (measured: a 2048-token
    # SmolLM2 prefill chunk went from ~10 s to 187 s), so one thread unless asked.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(os.environ.get("HF2Q_BLAS_THREADS") or 1))
    try:
        openblas = _find("cmeel.prefix/lib/libopenblas.so.0")
        if openblas is None:
            raise OSError("cmeel-openblas is not installed")
        try:
            ctypes.CDLL(str(openblas), mode=ctypes.RTLD_GLOBAL)
        except OSError:
            gfortran = _find("mlx_cpu.libs/libgfortran-*.so*")
            quadmath = _find("mlx_cpu.libs/libquadmath-*.so*")
            if gfortran is None:
                raise
            from hf2q.paths import cache_root

            if quadmath is not None:
                ctypes.CDLL(str(quadmath), mode=ctypes.RTLD_GLOBAL)
            ctypes.CDLL(str(_patched_gfortran(gfortran, cache_root() / "blas")), mode=ctypes.RTLD_GLOBAL)
            ctypes.CDLL(str(openblas), mode=ctypes.RTLD_GLOBAL)
        _STATE["blas"] = f"openblas ({openblas})"
    except OSError as e:
        _STATE["blas"] = f"reference BLAS (fast BLAS unavailable: {e})"
    return _STATE["blas"]


def status() -> str:
    return _STATE["blas"]
