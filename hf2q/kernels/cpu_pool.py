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

from hf2q.kernels.cpu_build import build_library

SOURCE = r"""
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

typedef void (*range_fn)(void* ctx, int lo, int hi);

#define MAX_THREADS 16
#define SPIN_NS 200000 /* a worker spins this long after its last job before it sleeps */

/* claim word: generation (24 bits) | chunk count (20 bits) | next chunk (20 bits) */
#define GEN(c) ((c) >> 40)
#define COUNT(c) (((c) >> 20) & 0xFFFFF)
#define NEXT(c) ((c) & 0xFFFFF)

static _Atomic uint64_t claim;
static _Atomic int done;
static _Atomic int sleepers;
static _Atomic int busy; /* a job is in flight: a second caller thread runs its own inline */
static range_fn job_fn;
static void* job_ctx;
static int job_n, job_grain;
static int n_threads = 1;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claims and runs chunks of generation gen until none is left; returns how many it ran. */
static int run_chunks(uint64_t gen) {
    int ran = 0;
    uint64_t c = atomic_load_explicit(&claim, memory_order_acquire);
    for (;;) {
        if (GEN(c) != gen || NEXT(c) >= COUNT(c)) return ran;
        if (!atomic_compare_exchange_weak_explicit(&claim, &c, c + 1, memory_order_acq_rel, memory_order_acquire))
            continue;
        const int i = (int)NEXT(c);
        const int lo = i * job_grain;
        const int hi = lo + job_grain < job_n ? lo + job_grain : job_n;
        job_fn(job_ctx, lo, hi);
        atomic_fetch_add_explicit(&done, 1, memory_order_release);
        ran++;
        c = atomic_load_explicit(&claim, memory_order_acquire);
    }
}

static void* worker(void* arg) {
    (void)arg;
    uint64_t seen = GEN(atomic_load(&claim));
    for (;;) {
        int64_t since = now_ns();
        unsigned spins = 0;
        uint64_t c;
        while (GEN(c = atomic_load_explicit(&claim, memory_order_acquire)) == seen) {
            RELAX();
            if ((++spins & 255) == 0 && now_ns() - since > SPIN_NS) {
                pthread_mutex_lock(&mu);
                atomic_fetch_add(&sleepers, 1);
                while (GEN(atomic_load(&claim)) == seen) pthread_cond_wait(&cv, &mu);
                atomic_fetch_sub(&sleepers, 1);
                pthread_mutex_unlock(&mu);
                since = now_ns();
            }
        }
        seen = GEN(c);
        run_chunks(seen);
    }
    return NULL;
}

/* A forked child has none of the workers: it runs every job inline (and must not touch a mutex a
   worker may have held at the fork). */
static void after_fork_in_child(void) {
    n_threads = 1;
    atomic_store(&sleepers, 0);
    atomic_store(&busy, 0);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&cv, NULL);
}

/* Starts the workers (threads - 1 of them) once; returns the thread count in use. */
int pool_start(int threads) {
    static int started = 0;
    if (started) return n_threads;
    started = 1;
    pthread_atfork(NULL, NULL, after_fork_in_child);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int i = 1; i < threads; i++) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &a, worker, NULL) == 0) n_threads++;
        pthread_attr_destroy(&a);
    }
    return n_threads;
}

int pool_threads(void) { return n_threads; }

/* fn(ctx, lo, hi) over [0, n) in chunks of grain; the caller works too and returns when every
   chunk is done. One job at a time (the engine's single thread): a call from another thread while
   a job is in flight runs inline instead of waiting. */
void pool_for(range_fn fn, void* ctx, int n, int grain) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    const int chunks = (n + grain - 1) / grain;
    if (n_threads == 1 || chunks == 1 || chunks > 0xFFFFF || atomic_exchange(&busy, 1)) {
        fn(ctx, 0, n);
        return;
    }
    job_fn = fn; job_ctx = ctx; job_n = n; job_grain = grain;
    atomic_store_explicit(&done, 0, memory_order_relaxed);
    const uint64_t gen = (GEN(atomic_load(&claim)) + 1) & 0xFFFFFF;
    atomic_store(&claim, (gen << 40) | ((uint64_t)chunks << 20));  /* publishes the job (seq_cst) */
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&mu);
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
    }
    run_chunks(gen);
    while (atomic_load_explicit(&done, memory_order_acquire) < chunks) RELAX();
    atomic_store(&busy, 0);
}
"""

_LIB: ctypes.CDLL | None = None
_TRIED = False

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


def library() -> ctypes.CDLL | None:
    """The started pool (None without a C compiler)."""
    global _LIB, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            lib = build_library("cpu_pool", SOURCE)
        except OSError:
            lib = None
        if lib is not None:
            lib.pool_start.argtypes = [ctypes.c_int]
            lib.pool_start.restype = ctypes.c_int
            lib.pool_threads.restype = ctypes.c_int
            lib.pool_for.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            lib.pool_for.restype = None
            lib.pool_start(wanted_threads())
        _LIB = lib
    return _LIB


#: C for a kernel library that shares work over the pool: put it before the library's source,
#: call ``pool_share(fn, ctx, n, worth_it)``, and hand the pool over with :func:`attach` once the
#: library is loaded.
CLIENT_SOURCE = r"""
typedef void (*range_fn)(void* ctx, int lo, int hi);
typedef void (*pool_for_fn)(range_fn fn, void* ctx, int n, int grain);
static pool_for_fn POOL_FOR = 0;
static int POOL_THREADS = 1;
void set_pool(void* pool_for, int threads) { POOL_FOR = (pool_for_fn)pool_for; POOL_THREADS = threads; }
/* fn over [0, n): shared over the pool in about 8 chunks per thread when the caller says the job
   is worth it and a pool is set, else run inline on the calling thread */
static void pool_share(range_fn fn, void* ctx, int n, int worth_it) {
    if (POOL_FOR && POOL_THREADS > 1 && worth_it && n > 1) {
        const int grain = n / (POOL_THREADS * 8);
        POOL_FOR(fn, ctx, n, grain < 1 ? 1 : grain);
    } else {
        fn(ctx, 0, n);
    }
}
"""


def attach(lib: ctypes.CDLL) -> None:
    """Give a library built with :data:`CLIENT_SOURCE` the shared pool (a no-op without one)."""
    lib.set_pool.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.set_pool.restype = None
    pool = library()
    if pool is not None:
        lib.set_pool(ctypes.cast(pool.pool_for, ctypes.c_void_p).value, threads())


def threads() -> int:
    lib = library()
    return 1 if lib is None else int(lib.pool_threads())
