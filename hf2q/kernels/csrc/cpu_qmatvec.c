/* Quantized matrix x a few rows over MLX's affine packing (hf2q/kernels/cpu_qmatvec.py; numpy
   reference cpu_qmatvec_ref.py). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "pool_client.h"

#ifndef PF_BYTES
#define PF_BYTES 4096 /* weight prefetch distance: decode is bound by memory latency, not bandwidth */
#endif
#ifndef PF_ROWS
#define PF_ROWS 4
#endif

/* Vector layer. A 32-group is NCH chunks of VL lanes. qchunk8/qchunk4(wr, g, c): the raw q
   values of chunk c of group g of one row as floats; 4-bit chunks follow the reordered x
   (low nibbles = even elements first, then high nibbles = odd elements). AVX-512 has no
   qchunk4: its 4-bit rows go through the lane-permute table of dq4 below. */
#if defined(__AVX512F__)
typedef __m512 vf;
#define VL 16
#define NCH 2
#define RT_MAX 4 /* rows per tile: 4 rows x 4 batch rows = 16 accumulators of the 32 registers */
#define RT_WIDE 4
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset(float s) { return _mm512_set1_ps(s); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf u8f(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
static inline vf qchunk8(const uint8_t* wr, int g, int c) {
    return u8f(_mm_loadu_si128((const __m128i*)(wr + g * 32 + c * 16)));
}
#elif defined(__AVX2__)
typedef __m256 vf;
#define VL 8
#define NCH 4
#define RT_MAX 4
#define RT_WIDE 2 /* 16 registers: 3-4 batch rows take 2 rows per tile */
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset(float s) { return _mm256_set1_ps(s); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf u8f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline vf qchunk8(const uint8_t* wr, int g, int c) {
    return u8f(_mm_loadl_epi64((const __m128i*)(wr + g * 32 + c * 8)));
}
static inline vf qchunk4(const uint8_t* wr, int g, int c) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)(wr + g * 16));
    const __m128i m = _mm_set1_epi8(15);
    __m128i v = c >= 2 ? _mm_and_si128(_mm_srli_epi16(raw, 4), m) : _mm_and_si128(raw, m);
    return u8f(c & 1 ? _mm_srli_si128(v, 8) : v);
}
#else
typedef float vf;
#define VL 1
#define NCH 32
#define RT_MAX 1
#define RT_WIDE 1
static inline vf vzero(void) { return 0.f; }
static inline vf vset(float s) { return s; }
static inline vf vload(const float* p) { return *p; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float vsum(vf v) { return v; }
static inline vf qchunk8(const uint8_t* wr, int g, int c) { return (float)wr[g * 32 + c]; }
static inline vf qchunk4(const uint8_t* wr, int g, int c) {
    return (float)(c < 16 ? wr[g * 16 + c] & 15 : wr[g * 16 + c - 16] >> 4);
}
#endif

/* Dequantization of one row's 32-group, as (prep once per group, then one vector per chunk).
   dq8 (and dq4 without AVX-512): q·scale + bias by one FMA per chunk. dq4 on AVX-512: the group's 16 possible values
   s·i + o (i = 0..15) are one FMA into a register table and every chunk is a lane permute of it
   (vpermps reads the low 4 bits of each index, so the low nibble needs no mask) — no int→float
   conversion and no dequantizing FMA per chunk beside the batch rows' FMAs; the table holds exactly
   fma(i, s, o), so the values are the ones the FMA form gives. */
typedef struct { vf s, o; const uint8_t* wr; int g; } dq8_t;
static inline void dq8_prep(dq8_t* d, const uint8_t* wr, int g, float s, float o) {
    d->s = vset(s); d->o = vset(o); d->wr = wr; d->g = g;
}
static inline vf dq8_chunk(const dq8_t* d, int c) { return vfma(qchunk8(d->wr, d->g, c), d->s, d->o); }
#if defined(__AVX512F__)
typedef struct { vf table; __m512i wide; } dq4_t;
static inline void dq4_prep(dq4_t* d, const uint8_t* wr, int g, float s, float o) {
    const vf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    d->table = _mm512_fmadd_ps(iota, vset(s), vset(o));
    d->wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(wr + g * 16)));
}
static inline vf dq4_chunk(const dq4_t* d, int c) {
    return _mm512_permutexvar_ps(c ? _mm512_srli_epi32(d->wide, 4) : d->wide, d->table);
}
#else
typedef dq8_t dq4_t;
#define dq4_prep dq8_prep
static inline vf dq4_chunk(const dq4_t* d, int c) { return vfma(qchunk4(d->wr, d->g, c), d->s, d->o); }
#endif

/* RT weight rows (from row r) × BT batch rows. Each row's group is dequantized once and
   reused for all BT batch rows; each x chunk is loaded once and reused for all RT rows; one
   horizontal sum per (row, batch row). */
#define TILE_FN(NAME, DQ, GB, RT, BT)                                                          \
static void NAME(const uint8_t* w, int64_t rb, const float* sc, const float* bi, const float* x, \
                 float* y, int r, int n, int ystride) {                                        \
    const int G = n / 32;                                                                      \
    const uint8_t* wr[RT];                                                                     \
    const float *scr[RT], *bir[RT];                                                            \
    vf acc[RT][BT];                                                                            \
    for (int i = 0; i < RT; i++) {                                                             \
        wr[i] = w + (int64_t)(r + i) * rb;                                                     \
        scr[i] = sc + (int64_t)(r + i) * G;                                                    \
        bir[i] = bi + (int64_t)(r + i) * G;                                                    \
        for (int k = 0; k < G; k += 16) {                                                      \
            __builtin_prefetch(scr[i] + PF_ROWS * G + k);                                      \
            __builtin_prefetch(bir[i] + PF_ROWS * G + k);                                      \
        }                                                                                      \
        for (int b = 0; b < BT; b++) acc[i][b] = vzero();                                      \
    }                                                                                          \
    for (int g = 0; g < G; g++) {                                                              \
        DQ##_t d[RT];                                                                          \
        for (int i = 0; i < RT; i++) {                                                         \
            if ((g * GB) % 64 == 0) __builtin_prefetch(wr[i] + g * GB + PF_BYTES);             \
            DQ##_prep(&d[i], wr[i], g, scr[i][g], bir[i][g]);                                  \
        }                                                                                      \
        for (int c = 0; c < NCH; c++) {                                                        \
            vf wv[RT];                                                                         \
            for (int i = 0; i < RT; i++) wv[i] = DQ##_chunk(&d[i], c);                         \
            for (int b = 0; b < BT; b++) {                                                     \
                const vf xv = vload(x + (int64_t)b * n + g * 32 + c * VL);                     \
                for (int i = 0; i < RT; i++) acc[i][b] = vfma(wv[i], xv, acc[i][b]);           \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int i = 0; i < RT; i++)                                                               \
        for (int b = 0; b < BT; b++) y[(int64_t)b * ystride + r + i] = vsum(acc[i][b]);        \
}

#define TILES(Q, DQ, GB)                                                                   \
TILE_FN(q##Q##_r1b1, DQ, GB, 1, 1) TILE_FN(q##Q##_r1b2, DQ, GB, 1, 2)                  \
TILE_FN(q##Q##_r1b3, DQ, GB, 1, 3) TILE_FN(q##Q##_r1b4, DQ, GB, 1, 4)                  \
TILE_FN(q##Q##_rNb1, DQ, GB, RT_MAX, 1) TILE_FN(q##Q##_rNb2, DQ, GB, RT_MAX, 2)        \
TILE_FN(q##Q##_rNb3, DQ, GB, RT_WIDE, 3)                                 \
TILE_FN(q##Q##_rNb4, DQ, GB, RT_WIDE, 4)                                 \
typedef void (*tile_fn)(const uint8_t*, int64_t, const float*, const float*, const float*,     \
                        float*, int, int, int);
TILES(8, dq8, 32)
TILES(4, dq4, 16)

static const tile_fn ONE_ROW[2][4] = {{q8_r1b1, q8_r1b2, q8_r1b3, q8_r1b4}, {q4_r1b1, q4_r1b2, q4_r1b3, q4_r1b4}};
static const tile_fn MANY_ROWS[2][4] = {{q8_rNb1, q8_rNb2, q8_rNb3, q8_rNb4}, {q4_rNb1, q4_rNb2, q4_rNb3, q4_rNb4}};
static int rows_per_tile(int bt) { return bt <= 2 ? RT_MAX : RT_WIDE; }

/* For 4-bit rows: x reordered per 32-group as [x0 x2 .. x30 | x1 x3 .. x31]. */
static void reorder4(const float* x, float* xr, int batch, int n) {
    for (int64_t j = 0; j < (int64_t)batch * n; j += 32)
        for (int k = 0; k < 16; k++) {
            xr[j + k] = x[j + 2 * k];
            xr[j + 16 + k] = x[j + 2 * k + 1];
        }
}

static void unpack_row(const uint8_t* wr, uint8_t* q, int n, int bits) {
    const uint64_t mask = (1u << bits) - 1u;
#if defined(__BMI2__) && defined(__AVX512F__)
    /* one bit deposit spreads 8 fields of `bits` bits into 8 bytes (fast wherever AVX-512 is: the CPUs
       with a slow microcoded pdep have no AVX-512, and they keep the shift loop) */
    const uint64_t spread = mask * 0x0101010101010101ull;
    for (int j = 0; j < n / 8; j++) {
        uint64_t word = 0;
        memcpy(&word, wr + (int64_t)j * bits, bits);
        const uint64_t bytes = _pdep_u64(word, spread);
        memcpy(q + j * 8, &bytes, 8);
    }
#else
    for (int j = 0; j < n / 8; j++) {
        uint64_t word = 0;
        memcpy(&word, wr + (int64_t)j * bits, bits);
        for (int i = 0; i < 8; i++) q[j * 8 + i] = (uint8_t)((word >> (bits * i)) & mask);
    }
#endif
}

/* rows [r0, r1) of one matrix against all batch rows (x reordered when bits == 4) */
static void rows_range(const uint8_t* w, const float* sc, const float* bi, const float* x, float* y,
                       int r0, int r1, int n, int batch, int ystride, int bits, uint8_t* scratch) {
    const int G = n / 32;
    const int64_t rb = (int64_t)n * bits / 8;
    if (bits != 4 && bits != 8) {  /* other widths: RT_MAX rows unpacked to bytes once, then the 8-bit tiles */
        for (int u = r0; u < r1; u += RT_MAX) {
            const int ur = r1 - u < RT_MAX ? r1 - u : RT_MAX;
            for (int i = 0; i < ur; i++) unpack_row(w + (u + i) * rb, scratch + (int64_t)i * n, n, bits);
            const float* su = sc + (int64_t)u * G;
            const float* bu = bi + (int64_t)u * G;
            for (int b0 = 0; b0 < batch; b0 += 4) {
                const int bt = batch - b0 < 4 ? batch - b0 : 4;
                const float* xb = x + (int64_t)b0 * n;
                float* yb = y + (int64_t)b0 * ystride + u;
                const int rt = rows_per_tile(bt);
                int r = 0;
                for (; r + rt <= ur; r += rt) MANY_ROWS[0][bt - 1](scratch, n, su, bu, xb, yb, r, n, ystride);
                for (; r < ur; r++) ONE_ROW[0][bt - 1](scratch, n, su, bu, xb, yb, r, n, ystride);
            }
        }
        return;
    }
    for (int b0 = 0; b0 < batch; b0 += 4) {
        const int bt = batch - b0 < 4 ? batch - b0 : 4;
        const float* xb = x + (int64_t)b0 * n;
        float* yb = y + (int64_t)b0 * ystride;
        const int k = bits == 4;
        const int rt = rows_per_tile(bt);
        int r = r0;
        for (; r + rt <= r1; r += rt) MANY_ROWS[k][bt - 1](w, rb, sc, bi, xb, yb, r, n, ystride);
        for (; r < r1; r++) ONE_ROW[k][bt - 1](w, rb, sc, bi, xb, yb, r, n, ystride);
    }
}

/* Thread-local scratch for the odd widths' unpacked row (each pool thread has its own). */
static __thread uint8_t* tl_scratch = NULL;
static __thread int tl_cap = 0;
static uint8_t* scratch_for(int n) {
    if (tl_cap < n + 64) {
        uint8_t* p = realloc(tl_scratch, (size_t)n + 64);
        if (!p) return NULL;
        tl_scratch = p;
        tl_cap = n + 64;
    }
    return tl_scratch;
}

/* One group call as a job over row blocks of BLOCK rows, numbered matrix by matrix (a block never
   straddles two matrices and starts at a multiple of BLOCK in its matrix, so the row tiles, and the
   results, do not depend on how the blocks are shared out). */
#define BLOCK 16
typedef struct {
    int nmat;
    const void* const* w; const void* const* sc; const void* const* bi;
    const int* rows; const int* bits; const int* col;
    const int* xrow; const int* nrow; /* per matrix: its input rows [xrow, xrow + nrow) of x; NULL: all batch rows */
    const float* x; const float* xr; float* y;
    int n, batch, ystride;
    _Atomic int failed;
} qjob;

static void qjob_blocks(void* p, int lo, int hi) {
    qjob* j = p;
    uint8_t* scratch = scratch_for(RT_MAX * j->n);
    if (!scratch) { j->failed = 1; return; }
    int base = 0;
    for (int m = 0; m < j->nmat && lo < hi; m++) {
        const int nb = (j->rows[m] + BLOCK - 1) / BLOCK;
        if (lo < base + nb) {
            const int b1 = hi < base + nb ? hi : base + nb;
            const int r0 = (lo - base) * BLOCK;
            const int r1 = (b1 - base) * BLOCK < j->rows[m] ? (b1 - base) * BLOCK : j->rows[m];
            const int64_t x0 = j->xrow ? j->xrow[m] : 0;
            rows_range((const uint8_t*)j->w[m], (const float*)j->sc[m], (const float*)j->bi[m],
                       (j->bits[m] == 4 ? j->xr : j->x) + x0 * j->n, j->y + x0 * j->ystride + j->col[m], r0, r1,
                       j->n, j->nrow ? j->nrow[m] : j->batch, j->ystride, j->bits[m], scratch);
            lo = b1;
        }
        base += nb;
    }
}


/* nmat matrices over rows of x [batch, n]: matrix m reads x rows [xrow[m], xrow[m] + nrow[m]) (all batch
   rows when xrow and nrow are NULL) and writes columns [col[m], col[m] + rows[m]) of the same rows of
   y [batch, ystride]. The row blocks are shared out over the pool's threads when one is set and the call is
   big enough. Returns 0, -1 when scratch memory could not be allocated, or -2 (nothing read or written)
   when the dims are impossible: no matrix, a width that is not a positive multiple of 32, an unknown bit
   width, a matrix whose columns do not lie inside y's row, or input rows outside x. */
static int qmv_run(int nmat, const void* const* w, const void* const* sc, const void* const* bi,
                   const int* rows, const int* bits, const int* col, const int* xrow, const int* nrow,
                   const float* x, float* y, int n, int batch, int ystride) {
    if (nmat <= 0 || n <= 0 || n % 32 || batch <= 0 || ystride <= 0 || !w || !sc || !bi || !rows || !bits ||
        !col || !x || !y || (!xrow) != (!nrow))
        return -2;
    for (int m = 0; m < nmat; m++) {
        const int b = bits[m];
        if (rows[m] <= 0 || col[m] < 0 || (int64_t)col[m] + rows[m] > ystride || !w[m] || !sc[m] || !bi[m] ||
            (b != 2 && b != 3 && b != 4 && b != 5 && b != 6 && b != 8))
            return -2;
        if (xrow && (xrow[m] < 0 || nrow[m] <= 0 || (int64_t)xrow[m] + nrow[m] > batch))
            return -2;
    }
    int need4 = 0, other = 0, blocks = 0;
    int64_t work = 0;
    for (int m = 0; m < nmat; m++) {
        need4 |= bits[m] == 4;
        other |= bits[m] != 4;
        blocks += (rows[m] + BLOCK - 1) / BLOCK;
        work += (int64_t)rows[m] * n * (nrow ? nrow[m] : batch);
    }
    /* the tiles load x a vector at a time: from a cache-line-aligned copy no load splits two lines
       (measured: a 4-bit call 8-10 % faster than from malloc's 16-byte alignment) */
    const size_t xbytes = (sizeof(float) * (size_t)batch * n + 63) / 64 * 64;
    const int copy = other && ((uintptr_t)x & 63);
    float* xr = need4 ? aligned_alloc(64, xbytes) : NULL;
    float* xa = copy ? aligned_alloc(64, xbytes) : NULL;
    if ((need4 && !xr) || (copy && !xa)) {
        free(xr);
        free(xa);
        return -1;
    }
    if (need4) reorder4(x, xr, batch, n);
    if (xa) memcpy(xa, x, sizeof(float) * (size_t)batch * n);
    qjob j = {nmat, w, sc, bi, rows, bits, col, xrow, nrow, xa ? xa : x, xr, y, n, batch, ystride, 0};
    pool_share(qjob_blocks, &j, blocks, work >= (1 << 17));
    free(xr);
    free(xa);
    return j.failed ? -1 : 0;
}

/* nmat matrices sharing the input x [batch, n]; matrix m writes columns [col[m], col[m] + rows[m]) of
   y [batch, ystride] (qmv_run's return codes). */
int qmv_group(int nmat, const void* const* w, const void* const* sc, const void* const* bi,
              const int* rows, const int* bits, const int* col, const float* x, float* y,
              int n, int batch, int ystride) {
    return qmv_run(nmat, w, sc, bi, rows, bits, col, NULL, NULL, x, y, n, batch, ystride);
}

/* Segments: matrix m over its own run of input rows [xrow[m], xrow[m] + nrow[m]) of x [batch, n], into the
   same rows of y (a mixture-of-experts layer's pairs sorted by expert: one matrix per expert that has
   pairs, its run those pairs' rows). Each output is the sum it would be in qmv_group. */
int qmv_segments(int nmat, const void* const* w, const void* const* sc, const void* const* bi,
                 const int* rows, const int* bits, const int* col, const int* xrow, const int* nrow,
                 const float* x, float* y, int n, int batch, int ystride) {
    if (!xrow || !nrow) return -2;
    return qmv_run(nmat, w, sc, bi, rows, bits, col, xrow, nrow, x, y, n, batch, ystride);
}

/* which row loop was compiled: 512 (AVX-512F), 256 (AVX2/FMA) or 0 (portable C) */
int simd_width(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}

/* Dequantization to float32 rows: out[r, i] = scale[r, g] * q[r, i] + bias[r, g] with the product rounded
   before the sum (no FMA), which is how MLX's own dequantize rounds, so a prefill's float32 copy of a
   weight equals mx.dequantize's bit for bit whichever of the two made it. 4-bit rows hold element 2j in the
   low nibble of byte j and 2j+1 in the high one; 8-bit rows one byte per element. */
typedef struct {
    const uint8_t* w; int64_t wstride; const float* sc; const float* bi; int64_t sstride;
    float* out; int64_t ostride; int rows, n, bits;
} dqjob;

__attribute__((optimize("fp-contract=off")))
static void dequant_row(const uint8_t* wr, const float* s, const float* o, float* y, int n, int bits) {
    for (int g = 0; g < n / 32; g++) {
        const float sg = s[g], og = o[g];
        float* yg = y + g * 32;
        if (bits == 4) {
            const uint8_t* b = wr + g * 16;
#if defined(__AVX512F__) || defined(__AVX2__)
            const __m128i v = _mm_loadu_si128((const __m128i*)b), m4 = _mm_set1_epi8(15);
            const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
            const __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi); /* elements 0-15, 16-31 */
#if defined(__AVX512F__)
            const __m512 vs = _mm512_set1_ps(sg), vo = _mm512_set1_ps(og);
            _mm512_storeu_ps(yg, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e0)), vs), vo));
            _mm512_storeu_ps(yg + 16, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e1)), vs), vo));
#else
            const __m256 vs = _mm256_set1_ps(sg), vo = _mm256_set1_ps(og);
            const __m128i parts[4] = {e0, _mm_srli_si128(e0, 8), e1, _mm_srli_si128(e1, 8)};
            for (int c = 0; c < 4; c++)
                _mm256_storeu_ps(yg + 8 * c, _mm256_add_ps(_mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[c])), vs), vo));
#endif
            continue;
#endif
            for (int j = 0; j < 16; j++) {
                const float lo = (float)(b[j] & 15), hi = (float)(b[j] >> 4);
                const float plo = sg * lo, phi = sg * hi;
                yg[2 * j] = plo + og;
                yg[2 * j + 1] = phi + og;
            }
        } else {
            const uint8_t* b = wr + g * 32;
            for (int j = 0; j < 32; j++) {
                const float p = sg * (float)b[j];
                yg[j] = p + og;
            }
        }
    }
}

static void dqjob_blocks(void* p, int lo, int hi) {
    const dqjob* j = p;
    for (int blk = lo; blk < hi; blk++) {
        const int r1 = (blk + 1) * BLOCK < j->rows ? (blk + 1) * BLOCK : j->rows;
        for (int r = blk * BLOCK; r < r1; r++)
            dequant_row(j->w + r * j->wstride, j->sc + r * j->sstride, j->bi + r * j->sstride,
                        j->out + r * j->ostride, j->n, j->bits);
    }
}

/* rows × n weights of 4 or 8 bits (row strides in bytes for w, in floats for the scales, biases and out)
   into out, the row blocks shared over the pool. Returns 0, or -2 (nothing written) for impossible dims. */
int dequant_rows(const void* w, int64_t wstride, const void* sc, const void* bi, int64_t sstride, void* out,
                 int64_t ostride, int rows, int n, int bits) {
    if (!w || !sc || !bi || !out || rows <= 0 || n <= 0 || n % 32 || (bits != 4 && bits != 8) ||
        wstride < (int64_t)n * bits / 8 || sstride < n / 32 || ostride < n)
        return -2;
    dqjob j = {w, wstride, sc, bi, sstride, out, ostride, rows, n, bits};
    pool_share(dqjob_blocks, &j, (rows + BLOCK - 1) / BLOCK, (int64_t)rows * n >= (1 << 16));
    return 0;
}
