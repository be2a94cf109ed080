/* The body of a kernel built by mx.fast.cuda_kernel (hf2q/kernels/cuda_gated_delta.py): MLX writes
   the signature from the inputs q, k, v, gamma, beta, state_in and the outputs y, state_out, and the
   template arguments DK_ (key dim per head, a multiple of 32) and HK_ (key heads).

   One warp owns one row S[b, h, j, :] of the recurrent state for the whole chunk; each lane keeps
   DK_/32 of its entries in registers, so the state is read from and written to memory once per
   call however many tokens run. Per token the row decays, the warp reduces S·k, applies the delta
   update and reduces S·q for y[b, t, h, j]. Value head h reads key head h % HK_ (the tiled layout
   the converter leaves). Shapes: q, k [B, T, HK_, DK_]; v [B, T, H, Dv]; gamma, beta [B, T, H];
   state_in / state_out [B, H, Dv, DK_]; y [B, T, H, Dv]; all float32. */
    constexpr int PER_LANE = DK_ / 32;
    const int B = v_shape[0];
    const int T = v_shape[1];
    const int H = v_shape[2];
    const int DV = v_shape[3];
    const int lane = threadIdx.x & 31;
    const long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  /* (b, h, j) */
    if (row >= (long long)B * H * DV) return;
    const int j = (int)(row % DV);
    const int h = (int)((row / DV) % H);
    const int b = (int)(row / ((long long)DV * H));
    const int kh = h % HK_;

    float s[PER_LANE];
    const float* srow = state_in + row * DK_;
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) s[e] = srow[lane + 32 * e];

    for (int t = 0; t < T; ++t) {
        const long long qk_off = (((long long)b * T + t) * HK_ + kh) * DK_;
        const long long gh = ((long long)b * T + t) * H + h;
        const float g = gamma[gh];
        const float bt = beta[gh];
        const float vj = v[gh * DV + j];
        float kv = 0.f;
        float kk[PER_LANE];
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            kk[e] = k[qk_off + lane + 32 * e];
            s[e] *= g;
            kv += s[e] * kk[e];
        }
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) kv += __shfl_xor_sync(0xffffffffu, kv, m);
        const float d = (vj - kv) * bt;
        float yq = 0.f;
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            s[e] += kk[e] * d;
            yq += s[e] * q[qk_off + lane + 32 * e];
        }
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) yq += __shfl_xor_sync(0xffffffffu, yq, m);
        if (lane == 0) y[gh * DV + j] = yq;
    }

    float* orow = state_out + row * DK_;
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) orow[lane + 32 * e] = s[e];
