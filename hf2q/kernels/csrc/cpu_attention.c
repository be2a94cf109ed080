/* Fused tiled prefill attention with an online softmax (hf2q/kernels/cpu_attention.py; numpy
   reference cpu_attention_ref.py). */
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef void (*sgemm_fn)(int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* Row kernels over [0, n): max, then in place exp(s - m) with the row sum returned.
   e^x = 2^n * p(r), r = x - n ln2, |r| <= ln2/2, p the degree-6 Taylor polynomial (relative
   error < 2e-7); x is clamped to [-88, 88], and -88 (so -inf) gives exactly 0. */
#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
static float row_max(const float* s, int n) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 16 <= n; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + j));
    if (j < n) vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(vm, (__mmask16)((1u << (n - j)) - 1u), s + j));
    return _mm512_reduce_max_ps(vm);
}
static float exp_row(float* s, int n, float m) {
    __m512 vs = _mm512_setzero_ps(), vm = _mm512_set1_ps(m);
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
        _mm512_storeu_ps(s + j, e);
        vs = _mm512_add_ps(vs, e);
    }
    if (j < n) {
        __mmask16 k = (__mmask16)((1u << (n - j)) - 1u);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vm));
        _mm512_mask_storeu_ps(s + j, k, e);
        vs = _mm512_mask_add_ps(vs, k, vs, e);
    }
    return _mm512_reduce_add_ps(vs);
}
#elif defined(__AVX2__)
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static float row_max(const float* s, int n) {
    int j = 0;
    float m = -INFINITY, t[8];
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
    _mm256_storeu_ps(t, vm);
    for (int i = 0; i < 8; i++) m = t[i] > m ? t[i] : m;
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}
static float exp_row(float* s, int n, float m) {
    int j = 0;
    float sum = 0.f, t[8];
    __m256 vs = _mm256_setzero_ps(), vm = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    _mm256_storeu_ps(t, vs);
    for (int i = 0; i < 8; i++) sum += t[i];
    for (; j < n; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    return sum;
}
#else
static float row_max(const float* s, int n) {
    float m = -INFINITY;
    for (int j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}
static float exp_row(float* s, int n, float m) {
    float sum = 0.f;
    for (int j = 0; j < n; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    return sum;
}
#endif

#if defined(__AVX512F__)
/* Register-blocked products for the common head sizes (a tile's M x nk x D is too small for
   BLAS to amortise its packing and call overhead; these reach ~1.4x its speed here).
   Rows come in blocks of MR; keys in blocks of 32 (two 16-float vectors). */
#define MR 6
#define FAST_PRODUCTS(D, Dv) ((Dv) % 64 == 0)

/* S[Mp, ls] = Qp[Mp, D] . Kp, Kp the key tile transposed into panels of 32 keys ([ls/32][D][32],
   zero-padded; one panel is read sequentially — a [D][ls] layout's large stride thrashed L1) */
static void qk_product(const float* qp, const float* kp, float* s, int Mp, int D, int ls) {
    for (int i = 0; i < Mp; i += MR)
        for (int j = 0; j < ls; j += 32) {
            __m512 c[MR][2];
#pragma GCC unroll 6
            for (int r = 0; r < MR; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
            const float* a = qp + (int64_t)i * D;
            const float* panel = kp + (int64_t)j * D;
            for (int d = 0; d < D; d++) {
                const __m512 b0 = _mm512_loadu_ps(panel + 32 * d);
                const __m512 b1 = _mm512_loadu_ps(panel + 32 * d + 16);
#pragma GCC unroll 6
                for (int r = 0; r < MR; r++) {
                    const __m512 x = _mm512_set1_ps(a[(int64_t)r * D + d]);
                    c[r][0] = _mm512_fmadd_ps(x, b0, c[r][0]);
                    c[r][1] = _mm512_fmadd_ps(x, b1, c[r][1]);
                }
            }
#pragma GCC unroll 6
            for (int r = 0; r < MR; r++) {
                _mm512_storeu_ps(s + (int64_t)(i + r) * ls + j, c[r][0]);
                _mm512_storeu_ps(s + (int64_t)(i + r) * ls + j + 16, c[r][1]);
            }
        }
}

/* O[Mp, Dv] += P[Mp, :nk] . V[nk, Dv]   (V rows straight from the cache, stride vstr) */
static void pv_product(const float* p, int ls, const float* v, int64_t vstr, float* o, int Mp, int nk, int Dv) {
    for (int i = 0; i < Mp; i += MR)
        for (int c0 = 0; c0 < Dv; c0 += 64) {
            __m512 c[MR][4];
#pragma GCC unroll 6
            for (int r = 0; r < MR; r++)
                for (int u = 0; u < 4; u++) c[r][u] = _mm512_loadu_ps(o + (int64_t)(i + r) * Dv + c0 + 16 * u);
            for (int j = 0; j < nk; j++) {
                const float* vr = v + (int64_t)j * vstr + c0;
                const __m512 b0 = _mm512_loadu_ps(vr), b1 = _mm512_loadu_ps(vr + 16);
                const __m512 b2 = _mm512_loadu_ps(vr + 32), b3 = _mm512_loadu_ps(vr + 48);
#pragma GCC unroll 6
                for (int r = 0; r < MR; r++) {
                    const __m512 x = _mm512_set1_ps(p[(int64_t)(i + r) * ls + j]);
                    c[r][0] = _mm512_fmadd_ps(x, b0, c[r][0]);
                    c[r][1] = _mm512_fmadd_ps(x, b1, c[r][1]);
                    c[r][2] = _mm512_fmadd_ps(x, b2, c[r][2]);
                    c[r][3] = _mm512_fmadd_ps(x, b3, c[r][3]);
                }
            }
#pragma GCC unroll 6
            for (int r = 0; r < MR; r++)
                for (int u = 0; u < 4; u++) _mm512_storeu_ps(o + (int64_t)(i + r) * Dv + c0 + 16 * u, c[r][u]);
        }
}
#else
#define MR 1
#define FAST_PRODUCTS(D, Dv) 0
static void qk_product(const float* qp, const float* kp, float* s, int Mp, int D, int ls) {}
static void pv_product(const float* p, int ls, const float* v, int64_t vstr, float* o, int Mp, int nk, int Dv) {}
#endif

/* One task = queries [t0, t1) of batch b against KV head g, all `rep` query heads stacked:
   row r = h * nq + (t - t0), padded to Mp rows (a multiple of MR). Strides in floats; head_dim
   rows are contiguous. scratch (floats): see scratch_size(). */
static void task(sgemm_fn sgemm, const float* q, const int64_t* qs, const float* k, const int64_t* ks,
                 const float* v, const int64_t* vs, float* out, const int32_t* lo, const int32_t* hi,
                 int b, int g, int t0, int t1, int H, int rep, int T, int D, int Dv, float scale, int tk,
                 float* scratch) {
    const int nq = t1 - t0, M = rep * nq, Mp = (M + MR - 1) / MR * MR, tkp = (tk + 31) / 32 * 32;
    const int fast = FAST_PRODUCTS(D, Dv);
    float* qp = scratch;
    float* s = qp + (int64_t)Mp * D;
    float* o = s + (int64_t)Mp * tkp;
    float* mx = o + (int64_t)Mp * Dv;
    float* l = mx + Mp;
    float* kp = l + Mp;
    const int32_t* rlo = lo + (int64_t)b * T;
    const int32_t* rhi = hi + (int64_t)b * T;
    int kmin = rlo[t0], kmax = rhi[t0], inner_lo = rlo[t0], inner_hi = rhi[t0];
    for (int t = t0; t < t1; t++) {
        if (rlo[t] < kmin) kmin = rlo[t];
        if (rhi[t] > kmax) kmax = rhi[t];
        if (rlo[t] > inner_lo) inner_lo = rlo[t];
        if (rhi[t] < inner_hi) inner_hi = rhi[t];
    }
    for (int h = 0; h < rep; h++)
        for (int t = t0; t < t1; t++) {
            const float* src = q + b * qs[0] + (int64_t)(g * rep + h) * qs[1] + (int64_t)t * qs[2];
            float* dst = qp + ((int64_t)h * nq + (t - t0)) * D;
            for (int d = 0; d < D; d++) dst[d] = src[d] * scale;
        }
    memset(qp + (int64_t)M * D, 0, sizeof(float) * (size_t)(Mp - M) * D);
    memset(o, 0, sizeof(float) * (size_t)Mp * Dv);
    for (int r = 0; r < M; r++) { mx[r] = -INFINITY; l[r] = 0.f; }
    const float* kg = k + b * ks[0] + (int64_t)g * ks[1];
    const float* vg = v + b * vs[0] + (int64_t)g * vs[1];
    for (int k0 = kmin; k0 < kmax; k0 += tk) {
        const int nk = (kmax - k0) < tk ? (kmax - k0) : tk, ls = (nk + 31) / 32 * 32;
        if (fast) {
            if (nk < ls) memset(kp + (int64_t)(ls - 32) * D, 0, sizeof(float) * 32 * D);
            for (int j = 0; j < nk; j++) {
                const float* kr = kg + (int64_t)(k0 + j) * ks[2];
                float* col = kp + (int64_t)(j & ~31) * D + (j & 31);
                for (int d = 0; d < D; d++) col[32 * d] = kr[d];
            }
            qk_product(qp, kp, s, Mp, D, ls);
        } else {
            sgemm(ROW_MAJOR, NO_TRANS, TRANS, M, nk, D, 1.0f, qp, D, kg + (int64_t)k0 * ks[2], (int)ks[2], 0.0f,
                  s, ls);
        }
        const int partial = !(k0 >= inner_lo && k0 + nk <= inner_hi);
        for (int r = 0; r < M; r++) {
            float* sr = s + (int64_t)r * ls;
            int a = 0, e = nk;  /* this row's allowed keys within the tile */
            if (partial) {
                const int t = t0 + r % nq;
                a = rlo[t] - k0 < 0 ? 0 : rlo[t] - k0;
                e = rhi[t] - k0 > nk ? nk : rhi[t] - k0;
                if (e <= a) { memset(sr, 0, sizeof(float) * nk); continue; }
                memset(sr, 0, sizeof(float) * a);
                memset(sr + e, 0, sizeof(float) * (nk - e));
            }
            const float tile_max = row_max(sr + a, e - a);
            const float m_new = tile_max > mx[r] ? tile_max : mx[r];
            const float alpha = expf(mx[r] - m_new);
            l[r] = l[r] * alpha + exp_row(sr + a, e - a, m_new);
            if (alpha != 1.0f) {
                float* orow = o + (int64_t)r * Dv;
                for (int d = 0; d < Dv; d++) orow[d] *= alpha;
            }
            mx[r] = m_new;
        }
        if (fast)
            pv_product(s, ls, vg + (int64_t)k0 * vs[2], vs[2], o, Mp, nk, Dv);
        else
            sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, M, Dv, nk, 1.0f, s, ls, vg + (int64_t)k0 * vs[2], (int)vs[2], 1.0f,
                  o, Dv);
    }
    for (int r = 0; r < M; r++) {
        const int h = r / nq, t = t0 + r % nq;
        float* dst = out + (((int64_t)b * T + t) * H + (g * rep + h)) * Dv;
        const float inv = l[r] > 0.f ? 1.0f / l[r] : 0.f;
        const float* orow = o + (int64_t)r * Dv;
        for (int d = 0; d < Dv; d++) dst[d] = orow[d] * inv;
    }
}

/* floats of scratch one worker needs for tiles of `rows` query rows and `tk` keys */
long scratch_size(int rows, int tk, int D, int Dv) {
    const long Mp = (rows + MR - 1) / MR * MR, tkp = (tk + 31) / 32 * 32;
    return Mp * (D + tkp + Dv + 2) + (long)D * tkp;
}

/* The SwiGLU activation in one pass, in place: g[i] = g[i] * u[i] / (1 + e^-g[i]). It lives here
   because it needs the same vectorised exp (numpy's five passes took 4-5 ns per element). */
void silu_mul(float* g, const float* u, long n) {
    long i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(g + i, _mm512_div_ps(_mm512_mul_ps(x, _mm512_loadu_ps(u + i)), _mm512_add_ps(one, e)));
    }
#elif defined(__AVX2__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_storeu_ps(g + i, _mm256_div_ps(_mm256_mul_ps(x, _mm256_loadu_ps(u + i)), _mm256_add_ps(one, e)));
    }
#endif
    for (; i < n; i++) g[i] = g[i] * u[i] / (1.0f + expf(-g[i]));
}

/* GeGLU-tanh in one pass, in place: g[i] = gelu_tanh(g[i]) * u[i], written as g·u / (1 + e^-2z) with
   z = √(2/π)(g + 0.044715 g³), since ½(1 + tanh z) = 1 / (1 + e^-2z): the vectorised exp serves it too
   (numpy's nine passes with its tanh were the largest cost after the products in a long Gemma 4 chunk). */
void gelu_tanh_mul(float* g, const float* u, long n) {
    const float c2 = -2.0f * 0.7978845608028654f, c3 = 0.044715f;
    long i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f), vc2 = _mm512_set1_ps(c2), vc3 = _mm512_set1_ps(c3);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 z = _mm512_fmadd_ps(_mm512_mul_ps(vc3, x), _mm512_mul_ps(x, x), x);
        const __m512 e = exp16(_mm512_mul_ps(vc2, z));
        _mm512_storeu_ps(g + i, _mm512_div_ps(_mm512_mul_ps(x, _mm512_loadu_ps(u + i)), _mm512_add_ps(one, e)));
    }
#elif defined(__AVX2__)
    const __m256 one = _mm256_set1_ps(1.0f), vc2 = _mm256_set1_ps(c2), vc3 = _mm256_set1_ps(c3);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 z = _mm256_fmadd_ps(_mm256_mul_ps(vc3, x), _mm256_mul_ps(x, x), x);
        const __m256 e = exp8(_mm256_mul_ps(vc2, z));
        _mm256_storeu_ps(g + i, _mm256_div_ps(_mm256_mul_ps(x, _mm256_loadu_ps(u + i)), _mm256_add_ps(one, e)));
    }
#endif
    for (; i < n; i++) {
        const float x = g[i], z = x + c3 * x * x * x, a = c2 * z;
        g[i] = x * u[i] / (1.0f + expf(a < 88.0f ? a : 88.0f));
    }
}

/* Tasks numbered (b, g, tile); workers share `next` and each takes the next task until none is
   left, so a worker on a core that another process is using simply does fewer. Later query
   tiles attend to more keys, so tasks are handed out last tile first (big ones early). */
int attend(void* sgemm, const float* q, const int64_t* qs, const float* k, const int64_t* ks, const float* v,
           const int64_t* vs, float* out, const int32_t* lo, const int32_t* hi, int B, int H, int Hkv, int T,
           int D, int Dv, float scale, int tq, int tk, int* next, float* scratch) {
    /* impossible dims: -2 before anything is read (the key ranges lo/hi are the caller's to bound) */
    if (!sgemm || !q || !qs || !k || !ks || !v || !vs || !out || !lo || !hi || !next || !scratch || B <= 0 ||
        H <= 0 || Hkv <= 0 || H % Hkv || T <= 0 || D <= 0 || Dv <= 0 || tq <= 0 || tk <= 0 || tk % 32)
        return -2;
    const int rep = H / Hkv, tiles = (T + tq - 1) / tq, n = B * Hkv * tiles;
    for (int i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED); i < n; i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) {
        const int ti = tiles - 1 - i / (B * Hkv), b = (i % (B * Hkv)) / Hkv, g = i % Hkv;
        const int t0 = ti * tq, t1 = t0 + tq < T ? t0 + tq : T;
        task((sgemm_fn)sgemm, q, qs, k, ks, v, vs, out, lo, hi, b, g, t0, t1, H, rep, T, D, Dv, scale, tk,
             scratch);
    }
    return 0;
}
