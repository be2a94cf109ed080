/* The body of a kernel built by mx.fast.cuda_kernel (hf2q/kernels/cuda_qmv.py): MLX writes the
   signature from the inputs x, w, scales, biases and the output y, and the template arguments T_
   (input dtype), S_ (scale dtype), MAX_M_ (most rows), BITS_ and GS_ (group size). */
    /* runtime sizes: one compiled kernel per dtype, width and group size serves every matrix and row count */
    const int M = x_shape[0];
    const int K = x_shape[1];
    const long long N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const long long n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  /* one warp per output row */
    if (n >= N) return;
    constexpr int PER_WORD = 32 / BITS_;
    constexpr int VPC = 4 * PER_WORD;          /* values per 16-byte chunk: 16 (8-bit), 32 (4-bit) */
    constexpr int PER_LOAD = 16 / sizeof(T_);  /* inputs per 16-byte load */
    constexpr unsigned int MASK = (1u << BITS_) - 1u;
    const int chunks = K / VPC;
    const int G = K / GS_;
    const uint4* wrow = reinterpret_cast<const uint4*>(w) + n * chunks;
    const S_* srow = scales + n * G;
    const S_* brow = biases + n * G;
    float acc[MAX_M_];
#pragma unroll
    for (int m = 0; m < MAX_M_; ++m) acc[m] = 0.f;
    for (int c = lane; c < chunks; c += 32) {
        const uint4 q = wrow[c];
        const int k0 = c * VPC;
        const float s = static_cast<float>(srow[k0 / GS_]);
        const float b = static_cast<float>(brow[k0 / GS_]);
        const unsigned int words[4] = {q.x, q.y, q.z, q.w};
        float wv[VPC];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < PER_WORD; ++j)
                wv[i * PER_WORD + j] = fmaf(static_cast<float>((words[i] >> (BITS_ * j)) & MASK), s, b);
        }
#pragma unroll
        for (int m = 0; m < MAX_M_; ++m) {  /* x in 16-byte loads: a lane's VPC inputs are contiguous */
            if (m < M) {
                const uint4* xr = reinterpret_cast<const uint4*>(x + (long long)m * K + k0);
                float a = 0.f;
#pragma unroll
                for (int l = 0; l < VPC / PER_LOAD; ++l) {
                    const uint4 raw = xr[l];
                    const T_* xv = reinterpret_cast<const T_*>(&raw);
#pragma unroll
                    for (int j = 0; j < PER_LOAD; ++j) a = fmaf(wv[l * PER_LOAD + j], static_cast<float>(xv[j]), a);
                }
                acc[m] += a;
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MAX_M_; ++m) {
        if (m < M) {
            float v = acc[m];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0) y[(long long)m * N + n] = static_cast<T_>(v);
        }
    }
