"""``hf2q doctor``: can this machine convert and serve, and what will it be fast or slow at?

Each check is a small function returning a ``Check`` (ok / warn / fail + a one-line detail).
*Core* checks — Python version, the core libraries, MLX and its device — decide the exit
code (0 when all pass, 1 otherwise); the rest are advice: free disk in the cache, what is
cached, optional dependencies, the BLAS MLX runs on after hf2q's own OpenBLAS preload (Linux
CPU wheels link a slow reference BLAS), and whether a stock llama.cpp build is around for parity tests.
Nothing here downloads, builds or loads a model, so doctor is quick and safe to run anywhere.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import attrs

from hf2q import __version__
from hf2q.paths import cache_root, tree_bytes

CORE_LIBS = ("numpy", "trio", "gguf", "safetensors", "tokenizers", "jinja2", "quart", "quart_trio", "hypercorn",
             "transitions", "attrs", "rich", "huggingface_hub")
OPTIONAL_LIBS = {"mlx_lm": "mlx-lm", "torch": "torch", "transformers": "transformers",
                 "llguidance": "llguidance", "sentencepiece": "sentencepiece", "openai": "openai"}
LOW_DISK_BYTES = 10 << 30
_BLAS_HINTS = ("openblas", "mkl", "blis", "libblas", "libcblas", "accelerate", "atlas", "flexiblas")
_FAST_BLAS = ("openblas", "mkl", "blis", "flexiblas")


@attrs.frozen
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    core: bool = False
    data: dict = attrs.field(factory=dict)


def _import(name: str):
    return importlib.import_module(name)


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check("python", "ok" if ok else "fail",
                 f"{platform.python_version()} ({sys.executable})" + ("" if ok else " — hf2q needs ≥ 3.11"),
                 core=True, data={"version": platform.python_version()})


def check_core_libs() -> Check:
    missing, versions = [], {}
    for mod in CORE_LIBS:
        if importlib.util.find_spec(mod) is None:
            missing.append(mod)
        else:
            versions[mod] = _dist_version(mod.replace("_", "-")) or _dist_version(mod) or "?"
    if missing:
        return Check("core libraries", "fail", "missing: " + ", ".join(missing), core=True,
                     data={"missing": missing, "versions": versions})
    return Check("core libraries", "ok", ", ".join(f"{k} {v}" for k, v in versions.items()), core=True,
                 data={"versions": versions})


def check_mlx() -> Check:
    try:
        mx = _import("mlx.core")
    except Exception as e:  # noqa: BLE001 — an ImportError or a broken native library
        return Check("mlx", "fail", f"cannot import mlx.core ({type(e).__name__}: {e}); "
                     "install mlx[cpu] (Linux) or mlx (macOS)", core=True)
    device = str(mx.default_device())
    metal = bool(getattr(getattr(mx, "metal", None), "is_available", lambda: False)())
    cuda = bool(getattr(getattr(mx, "cuda", None), "is_available", lambda: False)())
    backend = "metal" if metal else "cuda" if cuda else "cpu"
    try:  # the device really computes
        ok = float(mx.sum(mx.arange(4, dtype=mx.float32)).item()) == 6.0
    except Exception as e:  # noqa: BLE001
        return Check("mlx", "fail", f"mlx {mx.__version__} on {device}: a tiny computation failed ({e})", core=True)
    return Check("mlx", "ok" if ok else "fail", f"mlx {mx.__version__}, default device {device}, backend {backend}",
                 core=True, data={"version": mx.__version__, "device": device, "backend": backend,
                                  "metal": metal, "cuda": cuda})


def loaded_blas_libraries() -> list[str]:
    """Shared libraries with BLAS in their name mapped into this process (Linux /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    libs = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    return sorted(p for p in libs if any(h in Path(p).name.lower() for h in _BLAS_HINTS))


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _sgemm_address(lib: ctypes.CDLL) -> int | None:
    try:
        return ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return None


def _file_of(address: int) -> str | None:
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:
        return None
    dladdr.argtypes, dladdr.restype = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)], ctypes.c_int
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def blas_in_use() -> str | None:
    """The library MLX's ``cblas_sgemm`` calls bind to: the first definition in the process's global
    symbol scope (hf2q's preload, or an ``LD_PRELOAD``), else the one MLX's own library links."""
    address = _sgemm_address(ctypes.CDLL(None))
    if address:
        return _file_of(address)
    for path in loaded_blas_libraries():
        try:
            address = _sgemm_address(ctypes.CDLL(path))
        except OSError:
            continue
        if address:
            return _file_of(address) or path
    return None


def blas_vendor(path: str) -> str | None:
    """The library's own description of itself (OpenBLAS's build config, BLIS's version), if it has one."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    for fn_name in ("openblas_get_config", "bli_info_get_version_str"):
        fn = getattr(lib, fn_name, None)
        if fn is not None:
            fn.restype = ctypes.c_char_p
            text = fn()
            return text.decode(errors="replace").strip() if text else None
    return None


def check_blas(mlx_check: Check, preload_status: str = "") -> Check:
    """Reports the BLAS MLX really calls after hf2q's own preload (``hf2q.engine.factory.prepare_mlx``);
    warns only when that is a reference BLAS on MLX's CPU back-end."""
    if sys.platform == "darwin":
        return Check("blas", "ok", "Accelerate (macOS)", data={"libraries": ["Accelerate"]})
    libs = loaded_blas_libraries()
    used = blas_in_use()
    vendor = blas_vendor(used) if used else None
    data = {"libraries": libs, "in_use": used, "vendor": vendor, "preload": preload_status}
    name = Path(used).name if used else ""
    fast = any(h in name.lower() for h in _FAST_BLAS) or any(h in (vendor or "").lower() for h in _FAST_BLAS)
    if mlx_check.data.get("backend") == "cpu" and not fast:
        why = f" ({preload_status})" if preload_status and not preload_status.startswith("openblas") else ""
        fix = ("unset HF2Q_NO_FAST_BLAS" if preload_status.startswith("disabled")
               else "install cmeel-openblas (pip install 'hf2q[cpu]')")
        return Check("blas", "warn", (f"reference BLAS {used}" if used else "no BLAS found") + why
                     + f" — MLX CPU float32 matmul will be slow; {fix}", data=data)
    if not used:
        return Check("blas", "ok", "none needed on the GPU backend", data=data)
    return Check("blas", "ok", used + (f" — {vendor}" if vendor else ""), data=data)


def check_disk(root: Path) -> Check:
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    detail = f"{usage.free / 2**30:.1f} GiB free at {root}"
    data = {"path": str(root), "free_bytes": usage.free, "total_bytes": usage.total}
    if usage.free < LOW_DISK_BYTES:
        return Check("disk", "warn", detail + " — conversions need room for the output and a temp copy", data=data)
    return Check("disk", "ok", detail, data=data)


def check_model_cache(root: Path) -> Check:
    entries = []
    for sub in ("pypi-models", "repos", "test-models"):
        d = root / sub
        if not d.is_dir():
            continue
        for item in sorted(d.iterdir()):
            if item.name.startswith(("_", ".")) or ".tmp" in item.name:
                continue
            entries.append({"kind": sub, "name": item.name, "bytes": tree_bytes(item) if item.is_dir()
                            else item.stat().st_size})
    total = sum(e["bytes"] for e in entries)
    detail = (f"{len(entries)} item(s), {total / 2**30:.2f} GiB in {root}" if entries
              else f"empty ({root}); the default model is fetched on first use")
    return Check("model cache", "ok", detail, data={"path": str(root), "entries": entries, "total_bytes": total})


def check_optional() -> Check:
    found = {mod: (_dist_version(dist) if importlib.util.find_spec(mod) is not None else None)
             for mod, dist in OPTIONAL_LIBS.items()}
    missing = [m for m, v in found.items() if v is None]
    detail = ", ".join(f"{m} {v}" for m, v in found.items() if v) or "none"
    if missing:
        detail += " — not installed: " + ", ".join(missing)
    return Check("optional", "ok" if not missing else "warn", detail, data={"versions": found})


def check_llama_cpp(root: Path) -> Check:
    bin_dir = root / "llama.cpp-build" / "bin"
    tools = {t: (str(bin_dir / t) if (bin_dir / t).exists() else shutil.which(t))
             for t in ("llama-quantize", "llama-completion", "llama-server")}
    have = [t for t, p in tools.items() if p]
    if len(have) == len(tools):
        return Check("llama.cpp", "ok", f"{', '.join(have)} found ({Path(tools['llama-quantize']).parent})",
                     data={"tools": tools})
    return Check("llama.cpp", "warn", "no stock llama.cpp build (only needed for parity tests: "
                 "python -m tests.tools.llama_cpp)", data={"tools": tools})


#: the modules that define the serving kernels, in dependency order (the pool first)
KERNEL_MODULES = ("cpu_pool", "cpu_qmatvec", "cpu_decode_ops", "cpu_attention", "cpu_repack", "cpu_gated_delta",
                  "cuda_qmv")


def kernel_build_states() -> dict[str, dict[str, str]]:
    """Each serving kernel's build as serving would do it (compiled once into the cache):
    ``{"status": "ok" | "failed" | "not applicable", "detail": …}`` by kernel name."""
    states: dict[str, dict[str, str]] = {}
    for name in KERNEL_MODULES:
        try:
            module = _import(f"hf2q.kernels.{name}")
        except ImportError as e:
            states[name] = {"status": "not applicable", "detail": f"cannot import ({e})"}
            continue
        library = getattr(module, "LIBRARY", None)
        status, detail = library.status() if library is not None else module.status()
        states[name] = {"status": status, "detail": detail}
    return states


def check_kernel_builds() -> Check:
    """A kernel that does not build leaves serving on its slower fallback; say which and why."""
    states = kernel_build_states()
    built = [n for n, s in states.items() if s["status"] == "ok"]
    failed = {n: s["detail"] for n, s in states.items() if s["status"] == "failed"}
    skipped = {n: s["detail"] for n, s in states.items() if s["status"] == "not applicable"}
    parts = [f"{n} FAILED ({(d.splitlines() or ['no message'])[0]})" for n, d in failed.items()]
    parts += [f"built: {', '.join(built)}"] if built else []
    parts += [f"{n} not applicable ({d})" for n, d in skipped.items()]
    detail = "; ".join(parts)
    if failed:
        detail += " — the slower fallback serves instead; fix the C compiler (CC) and run again"
    return Check("kernel builds", "warn" if failed else "ok", detail, data={"kernels": states})


def run_checks() -> list[Check]:
    from hf2q.engine.factory import prepare_mlx

    root = cache_root()
    preload = prepare_mlx()  # what hf2q itself does before MLX, so the BLAS found is the one serving gets
    mlx = check_mlx()
    return [check_python(), check_core_libs(), mlx, check_blas(mlx, preload), check_disk(root),
            check_model_cache(root), check_optional(), check_llama_cpp(root), check_kernel_builds()]


def run(args: argparse.Namespace) -> int:
    checks = run_checks()
    ok = all(c.status != "fail" for c in checks if c.core)
    if getattr(args, "json", False):
        print(json.dumps({"hf2q_version": __version__, "ok": ok,
                          "checks": [attrs.asdict(c) for c in checks]}, indent=1))
    else:
        mark = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}
        width = max(len(c.name) for c in checks)
        print(f"hf2q {__version__} doctor")
        for c in checks:
            print(f"  {mark[c.status]:4}  {c.name:{width}}  {c.detail}")
        print("core checks passed" if ok else "core checks FAILED")
    return 0 if ok else 1
