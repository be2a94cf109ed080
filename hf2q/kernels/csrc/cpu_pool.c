/* The persistent worker pool of the host kernels (hf2q/kernels/cpu_pool.py says why and how). */
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

#include "pool.h"

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
