/* The gated delta rule on the CPU (hf2q/kernels/cpu_gated_delta.py; numpy reference gated_delta_ref.py).

   Per value head h (reading key head h mod Hk) and token t, over the state S [Dv, Dk]:
       S <- gamma_t * S;  S <- S + beta_t * (v_t - S k_t) k_t^T;  y_t = S q_t.
   Row i of S only ever meets row i: it decays, gives (S k)_i, takes its own delta and gives (S q)_i. So a job
   is a block of RB rows of one head, kept in cache for every token of the call, the token's k and q read once
   for the block; blocks run in parallel over the shared pool, tokens stay in order. */
#include <stdint.h>
#include "pool_client.h"

#define BAD_DIMS (-2)
#define RB 8 /* state rows per job */

typedef struct {
    const float *q, *k, *v, *gamma, *beta;
    float *state, *y;
    int B, T, Hk, H, Dk, Dv;
} gd_job;

static void gd_blocks(void* p, int lo, int hi) {
    const gd_job* j = p;
    const int per_head = (j->Dv + RB - 1) / RB, Dk = j->Dk, Dv = j->Dv, H = j->H, Hk = j->Hk, T = j->T;
    for (int job = lo; job < hi; job++) {
        const int bh = job / per_head, r0 = (job % per_head) * RB;
        const int b = bh / H, h = bh % H, hk = h % Hk;
        const int nr = Dv - r0 < RB ? Dv - r0 : RB;
        float* S = j->state + ((int64_t)bh * Dv + r0) * Dk;
        for (int t = 0; t < T; t++) {
            const int64_t bt = (int64_t)b * T + t;
            const float* kt = j->k + (bt * Hk + hk) * Dk;
            const float* qt = j->q + (bt * Hk + hk) * Dk;
            const float* vt = j->v + (bt * H + h) * Dv + r0;
            float* yt = j->y + (bt * H + h) * Dv + r0;
            const float g = j->gamma[bt * H + h], be = j->beta[bt * H + h];
            for (int r = 0; r < nr; r++) {
                float* Sr = S + (int64_t)r * Dk;
                float rem = 0.0f;
                for (int c = 0; c < Dk; c++) {
                    Sr[c] *= g;
                    rem += Sr[c] * kt[c];
                }
                const float d = (vt[r] - rem) * be;
                float acc = 0.0f;
                for (int c = 0; c < Dk; c++) {
                    Sr[c] += d * kt[c];
                    acc += Sr[c] * qt[c];
                }
                yt[r] = acc;
            }
        }
    }
}

/* q, k [B, T, Hk, Dk]; v, y [B, T, H, Dv]; gamma, beta [B, T, H]; state [B, H, Dv, Dk] updated in place.
   Returns 0, or BAD_DIMS (nothing read or written) for impossible dims. */
int gated_delta(const float* q, const float* k, const float* v, const float* gamma, const float* beta,
                float* state, float* y, int B, int T, int Hk, int H, int Dk, int Dv) {
    if (!q || !k || !v || !gamma || !beta || !state || !y || B <= 0 || T <= 0 || Hk <= 0 || H <= 0 || Dk <= 0 ||
        Dv <= 0 || H % Hk)
        return BAD_DIMS;
    gd_job j = {q, k, v, gamma, beta, state, y, B, T, Hk, H, Dk, Dv};
    const int jobs = B * H * ((Dv + RB - 1) / RB);
    pool_share(gd_blocks, &j, jobs, (int64_t)B * H * Dv * Dk * T >= (1 << 16));
    return 0;
}
