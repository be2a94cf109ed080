"""A persistent C thread pool for the host kernels: ``pool_for(fn, ctx, n, grain)`` runs
``fn(ctx, lo, hi)`` over ``[0, n)`` in chunks, the calling thread taking chunks too.

Why it exists: a decode step is ~300 kernel calls of 10–100 µs each. Handing each call's
halves to Python threads cost more than it saved (a SmolLM2 step went from 11.6 to 21 ms
on two threads), so the split lives in C: the workers spin on one atomic word for a short
while after each job (the next call of a step arrives within microseconds), then sleep on a
condition variable, so an idle server burns no CPU. Chunks are claimed dynamically with a
compare-and-swap on that word, which also carries the job's generation and chunk count,
so a worker that wakes late can never claim a chunk of a job that has moved on; and when a
worker is descheduled (the HTTP thread wants the core), the caller simply takes its chunks.

Kernels in other compiled libraries reach the pool through the address of ``pool_for``
(``set_pool`` on their side), so every library shares one set of workers. The pool runs
``HF2Q_CPU_THREADS`` threads in all (default: the CPUs this process may run on, no more than
a container's CPU quota, at most 16); 1 means no workers and every ``pool_for`` runs inline,
as it does in a forked child (the workers do not survive a fork).
"""

from __future__ import annotations

import ctypes
import os

from hf2q.kernels.cpu_build import KernelLibrary

#: ``void (*)(void* ctx, int lo, int hi)`` as ctypes sees it (for tests and Python-side jobs)
RANGE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)


def _cgroup_cpus(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 ``cpu.max`` or v1 ``cfs_quota_us``), or None."""
    try:
        quota, period = open(f"{root}/cpu.max").read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(open(f"{root}/cpu/cpu.cfs_quota_us").read())
        period = int(open(f"{root}/cpu/cpu.cfs_period_us").read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def wanted_threads() -> int:
    """``HF2Q_CPU_THREADS``, else the CPUs this process may run on — fewer when a container's CPU
    quota says so (workers spinning beyond the quota would only wait for each other) — at most 16."""
    env = os.environ.get("HF2Q_CPU_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    n = usable_cpus()
    quota = _cgroup_cpus()
    if quota is not None:
        n = min(n, max(1, int(quota + 0.5)))
    return max(1, min(16, n))


def _declare(lib: ctypes.CDLL) -> None:
    lib.pool_start.argtypes = [ctypes.c_int]
    lib.pool_start.restype = ctypes.c_int
    lib.pool_threads.restype = ctypes.c_int
    lib.pool_for.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.pool_for.restype = None


LIBRARY = KernelLibrary("cpu_pool", declare=_declare, start=lambda lib: lib.pool_start(wanted_threads()))


def library() -> ctypes.CDLL | None:
    """The started pool (None without a C compiler)."""
    return LIBRARY.load()


def attach(lib: ctypes.CDLL) -> None:
    """Give a library built with ``csrc/pool_client.h`` the shared pool (a no-op without one)."""
    lib.set_pool.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.set_pool.restype = None
    pool = library()
    if pool is not None:
        lib.set_pool(ctypes.cast(pool.pool_for, ctypes.c_void_p).value, threads())


def threads() -> int:
    lib = library()
    return 1 if lib is None else int(lib.pool_threads())
