/* The contract between the thread pool (cpu_pool.c) and the kernel libraries that share work
   over it (through pool_client.h): a job is fn(ctx, lo, hi) over a range of [0, n). */
#ifndef HF2Q_POOL_H
#define HF2Q_POOL_H

typedef void (*range_fn)(void* ctx, int lo, int hi);
typedef void (*pool_for_fn)(range_fn fn, void* ctx, int n, int grain);

#endif
