/* The body of a kernel built by mx.fast.cuda_kernel (hf2q/kernels/cuda_q8_attention.py): attention of a few
   query rows over an 8-bit K/V cache read as stored (split-K "flash decoding"). MLX writes the signature from
   the inputs q, kc, ks, vc, vs, mask and the outputs acc, mmax, lsum, and the template arguments:
     S_      the scales' dtype          D_ / DV_  key / value width     GK_ / GV_  their group sizes
     MAX_R_  most query rows per KV head (grouped-query heads × chunk tokens)     HAS_MASK_  mask given
   Inputs: q float32 [B·kv_heads, R, D_] (scaled, rotated), contiguous; kc/vc uint32 [B, kv_heads, T, D/4]
   packed codes (+128 offset, four per word) and ks/vs [B, kv_heads, T, D/group] scales, any strides along
   the first three axes (a cache buffer's live prefix is a slice); mask bool [B, L, T] (True = attend), row r
   of a KV head is token r % L. Each warp owns UNIT = 32·NC consecutive positions of one (batch, KV head) and
   writes its unnormalised partial (acc, running max, sum of exponentials); the caller merges the units. */
    const float NEG_INF = -__int_as_float(0x7f800000);
    constexpr int WARPS = 4;
    constexpr int KWORDS = D_ / 4;
    constexpr int VWORDS = DV_ / 4;
    constexpr int VW = (VWORDS + 31) / 32;   /* value words per lane */
    __shared__ float q_s[MAX_R_ * D_];
    __shared__ float p_s[WARPS][MAX_R_][32];

    const int R = q_shape[1];
    const int KVH = kc_shape[1];
    const int T = kc_shape[2];
    const long long BH = (long long)kc_shape[0] * KVH;
    int NC = (int)((T * BH + 32767) / 32768);  /* chunks of 32 per warp: enough warps to fill the GPU */
    if (NC < 1) NC = 1;
    const int UNIT = 32 * NC;
    const int U = (T + UNIT - 1) / UNIT;
    const int UG = (U + WARPS - 1) / WARPS;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const long long bh = blockIdx.x / UG;
    const int u = (int)(blockIdx.x % UG) * WARPS + warp;
    if (bh >= BH) return;
    const int b = (int)(bh / KVH), h = (int)(bh % KVH);

    for (int i = threadIdx.x; i < R * D_; i += blockDim.x) q_s[i] = q[bh * R * D_ + i];
    __syncthreads();
    if (u >= U) return;

    const uint32_t* kbase = kc + b * kc_strides[0] + h * kc_strides[1];
    const S_* ksbase = ks + b * ks_strides[0] + h * ks_strides[1];
    const uint32_t* vbase = vc + b * vc_strides[0] + h * vc_strides[1];
    const S_* vsbase = vs + b * vs_strides[0] + h * vs_strides[1];
    int L = 1;
    if (HAS_MASK_) L = mask_shape[1];

    float m_r[MAX_R_], l_r[MAX_R_], acc_r[MAX_R_][VW * 4];
#pragma unroll
    for (int r = 0; r < MAX_R_; ++r) {
        m_r[r] = NEG_INF;
        l_r[r] = 0.f;
#pragma unroll
        for (int i = 0; i < VW * 4; ++i) acc_r[r][i] = 0.f;
    }

    for (int c = 0; c < NC; ++c) {
        const int t_base = u * UNIT + c * 32;
        if (t_base >= T) break;
        const int t = t_base + lane;
        /* scores: each lane one position, the whole key row, every query row at once */
        float dot[MAX_R_];
#pragma unroll
        for (int r = 0; r < MAX_R_; ++r) dot[r] = 0.f;
        if (t < T) {
            const uint4* krow = reinterpret_cast<const uint4*>(kbase + t * kc_strides[2]);
            const S_* srow = ksbase + t * ks_strides[2];
#pragma unroll 2
            for (int w = 0; w < KWORDS / 4; ++w) {  /* 16 values per load, inside one group */
                const uint4 q4 = krow[w];
                const float s = static_cast<float>(srow[(w * 16) / GK_]);
                const unsigned int words[4] = {q4.x, q4.y, q4.z, q4.w};
                float kv[16];
#pragma unroll
                for (int e = 0; e < 16; ++e)
                    kv[e] = (static_cast<float>((words[e >> 2] >> (8 * (e & 3))) & 255u) - 128.f) * s;
#pragma unroll
                for (int r = 0; r < MAX_R_; ++r) {
                    if (r < R) {
                        const float4* qr = reinterpret_cast<const float4*>(q_s + r * D_ + w * 16);
                        float a = 0.f;
#pragma unroll
                        for (int e4 = 0; e4 < 4; ++e4) {
                            const float4 qq = qr[e4];
                            a += qq.x * kv[4 * e4] + qq.y * kv[4 * e4 + 1] + qq.z * kv[4 * e4 + 2] + qq.w * kv[4 * e4 + 3];
                        }
                        dot[r] += a;
                    }
                }
            }
        }
        /* online softmax over this chunk of 32 positions, row by row */
#pragma unroll
        for (int r = 0; r < MAX_R_; ++r) {
            if (r >= R) break;
            bool ok = t < T;
            if (HAS_MASK_ && ok) ok = mask[((long long)b * L + (r % L)) * T + t];
            const float score = ok ? dot[r] : NEG_INF;
            float cm = score;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
            float p = 0.f;
            if (cm != NEG_INF) {
                const float nm = fmaxf(m_r[r], cm);
                const float corr = (m_r[r] == NEG_INF) ? 0.f : __expf(m_r[r] - nm);
                p = ok ? __expf(score - nm) : 0.f;
                float ps = p;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
                l_r[r] = l_r[r] * corr + ps;
#pragma unroll
                for (int i = 0; i < VW * 4; ++i) acc_r[r][i] *= corr;
                m_r[r] = nm;
            }
            p_s[warp][r][lane] = p;
        }
        __syncwarp();
        /* weighted values: each lane its value words, the chunk's positions in turn */
        const int n = min(32, T - t_base);
        for (int i = 0; i < n; ++i) {
            const int ti = t_base + i;
            const uint32_t* vrow = vbase + ti * vc_strides[2];
            const S_* vsrow = vsbase + ti * vs_strides[2];
#pragma unroll
            for (int w = 0; w < VW; ++w) {
                const int j = lane + 32 * w;
                if (j < VWORDS) {
                    const unsigned int word = vrow[j];
                    const float s = static_cast<float>(vsrow[(j * 4) / GV_]);
                    float vv[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) vv[e] = (static_cast<float>((word >> (8 * e)) & 255u) - 128.f) * s;
#pragma unroll
                    for (int r = 0; r < MAX_R_; ++r) {
                        if (r < R) {
                            const float pr = p_s[warp][r][i];
#pragma unroll
                            for (int e = 0; e < 4; ++e) acc_r[r][w * 4 + e] += pr * vv[e];
                        }
                    }
                }
            }
        }
        __syncwarp();
    }

    const long long cell = (bh * U + u) * R;
#pragma unroll
    for (int r = 0; r < MAX_R_; ++r) {
        if (r >= R) break;
#pragma unroll
        for (int w = 0; w < VW; ++w) {
            const int j = lane + 32 * w;
            if (j < VWORDS) {
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[(cell + r) * DV_ + j * 4 + e] = acc_r[r][w * 4 + e];
            }
        }
        if (lane == 0) {
            mmax[cell + r] = m_r[r];
            lsum[cell + r] = l_r[r];
        }
    }
