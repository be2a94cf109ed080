/* The body of the second kernel of hf2q/kernels/cuda_q8_attention.py: merges the per-warp partials of
   cuda_q8_attention.cu into the attention output. Inputs acc float32 [BH, U, R, DV_] (unnormalised sums),
   mmax / lsum float32 [BH, U, R] (each unit's running max and sum of exponentials); output out float32
   [BH, R, DV_]. One warp per (BH, R) row: the lanes find the row's max and weighted sum over the units,
   then each lane its output columns. A unit that saw no position has max -inf and weight 0. */
    const float NEG_INF = -__int_as_float(0x7f800000);
    const long long BH = acc_shape[0];
    const int U = acc_shape[1];
    const int R = acc_shape[2];
    const long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= BH * R) return;
    const long long bh = row / R;
    const int r = (int)(row % R);
    float top = NEG_INF;
    for (int u = lane; u < U; u += 32) top = fmaxf(top, mmax[(bh * U + u) * R + r]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    float den = 0.f;
    for (int u = lane; u < U; u += 32) {
        const float m = mmax[(bh * U + u) * R + r];
        if (m != NEG_INF) den += lsum[(bh * U + u) * R + r] * __expf(m - top);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
    const float inv = 1.f / den;
    for (int j = lane; j < DV_; j += 32) {
        float s = 0.f;
        for (int u = 0; u < U; ++u) {
            const float m = mmax[(bh * U + u) * R + r];
            if (m != NEG_INF) s += acc[((bh * U + u) * R + r) * DV_ + j] * __expf(m - top);
        }
        out[row * DV_ + j] = s * inv;
    }
