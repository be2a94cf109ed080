/* The small per-layer ops of a host decode step (hf2q/kernels/cpu_decode_ops.py; numpy reference
   cpu_decode_ops_ref.py). */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>
#include "pool_client.h"

/* Every entry point returns 0, or BAD_DIMS without touching memory when its dims cannot describe
   the buffers (a non-positive count, a row stride shorter than the row it must hold). */
#define BAD_DIMS (-2)

static void rms_rows(const float* x, int64_t xs, const float* w, float* out, int64_t os, int B, int heads, int n,
                     float eps);

/* For b < B and h < heads: the n values at x + b*xs + h*n, scaled by 1/rms and w, go to
   out + b*os + h*n (in place allowed). heads > 1 covers per-head q/k norms. */
int rms_norm(const float* x, int64_t xs, const float* w, float* out, int64_t os, int B, int heads, int n, float eps) {
    if (B <= 0 || heads <= 0 || n <= 0 || xs < (int64_t)heads * n || os < (int64_t)heads * n || !x || !w || !out)
        return BAD_DIMS;
    rms_rows(x, xs, w, out, os, B, heads, n, eps);
    return 0;
}

static void rms_rows(const float* x, int64_t xs, const float* w, float* out, int64_t os, int B, int heads, int n,
                     float eps) {
    for (int b = 0; b < B; b++)
        for (int h = 0; h < heads; h++) {
            const float* v = x + b * xs + (int64_t)h * n;
            float* o = out + b * os + (int64_t)h * n;
            float ss = 0.f;
            for (int i = 0; i < n; i++) ss += v[i] * v[i];
            const float inv = 1.0f / sqrtf(ss / (float)n + eps);
            for (int i = 0; i < n; i++) o[i] = v[i] * inv * w[i];
        }
}

/* In place on heads vectors of D values at x + b*xs + h*D; cs [B, d]: cos in the first d/2,
   sin in the second. traditional: pairs (2i, 2i+1); else (i, i + d/2). Dims >= d pass through. */
int rope(float* x, int64_t xs, const float* cs, int B, int heads, int D, int d, int traditional) {
    if (B <= 0 || heads <= 0 || D <= 0 || d <= 0 || d % 2 || d > D || xs < (int64_t)heads * D || !x || !cs)
        return BAD_DIMS;
    const int half = d / 2;
    for (int b = 0; b < B; b++) {
        const float* c = cs + (int64_t)b * d;
        const float* s = c + half;
        for (int h = 0; h < heads; h++) {
            float* v = x + b * xs + (int64_t)h * D;
            if (traditional) {
                for (int i = 0; i < half; i++) {
                    const float x1 = v[2 * i], x2 = v[2 * i + 1];
                    v[2 * i] = x1 * c[i] - x2 * s[i];
                    v[2 * i + 1] = x1 * s[i] + x2 * c[i];
                }
            } else {
                for (int i = 0; i < half; i++) {
                    const float x1 = v[i], x2 = v[i + half];
                    v[i] = x1 * c[i] - x2 * s[i];
                    v[i + half] = x1 * s[i] + x2 * c[i];
                }
            }
        }
    }
    return 0;
}

/* exp(x) for x in [-87, 88] (clamped), ~2 ulp: 2^n · p(r) with r = x - n·ln2 split in two
   parts and a degree-6 polynomial. Plain C with no calls, so loops over it vectorize. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_roundf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.3888889e-3f;
    p = p * r + 8.3333333e-3f;
    p = p * r + 4.1666667e-2f;
    p = p * r + 1.6666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* out[j] = scale · (q · K[j]) for j < n (K rows of D floats); acc: added to out[j] instead. With AVX-512 and D % 16 == 0,
   four rows at a time whose four horizontal sums share one shuffle tree (for head_dim 64 the
   sums, not the FMAs, were most of the work). */
static void scores(const float* q, const float* K, int D, int n, float scale, float* out, int acc) {
    int j = 0;
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        for (; j + 4 <= n; j += 4) {
            const float* k0 = K + (int64_t)j * D;
            __builtin_prefetch(k0 + 16 * D);
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int i = 0; i < D; i += 16) {
                const __m512 qv = _mm512_loadu_ps(q + i);
                a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + i), a0);
                a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + D + i), a1);
                a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + 2 * D + i), a2);
                a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + 3 * D + i), a3);
            }
            /* per 128-bit block: [a0 a1 a2 a3] partial sums, then the four blocks added */
            const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
            const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
            const __m512d d01 = _mm512_castps_pd(t01), d23 = _mm512_castps_pd(t23);
            const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                                           _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
            const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u),
                                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
            const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            const __m128 sc = _mm_mul_ps(s4, _mm_set1_ps(scale));
            _mm_storeu_ps(out + j, acc ? _mm_add_ps(_mm_loadu_ps(out + j), sc) : sc);
        }
    }
#endif
    for (; j < n; j++) {
        const float* kj = K + (int64_t)j * D;
        float dot = 0.f;
        for (int i = 0; i < D; i++) dot += q[i] * kj[i];
        out[j] = acc ? out[j] + dot * scale : dot * scale;
    }
}

/* o = Σ_j p[j] · V[j] over n rows of D floats. With AVX-512 and D % 64 == 0: 64 columns at a
   time held in registers, two rows per step into separate accumulators (FMA latency). */
static void weighted_sum(const float* p, const float* V, int D, int n, float* o) {
#if defined(__AVX512F__)
    if (D % 64 == 0) {
        for (int i0 = 0; i0 < D; i0 += 64) {
            __m512 a[8];
            for (int k = 0; k < 8; k++) a[k] = _mm512_setzero_ps();
            int j = 0;
            for (; j + 2 <= n; j += 2) {
                const float* v0 = V + (int64_t)j * D + i0;
                const float* v1 = v0 + D;
                __builtin_prefetch(v0 + 16 * D);
                const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
                for (int k = 0; k < 4; k++) {
                    a[k] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * k), a[k]);
                    a[4 + k] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * k), a[4 + k]);
                }
            }
            if (j < n) {
                const __m512 p0 = _mm512_set1_ps(p[j]);
                for (int k = 0; k < 4; k++)
                    a[k] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(V + (int64_t)j * D + i0 + 16 * k), a[k]);
            }
            for (int k = 0; k < 4; k++) _mm512_storeu_ps(o + i0 + 16 * k, _mm512_add_ps(a[k], a[4 + k]));
        }
        return;
    }
#endif
    for (int i = 0; i < D; i++) o[i] = 0.f;
    for (int j = 0; j < n; j++) {
        const float* vj = V + (int64_t)j * D;
        for (int i = 0; i < D; i++) o[i] += p[j] * vj[i];
    }
}


/* s[x] <- exp(s[x] - max s) in place; *m = the max, *sum = Σ of the results. Three passes, so the exp
   pass has no loop-carried sum and vectorizes like the rest of exp_approx's loops; the max and the sum
   run in 16 lanes (the sum's order is then lane-wise, not left to right). With a scalar sum the
   softmax was most of a short chunk's work (head_dim 64: 2 × 64 FMAs per position against ~20 scalar
   operations per position). */
static void exp_shifted(float* s, int len, float* m_out, float* sum_out) {
    float m = -INFINITY, sum = 0.f;
    int x = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; x + 16 <= len; x += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + x));
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; x < len; x++) m = s[x] > m ? s[x] : m;
    for (x = 0; x < len; x++) s[x] = exp_approx(s[x] - m);
    x = 0;
#if defined(__AVX512F__)
    __m512 sv = _mm512_setzero_ps();
    for (; x + 16 <= len; x += 16) sv = _mm512_add_ps(sv, _mm512_loadu_ps(s + x));
    sum = _mm512_reduce_add_ps(sv);
#endif
    for (; x < len; x++) sum += s[x];
    *m_out = m;
    *sum_out = sum;
}

static __thread float* tl_S = NULL;
static __thread int64_t tl_S_cap = 0;

/* The attention of every row is cut into work items (KV head kh, chunk c of CH positions, row b),
   numbered with b fastest so the rows of one prefill, which share a cache, read each K/V chunk
   while it is still in cache. An item leaves, for each query head of kh, the chunk's running max
   m, its sum l of exp(s - m) and the unnormalised o = sum exp(s - m) V: [m, l, o[D]]. */
typedef struct {
    const float* qkv; int64_t qs; float* const* kc; float* const* vc; const int* cap; const int* pos;
    int window, B, H, Hkv, D, CH, nch; float scale;
    float* part; /* [Hkv, nch, B, rep, D + 2] */
    /* a head stored as `pieces` cache heads of D / pieces each (KV head kh's piece i is cache head
       kh * pieces + i); base[b]: the first position row b's cache holds (NULL: 0) */
    int pieces; const int* base;
    _Atomic int failed;
    /* an 8-bit cache (attend_q8): codes [Hkv, cap, D] and scales [Hkv, cap, D / G]; kc/vc unused */
    uint8_t* const* kq; float* const* ks; uint8_t* const* vq; float* const* vs; int G;
} attn_job;

/* The 8-bit twins of scores and weighted_sum: a row is codes c (offset 128) and one scale per G
   values, read as stored — scale · Σ_g s_g Σ_{i in g} q_i (c_i − 128), o += p_j s_jg (c_ji − 128). */
static void scores_q8(const float* q, const uint8_t* K, const float* S, int D, int G, int n, float scale,
                      float* out) {
    const int ng = D / G;
    for (int j = 0; j < n; j++) {
        const uint8_t* kj = K + (int64_t)j * D;
        float dot = 0.f;
        for (int g = 0; g < ng; g++) {
            float part = 0.f;
            for (int i = g * G; i < (g + 1) * G; i++) part += q[i] * (float)((int)kj[i] - 128);
            dot += part * S[(int64_t)j * ng + g];
        }
        out[j] = dot * scale;
    }
}

static void weighted_sum_q8(const float* p, const uint8_t* V, const float* S, int D, int G, int n, float* o) {
    const int ng = D / G;
    for (int i = 0; i < D; i++) o[i] = 0.f;
    for (int j = 0; j < n; j++) {
        const uint8_t* vj = V + (int64_t)j * D;
        for (int g = 0; g < ng; g++) {
            const float w = p[j] * S[(int64_t)j * ng + g];
            for (int i = g * G; i < (g + 1) * G; i++) o[i] += w * (float)((int)vj[i] - 128);
        }
    }
}

/* x [D] → codes [D] and scales [D / G] at row `at` of a cache: per group s = max|x| / 127, code
   rint(x / s) + 128 in [1, 255] (s = 0: every code 128) — KvCodec.encode's arithmetic in float32. */
static void quantize_row(const float* x, int D, int G, uint8_t* codes, float* scales) {
    for (int g = 0; g < D / G; g++) {
        float m = 0.f;
        for (int i = g * G; i < (g + 1) * G; i++) m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
        const float sc = m / 127.0f, safe = sc == 0.f ? 1.0f : sc;
        for (int i = g * G; i < (g + 1) * G; i++) {
            float c = rintf(x[i] / safe);
            c = c < -127.f ? -127.f : c > 127.f ? 127.f : c;
            codes[i] = (uint8_t)((int)c + 128);
        }
        scales[g] = sc;
    }
}

static void attn_items(void* p, int lo, int hi) {
    attn_job* j = p;
    const int rep = j->H / j->Hkv, D = j->D, B = j->B;
    if (tl_S_cap < (int64_t)j->CH * rep) {
        float* S = realloc(tl_S, sizeof(float) * (size_t)j->CH * rep);
        if (!S) { j->failed = 1; return; }
        tl_S = S;
        tl_S_cap = (int64_t)j->CH * rep;
    }
    float* S = tl_S;
    for (int it = lo; it < hi; it++) {
        const int b = it % B, c = (it / B) % j->nch, kh = it / B / j->nch;
        float* part = j->part + (int64_t)it * rep * (D + 2);
        const int t = j->pos[b];
        const int first = j->window > 0 && t + 1 > j->window ? t + 1 - j->window : 0;
        const int c0 = c * j->CH > first ? c * j->CH : first;
        const int c1 = (c + 1) * j->CH < t + 1 ? (c + 1) * j->CH : t + 1;
        if (c1 <= c0) {
            for (int r = 0; r < rep; r++) { part[r * (D + 2)] = -INFINITY; part[r * (D + 2) + 1] = 0.f; }
            continue;
        }
        const int len = c1 - c0;
        const int64_t C = j->cap[b], at = (int64_t)kh * C + c0, ng = j->G ? D / j->G : 0;
        const float* qh = j->qkv + b * j->qs + (int64_t)kh * rep * D;
        if (j->kq) {
            for (int r = 0; r < rep; r++)
                scores_q8(qh + (int64_t)r * D, j->kq[b] + at * D, j->ks[b] + at * ng, D, j->G, len, j->scale,
                          S + (int64_t)r * len);
            for (int r = 0; r < rep; r++) {
                float* sr = S + (int64_t)r * len;
                float* pr = part + r * (D + 2);
                exp_shifted(sr, len, pr, pr + 1);
                weighted_sum_q8(sr, j->vq[b] + at * D, j->vs[b] + at * ng, D, j->G, len, pr + 2);
            }
            continue;
        }
        const int m = j->pieces, P = D / m;
        const int64_t row0 = c0 - (j->base ? j->base[b] : 0);  /* the chunk's first row in the buffer */
        for (int r = 0; r < rep; r++)
            for (int i = 0; i < m; i++)
                scores(qh + (int64_t)r * D + (int64_t)i * P, j->kc[b] + (((int64_t)kh * m + i) * C + row0) * P, P,
                       len, j->scale, S + (int64_t)r * len, i > 0);
        for (int r = 0; r < rep; r++) {
            float* sr = S + (int64_t)r * len;
            float* pr = part + r * (D + 2);
            exp_shifted(sr, len, pr, pr + 1);
            for (int i = 0; i < m; i++)
                weighted_sum(sr, j->vc[b] + (((int64_t)kh * m + i) * C + row0) * P, P, len, pr + 2 + (int64_t)i * P);
        }
    }
}

/* One new position per row. qkv row b (stride qs) holds q [H, D], k [Hkv, D], v [Hkv, D].
   First every row's k/v is written into its cache kc[b], vc[b] ([Hkv, cap[b], D]) at pos[b]
   (rows may share a cache: the positions of one prefill chunk, each attending to the ones
   before it); then each query head h attends (softmax(scale * q.K)) over positions
   [lo, pos[b]] of KV head h / (H / Hkv), lo = pos - window + 1 when window > 0. out [B, H*D].
   The work is shared over the pool in chunks of positions (flash-decoding: per-chunk max and
   sum, combined exactly after), so one long sequence still uses every thread.
   Returns -1 when out of memory, BAD_DIMS when a head layout or a row's position cannot be
   right (checked before any cache is written: a position past its cache's capacity would write
   outside it). */
static int attend_rows(attn_job* j, float* out);

static int dims_bad(const float* qkv, int64_t qs, const void* kc, const void* vc, const int* cap, const int* pos,
                    int window, const float* out, int B, int H, int Hkv, int D) {
    if (B <= 0 || H <= 0 || Hkv <= 0 || H % Hkv || D <= 0 || window < 0 || qs < (int64_t)(H + 2 * Hkv) * D ||
        !qkv || !kc || !vc || !cap || !pos || !out)
        return 1;
    for (int b = 0; b < B; b++)
        if (cap[b] <= 0 || pos[b] < 0 || pos[b] >= cap[b]) return 1;
    return 0;
}

/* The attention of one layer's rows over its float32 K/V buffers: one new position per row (a row's
   buffers may be another row's too: the positions of one prefill chunk, each attending to the ones before
   it). A KV head of D floats is stored as `pieces` cache heads of D / pieces ([cache_heads, cap[b], D /
   pieces], KV head kh's piece i at cache head kh * pieces + i: Gemma 4's layout; 1 elsewhere), and row b's
   buffer holds positions [base[b], base[b] + cap[b]) (a sliding-window layer's keeps only its window: every
   position the row attends to must be there). With write, every row's k/v goes to its buffers at pos[b]
   first; write = 0 attends without storing (a KV-shared layer reads another layer's cache, its qkv row
   holding q alone). The rest as described above attend_rows. */
int attend_layer(const float* qkv, int64_t qs, float* const* kc, float* const* vc, const int* cap, const int* base,
                 const int* pos, int window, float* out, int B, int H, int Hkv, int D, int pieces, int write,
                 float scale) {
    if (B <= 0 || H <= 0 || Hkv <= 0 || H % Hkv || D <= 0 || window < 0 || pieces <= 0 || D % pieces ||
        qs < (int64_t)(H + (write ? 2 * Hkv : 0)) * D || !qkv || !kc || !vc || !cap || !base || !pos || !out)
        return BAD_DIMS;
    const int P = D / pieces;
    for (int b = 0; b < B; b++) {
        const int first = window > 0 && pos[b] + 1 > window ? pos[b] + 1 - window : 0;
        if (!kc[b] || !vc[b] || cap[b] <= 0 || base[b] < 0 || pos[b] < base[b] || first < base[b] ||
            pos[b] - base[b] >= cap[b])
            return BAD_DIMS;
    }
    for (int b = 0; write && b < B; b++) {
        const float* k = qkv + b * qs + (int64_t)H * D;
        const float* v = k + (int64_t)Hkv * D;
        const int64_t row = pos[b] - base[b];
        for (int kh = 0; kh < Hkv; kh++)
            for (int i = 0; i < pieces; i++) {
                const int64_t at = (((int64_t)kh * pieces + i) * cap[b] + row) * P;
                memcpy(kc[b] + at, k + (int64_t)kh * D + (int64_t)i * P, sizeof(float) * P);
                memcpy(vc[b] + at, v + (int64_t)kh * D + (int64_t)i * P, sizeof(float) * P);
            }
    }
    attn_job j = {.qkv = qkv, .qs = qs, .kc = kc, .vc = vc, .cap = cap, .pos = pos, .window = window, .B = B,
                  .H = H, .Hkv = Hkv, .D = D, .scale = scale, .pieces = pieces, .base = base};
    return attend_rows(&j, out);
}

/* attend over an 8-bit cache (--kv-cache-type q8, the rows already rotated for q8-rotated by the
   caller): each row's new k/v is quantized into its cache's codes kq/vq ([Hkv, cap, D] bytes) and
   scales ks/vs ([Hkv, cap, D / G] floats) at pos[b], then the rows attend over the codes as stored.
   G divides D (a group of G values per scale); one piece a head, every position from 0. The rest as
   attend_layer. */
int attend_q8(const float* qkv, int64_t qs, uint8_t* const* kq, float* const* ks, uint8_t* const* vq,
              float* const* vs, const int* cap, const int* pos, int window, float* out, int B, int H, int Hkv,
              int D, int G, float scale) {
    if (dims_bad(qkv, qs, kq, vq, cap, pos, window, out, B, H, Hkv, D) || !ks || !vs || G <= 0 || D % G)
        return BAD_DIMS;
    for (int b = 0; b < B; b++)
        if (!kq[b] || !vq[b] || !ks[b] || !vs[b]) return BAD_DIMS;
    const int ng = D / G;
    for (int b = 0; b < B; b++) {
        const float* k = qkv + b * qs + (int64_t)H * D;
        const float* v = k + (int64_t)Hkv * D;
        for (int kh = 0; kh < Hkv; kh++) {
            const int64_t at = (int64_t)kh * cap[b] + pos[b];
            quantize_row(k + (int64_t)kh * D, D, G, kq[b] + at * D, ks[b] + at * ng);
            quantize_row(v + (int64_t)kh * D, D, G, vq[b] + at * D, vs[b] + at * ng);
        }
    }
    attn_job j = {.qkv = qkv, .qs = qs, .cap = cap, .pos = pos, .window = window, .B = B, .H = H, .Hkv = Hkv,
                  .D = D, .scale = scale, .kq = kq, .ks = ks, .vq = vq, .vs = vs, .G = G, .pieces = 1};
    return attend_rows(&j, out);
}

/* The attention of rows whose K/V are in their caches (the job's CH, nch and part are set here). */
static int attend_rows(attn_job* job, float* out) {
    const int B = job->B, H = job->H, Hkv = job->Hkv, D = job->D, window = job->window;
    const int* pos = job->pos;
    const int rep = H / Hkv;
    int longest = 1;
    int64_t work = 0;
    for (int b = 0; b < B; b++) {
        const int t = pos[b];
        longest = t + 1 > longest ? t + 1 : longest;
        const int lo = window > 0 && t + 1 > window ? t + 1 - window : 0;
        work += (int64_t)(t + 1 - lo) * Hkv;
    }
    /* chunk length: about 8 items per thread, a multiple of 32 between 32 and 1024 positions */
    int64_t ch = work / ((int64_t)POOL_THREADS * 8) + 1;
    ch = (ch + 31) / 32 * 32;
    const int CH = ch < 32 ? 32 : ch > 1024 ? 1024 : (int)ch;
    const int nch = (longest + CH - 1) / CH;
    const int items = Hkv * nch * B;
    job->CH = CH;
    job->nch = nch;
    job->part = malloc(sizeof(float) * (size_t)items * rep * (D + 2));
    if (!job->part) return -1;
    pool_share(attn_items, job, items, work * D * rep >= (1 << 15));
    if (job->failed) { free(job->part); return -1; }
    /* combine the chunks of each (row, head): o = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c */
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int kh = h / rep, r = h % rep;
            float* o = out + ((int64_t)b * H + h) * D;
            float M = -INFINITY;
            for (int c = 0; c < nch; c++) {
                const float m = job->part[((int64_t)((kh * nch + c) * B + b) * rep + r) * (D + 2)];
                M = m > M ? m : M;
            }
            float L = 0.f;
            for (int i = 0; i < D; i++) o[i] = 0.f;
            for (int c = 0; c < nch; c++) {
                const float* pr = job->part + ((int64_t)((kh * nch + c) * B + b) * rep + r) * (D + 2);
                if (pr[1] == 0.f) continue;
                const float w = pr[0] == M ? 1.0f : exp_approx(pr[0] - M);
                L += w * pr[1];
                for (int i = 0; i < D; i++) o[i] += w * pr[2 + i];
            }
            const float inv = 1.0f / L;
            for (int i = 0; i < D; i++) o[i] *= inv;
        }
    free(job->part);
    return 0;
}

/* gu [B, 2F] = [gate | up] -> out [B, F] = act(gate) * up; kind 0: silu, 1: gelu (tanh form). */
int glu(const float* gu, float* out, int B, int F, int kind) {
    if (B <= 0 || F <= 0 || (kind != 0 && kind != 1) || !gu || !out) return BAD_DIMS;
    for (int b = 0; b < B; b++) {
        const float* g = gu + (int64_t)b * 2 * F;
        const float* u = g + F;
        float* o = out + (int64_t)b * F;
        if (kind == 0) {
            for (int i = 0; i < F; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
        } else {
            for (int i = 0; i < F; i++) {
                const float x = g[i];
                /* 1 + tanh(z) = 2 / (1 + exp(-2z)) */
                const float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
                o[i] = x / (1.0f + exp_approx(-2.0f * z)) * u[i];
            }
        }
    }
    return 0;
}

/* y += x over n values, then (when w) out = rms_norm(y) — the residual add fused with the next norm. */
int add_rms(float* y, const float* x, int64_t n_total, const float* w, float* out, int B, int n, float eps) {
    if (B <= 0 || n <= 0 || n_total != (int64_t)B * n || !y || !x || (w && !out)) return BAD_DIMS;
    for (int64_t i = 0; i < n_total; i++) y[i] += x[i];
    if (w) rms_rows(y, n, w, out, n, B, 1, n, eps);
    return 0;
}
