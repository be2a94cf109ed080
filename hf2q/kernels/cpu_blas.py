"""Give MLX's CPU backend an optimised BLAS (docs/ENGINE.md, "CPU backend").

Nothing happens at import: :func:`preload` runs when ``hf2q.engine.factory.prepare_mlx`` asks,
before the process imports MLX.

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
own BLAS and :func:`status` says why. ``HF2Q_NO_FAST_BLAS=1`` disables it.

The wheel is not built for every CPU: each release is compiled for one OpenBLAS core (its
``openblas_config.h`` names it), and a build for an AVX-512 core dies with SIGILL on the first
product on a machine without AVX-512. :func:`_core_runs_here` reads that name before anything
is loaded and keeps MLX on its own BLAS when this CPU lacks the core's instructions.

Threads (``HF2Q_BLAS_THREADS``, default: the cores this process may use). OpenBLAS's
workers busy-wait for work (by default 2^28 cycles after each call); on the shared 2-core
box, with another process on one core, that spin once collapsed a 2-thread prefill
20-50x, so hf2q used to run one thread. Now OpenBLAS gets ``OPENBLAS_THREAD_TIMEOUT=4``
(its workers sleep almost at once; a prefill product is one large call, so the wake-up
is noise), and the work hf2q splits itself — the fused attention kernel, the
activations — runs on our own :func:`pool`, whose idle workers sleep on a queue and whose
busy ones take the next tile from a shared counter, so a worker on a contended core just
does fewer tiles. Pool workers call OpenBLAS single-threaded. Measured on the shared box
with an extra busy-loop process: SmolLM2 pp2048 6.3 s with 2 threads vs 7.5 s with 1.
:func:`matmul_t` hands a whole product to OpenBLAS when it is threaded (its threads share
the packed weight panels; slicing rows ourselves repacked the weight per slice and ran
~20% slower) and slices rows over the pool only when OpenBLAS was pinned to one thread.

OpenBLAS rounds a product by how many threads ran it (its partition of the output picks other
micro-kernels at the edges: a 24×1152 @ 1152×3456 product differs by 8e-5 between 1 and 2
threads). MLX's own products in a graph read the global count, so :func:`matmul_t` puts it back
to :func:`threads` after each call: a graph's results do not depend on which host product ran
before it. The host products themselves follow the load unless ``HF2Q_BLAS_THREADS`` fixes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import itertools
import os
import time
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hf2q.kernels.cpu_info import cpu_flags
from hf2q.kernels.cpu_pool import usable_cpus

_STATE: dict[str, str] = {"blas": "not attempted"}
_LIB: ctypes.CDLL | None = None
_SGEMM_ADDRESS: int | None = None  # address of its cblas_sgemm, read once when it loads
_OPENBLAS_PINNED = False  # the user set OPENBLAS_NUM_THREADS=1: keep it, slice rows over our pool


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


#: the x86 instruction-set flags (as /proc/cpuinfo spells them) each OpenBLAS core's kernels use
CORE_FLAGS = {
    "HASWELL": {"avx2", "fma"}, "ZEN": {"avx2", "fma"},
    "SKYLAKEX": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "COOPERLAKE": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
    "SAPPHIRERAPIDS": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile"},
}


def _core_runs_here(openblas: Path, flags: set[str] | None = None) -> str | None:
    """Why this OpenBLAS build cannot run on this CPU, or None when it can (or we cannot tell)."""
    config = openblas.parent.parent / "include" / "openblas" / "openblas_config.h"
    try:
        text = config.read_text()
    except OSError:
        return None
    if "#define OPENBLAS_DYNAMIC_ARCH" in text:
        return None
    core = next((line.split('"')[1] for line in text.splitlines()
                 if line.startswith("#define OPENBLAS_CHAR_CORENAME") and line.count('"') >= 2), None)
    flags = cpu_flags() if flags is None else flags
    if core is None or flags is None or core.upper() not in CORE_FLAGS:
        return None
    lacking = sorted(CORE_FLAGS[core.upper()] - flags)
    if lacking:
        return f"the cmeel-openblas wheel is built for {core}; this CPU lacks {', '.join(lacking)}"
    return None


def preload() -> str:
    """Load OpenBLAS globally (idempotent). Returns a one-line status."""
    global _LIB, _SGEMM_ADDRESS
    if _STATE["blas"] != "not attempted":
        return _STATE["blas"]
    if os.environ.get("HF2Q_NO_FAST_BLAS"):
        _STATE["blas"] = "disabled by HF2Q_NO_FAST_BLAS"
        return _STATE["blas"]
    # OpenBLAS busy-waits between calls; with more threads than idle cores (a shared box,
    # or load that arrives after start-up) throughput collapsed 20-50x (measured: a 2048-token
    # SmolLM2 prefill chunk went from ~10 s to 187 s): a short spin timeout (module docstring).
    global _OPENBLAS_PINNED
    _OPENBLAS_PINNED = os.environ.get("OPENBLAS_NUM_THREADS") == "1"
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(threads()))
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    try:
        openblas = _find("cmeel.prefix/lib/libopenblas.so.0")
        if openblas is None:
            raise OSError("cmeel-openblas is not installed")
        wrong_cpu = _core_runs_here(openblas)
        if wrong_cpu:
            raise OSError(wrong_cpu)
        try:
            lib = ctypes.CDLL(str(openblas), mode=ctypes.RTLD_GLOBAL)
        except OSError:
            gfortran = _find("mlx_cpu.libs/libgfortran-*.so*")
            quadmath = _find("mlx_cpu.libs/libquadmath-*.so*")
            if gfortran is None:
                raise
            from hf2q.paths import cache_root

            if quadmath is not None:
                ctypes.CDLL(str(quadmath), mode=ctypes.RTLD_GLOBAL)
            ctypes.CDLL(str(_patched_gfortran(gfortran, cache_root() / "blas")), mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(str(openblas), mode=ctypes.RTLD_GLOBAL)
        _LIB, _SGEMM_ADDRESS = lib, ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value
        _STATE["blas"] = f"openblas ({openblas})"
    except OSError as e:
        _STATE["blas"] = f"reference BLAS (fast BLAS unavailable: {e})"
    return _STATE["blas"]


def status() -> str:
    return _STATE["blas"]


def sgemm_address() -> int | None:
    """Address of the loaded OpenBLAS ``cblas_sgemm`` (for C kernels that tile their own products),
    or None when only MLX's reference BLAS is there."""
    return _SGEMM_ADDRESS


def threads() -> int:
    """Threads for the large CPU products: ``HF2Q_BLAS_THREADS``, default the cores this process may use."""
    try:
        return max(1, int(os.environ["HF2Q_BLAS_THREADS"]))
    except (KeyError, ValueError):
        return usable_cpus()


_OTHERS = [0.0]  # smoothed count of other runnable threads on the machine
_ACTIVE = [1, float("-inf")]  # the last answer of active_threads() and when it was computed
ACTIVE_TTL_S = 0.2
_OPENBLAS_SET = [0]


def active_threads() -> int:
    """Threads to use for the next product: ``HF2Q_BLAS_THREADS`` when set; otherwise the usable cores
    minus the other runnable work on the machine (``/proc/loadavg``, smoothed), at least 1.

    Every threaded product ends in a barrier; on a core that other processes hold, our thread
    waits in the run queue for its slice and the whole product waits with it. Measured on the
    shared 2-core box: 2 threads beat 1 with one other busy process (pp2048 6.3 vs 7.5 s) and
    lost badly with three (5.6k tokens: 36 s vs 27 s), so the count follows the load."""
    now = time.monotonic()
    if now - _ACTIVE[1] < ACTIVE_TTL_S:  # one prefill chunk asks per product: read the load ~5x a second
        return _ACTIVE[0]
    n = threads()
    if n > 1 and not os.environ.get("HF2Q_BLAS_THREADS"):
        others = _other_runnable()
        if others is not None:
            _OTHERS[0] = 0.7 * _OTHERS[0] + 0.3 * others
            n = max(1, min(n, n + 1 - round(_OTHERS[0])))
    _ACTIVE[0], _ACTIVE[1] = n, now
    return n


def _other_runnable() -> int | None:
    """Runnable threads on the machine right now, less the one asking (None where unknown)."""
    try:
        with open("/proc/loadavg") as f:
            return max(0, int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        return None


def _openblas_threads_now() -> int | None:
    fn = getattr(_LIB, "openblas_get_num_threads", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    return int(fn())


def use_openblas_threads(n: int) -> None:
    """Set OpenBLAS's thread count for the following calls (no-op when already so).

    The count is one setting for the whole process (this OpenBLAS's ``openblas_set_num_threads_local`` sets it
    too, for every thread), so it is asked for rather than remembered: whatever lowered it, the next call
    puts it back."""
    if _LIB is None or _OPENBLAS_PINNED:
        return
    now = _openblas_threads_now()
    if (now if now is not None else _OPENBLAS_SET[0]) == n:
        _OPENBLAS_SET[0] = n
        return
    fn = getattr(_LIB, "openblas_set_num_threads", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int], None
        fn(n)
        _OPENBLAS_SET[0] = n


_POOL: list[ThreadPoolExecutor | None] = []


def pool() -> ThreadPoolExecutor | None:
    """The shared worker pool (None with one thread). A job whose workers call OpenBLAS runs inside
    :func:`single_threaded_products`."""
    if not _POOL:
        n = threads()
        _POOL.append(ThreadPoolExecutor(n, thread_name_prefix="hf2q-blas") if n > 1 else None)
    return _POOL[0]


@contextlib.contextmanager
def single_threaded_products():
    """OpenBLAS on one thread for the calls inside (a pool job whose workers each call ``sgemm`` on their own
    tiles must not fan out again), back to :func:`threads` after: the count is one process-wide setting, and
    MLX's own products must always find it at its default (BLAS rounds by the thread count)."""
    use_openblas_threads(1)
    try:
        yield
    finally:
        use_openblas_threads(threads())


def run_shared(n_workers: int, work) -> None:
    """Run ``work()`` on ``n_workers`` workers at once (the caller's thread when one); ``work`` takes
    its slices from a shared counter itself."""
    p = pool()
    k = min(n_workers, active_threads()) if p is not None else 1
    if k <= 1:
        work()
    else:
        for f in [p.submit(work) for _ in range(k)]:
            f.result()


_SGEMM: list = []


def _sgemm():
    if not _SGEMM:
        fn = ctypes.CFUNCTYPE(None, *([ctypes.c_int] * 6), ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int)
        _SGEMM.append(fn(sgemm_address()))
    return _SGEMM[0]


#: rows per slice of a threaded product: large enough for BLAS to run near full speed
SLICE_ROWS = 256


def has_matmul() -> bool:
    return sgemm_address() is not None


def matmul_t(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x [n, k] @ w[m, k].T`` → float32 ``[n, m]`` with the loaded OpenBLAS: one call (threaded by
    OpenBLAS itself), or rows in slices over :func:`pool` when OpenBLAS is single-threaded. ``x`` and
    ``w`` float32 with contiguous rows (any row stride)."""
    n, k = x.shape
    m = w.shape[0]
    if x.strides[1] != 4:
        x = np.ascontiguousarray(x)
    if w.strides[1] != 4:
        w = np.ascontiguousarray(w)
    if out is None:
        out = np.empty((n, m), dtype=np.float32)
    sgemm = _sgemm()
    lda, ldb, ldc = x.strides[0] // 4, w.strides[0] // 4, out.strides[0] // 4
    xp, wp, op = x.ctypes.data, w.ctypes.data, out.ctypes.data
    slices = itertools.count()
    n_slices = -(-n // SLICE_ROWS)

    def work() -> None:
        for i in iter(slices.__next__, None):
            if i >= n_slices:
                return
            r0 = i * SLICE_ROWS
            rows = min(SLICE_ROWS, n - r0)
            sgemm(101, 111, 112, rows, m, k, 1.0, xp + r0 * lda * 4, lda, wp, ldb, 0.0, op + r0 * ldc * 4, ldc)

    if n_slices == 1 or pool() is None or threads() == 1 or not _OPENBLAS_PINNED:
        use_openblas_threads(active_threads() if n * m * k >= (1 << 22) else 1)
        try:
            sgemm(101, 111, 112, n, m, k, 1.0, xp, lda, wp, ldb, 0.0, op, ldc)
        finally:
            use_openblas_threads(threads())  # MLX's own products always run on one count (below)
    else:
        run_shared(n_slices, work)
    return out
