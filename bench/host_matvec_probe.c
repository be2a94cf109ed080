#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <immintrin.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
/* seconds for n dependent 64-bit multiplies (3-cycle latency on every x86 core of the last decade) */
double imul_chain(int64_t n) {
    int64_t x = 3;
    const double t = now();
    __asm__ volatile("1: imul %0, %0\n imul %0, %0\n imul %0, %0\n imul %0, %0\n sub $4, %1\n jnz 1b"
                     : "+r"(x), "+r"(n));
    return now() - t;
}
#if defined(__AVX512F__)
typedef __m512 V;
#define FMA _mm512_fmadd_ps
#define SET _mm512_set1_ps
#define LANES 16
#else
typedef __m256 V;
#define FMA _mm256_fmadd_ps
#define SET _mm256_set1_ps
#define LANES 8
#endif
typedef struct { int64_t n; double seconds; float sink; } fma_job;
/* twelve independent FMA chains: more than latency x ports, so the ports are the limit */
static void* fma_loop(void* p) {
    fma_job* j = p;
    V a0 = SET(0.f), a1 = SET(1.f), a2 = SET(2.f), a3 = SET(3.f), a4 = SET(4.f), a5 = SET(5.f);
    V a6 = SET(6.f), a7 = SET(7.f), a8 = SET(8.f), a9 = SET(9.f), a10 = SET(10.f), a11 = SET(11.f);
    const V x = SET(0.999999f), y = SET(1e-7f);
    const double t = now();
    for (int64_t i = 0; i < j->n; i++) {
        a0 = FMA(a0, x, y); a1 = FMA(a1, x, y); a2 = FMA(a2, x, y); a3 = FMA(a3, x, y);
        a4 = FMA(a4, x, y); a5 = FMA(a5, x, y); a6 = FMA(a6, x, y); a7 = FMA(a7, x, y);
        a8 = FMA(a8, x, y); a9 = FMA(a9, x, y); a10 = FMA(a10, x, y); a11 = FMA(a11, x, y);
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
        __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
    }
    j->seconds = now() - t;
    float s[LANES];
    V sum = a0;
    sum = sum + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
    __builtin_memcpy(s, &sum, sizeof s);
    j->sink = s[0];
    return 0;
}
/* FMA instructions per second of each of `threads` threads running the loop at once (mean) */
double fma_rate(int64_t n, int threads) {
    pthread_t th[8];
    fma_job jobs[8];
    double total = 0.0;
    if (threads > 8) threads = 8;
    for (int i = 0; i < threads; i++) { jobs[i].n = n; pthread_create(&th[i], 0, fma_loop, &jobs[i]); }
    for (int i = 0; i < threads; i++) { pthread_join(th[i], 0); total += 12.0 * n / jobs[i].seconds; }
    return total / threads;
}
int vector_lanes(void) { return LANES; }
