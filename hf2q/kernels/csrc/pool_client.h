/* Included by a kernel library that shares work over the thread pool of cpu_pool.c: call
   pool_share(fn, ctx, n, worth_it) and, once the library is loaded, hand it the pool's pool_for
   through set_pool (cpu_pool.attach on the Python side), so every library shares one set of workers. */
#ifndef HF2Q_POOL_CLIENT_H
#define HF2Q_POOL_CLIENT_H

#include "pool.h"

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

#endif
