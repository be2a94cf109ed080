/* GGUF quantized blocks → MLX affine groups of 32 (hf2q/kernels/cpu_repack.py; the numpy reference is
   hf2q/engine/quant_repack.py, which this file must equal bit for bit).

   One call repacks a band of rows: src holds `rows` rows of GGUF blocks, `src_stride` bytes apart, each of
   `n` weights; the row's packed codes go to packed + r*packed_stride (bytes), its n/32 scales and biases to
   scales/biases + r*group_stride (floats). Exact types keep their codes (Q8_0 → 8 bits, Q4_0/Q4_K → 4,
   Q5_K → 5, or its codes one a byte with `wide`: the CPU's kernels read bytes far faster than 5-bit
   fields); Q6_K is dequantized as gguf-py does it and re-quantized to 8-bit min/max groups of 32, the
   numpy path's arithmetic in the same order (so no FMA contraction or reassociation may touch it: see the
   pragma below). */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BAD_DIMS (-2)

/* gguf's type ids (GGMLQuantizationType) */
enum { Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13); /* inf / nan */
    } else if (exp) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float f16_at(const uint8_t* p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

/* 32 codes (< 16) → 16 bytes, two a byte, the first in the low nibble */
static void pack4(const uint8_t* v, uint8_t* out) {
    for (int k = 0; k < 16; k++) out[k] = (uint8_t)(v[2 * k] | (v[2 * k + 1] << 4));
}

/* 32 codes (< 32) → 20 bytes: every 8 codes are 40 bits of a little-endian stream */
static void pack5(const uint8_t* v, uint8_t* out) {
    for (int c = 0; c < 4; c++) {
        uint64_t word = 0;
        for (int i = 0; i < 8; i++) word |= (uint64_t)v[8 * c + i] << (5 * i);
        for (int b = 0; b < 5; b++) out[5 * c + b] = (uint8_t)(word >> (8 * b));
    }
}

/* Q4_K / Q5_K's 12 bytes of 6-bit scales and mins → sc[8], m[8] */
static void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* m) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

static void row_q8_0(const uint8_t* b, int nb, uint8_t* packed, float* sc, float* bi) {
    for (int i = 0; i < nb; i++, b += 34) {
        const float d = f16_at(b);
        for (int j = 0; j < 32; j++) packed[32 * i + j] = (uint8_t)(b[2 + j] ^ 0x80u); /* int8 + 128 */
        sc[i] = d;
        bi[i] = -128.0f * d;
    }
}

static void row_q4_0(const uint8_t* b, int nb, uint8_t* packed, float* sc, float* bi) {
    uint8_t v[32];
    for (int i = 0; i < nb; i++, b += 18) {
        const float d = f16_at(b);
        for (int j = 0; j < 16; j++) {
            v[j] = b[2 + j] & 15;
            v[j + 16] = b[2 + j] >> 4;
        }
        pack4(v, packed + 16 * i);
        sc[i] = d;
        bi[i] = -8.0f * d;
    }
}

static void row_k(const uint8_t* b, int nb, int five, int wide, uint8_t* packed, float* sc, float* bi) {
    const int size = five ? 176 : 144, group_bytes = wide ? 32 : five ? 20 : 16;
    uint8_t s[8], m[8], v[32];
    for (int i = 0; i < nb; i++, b += size) {
        const float d = f16_at(b), dmin = f16_at(b + 2);
        k_scales(b + 4, s, m);
        const uint8_t* qh = b + 16;
        const uint8_t* qs = b + (five ? 48 : 16);
        for (int g = 0; g < 8; g++) { /* group g: nibble g&1 of the 32 bytes of chunk g>>1 */
            const uint8_t* q = qs + 32 * (g >> 1);
            for (int j = 0; j < 32; j++) {
                uint8_t c = (g & 1) ? (q[j] >> 4) : (q[j] & 15);
                if (five) c |= (uint8_t)(((qh[j] >> g) & 1) << 4);
                v[j] = c;
            }
            uint8_t* out = packed + (int64_t)(8 * i + g) * group_bytes;
            if (wide)
                memcpy(out, v, 32);
            else if (five)
                pack5(v, out);
            else
                pack4(v, out);
            sc[8 * i + g] = d * (float)s[g];
            bi[8 * i + g] = -(dmin * (float)m[g]);
        }
    }
}

/* one 32-weight group re-quantized to 8 bits over its min/max (quant_repack.requantize_8bit) */
static void requantize_group(const float* w, uint8_t* q, float* sc, float* bi) {
    float lo = w[0], hi = w[0];
    for (int j = 1; j < 32; j++) {
        lo = w[j] < lo ? w[j] : lo;
        hi = w[j] > hi ? w[j] : hi;
    }
    const float scale = (hi - lo) / 255.0f;
    const float safe = scale > 0.0f ? scale : 1.0f;
    for (int j = 0; j < 32; j++) {
        float c = rintf((w[j] - lo) / safe);
        c = c < 0.0f ? 0.0f : (c > 255.0f ? 255.0f : c);
        q[j] = (uint8_t)c;
    }
    *sc = scale;
    *bi = lo;
}

static void row_q6_k(const uint8_t* b, int nb, uint8_t* packed, float* sc, float* bi) {
    float w[256];
    for (int i = 0; i < nb; i++, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t* scales = (const int8_t*)(b + 192);
        const float d = f16_at(b + 208);
        for (int e = 0; e < 256; e++) { /* gguf-py's element order: half, then nibble / 2-bit lane */
            const int h = e >> 7, r = e & 127;
            const int low = (ql[64 * h + (r & 63)] >> (4 * (r >> 6))) & 15;
            const int high = (qh[32 * h + (r & 31)] >> (2 * (r >> 5))) & 3;
            const float ds = d * (float)scales[e >> 4];
            w[e] = ds * (float)((low | (high << 4)) - 32);
        }
        for (int g = 0; g < 8; g++)
            requantize_group(w + 32 * g, packed + 256 * i + 32 * g, sc + 8 * i + g, bi + 8 * i + g);
    }
}

/* Returns 0, or BAD_DIMS (nothing written) for an unknown type, a width that is not whole blocks, or a
   stride shorter than its row. */
int repack_rows(int qtype, const uint8_t* src, int64_t src_stride, int rows, int n, uint8_t* packed,
                int64_t packed_stride, float* scales, float* biases, int64_t group_stride, int wide) {
    int block, size, bits;
    switch (qtype) {
    case Q8_0: block = 32, size = 34, bits = 8; break;
    case Q4_0: block = 32, size = 18, bits = 4; break;
    case Q4_K: block = 256, size = 144, bits = 4; break;
    case Q5_K: block = 256, size = 176, bits = 5; break;
    case Q6_K: block = 256, size = 210, bits = 8; break;
    default: return BAD_DIMS;
    }
    if (wide && bits == 5) bits = 8;
    else wide = 0;
    if (rows <= 0 || n <= 0 || n % block || !src || !packed || !scales || !biases) return BAD_DIMS;
    const int nb = n / block;
    if (src_stride < (int64_t)nb * size || packed_stride < (int64_t)n * bits / 8 || group_stride < n / 32)
        return BAD_DIMS;
    for (int r = 0; r < rows; r++) {
        const uint8_t* b = src + r * src_stride;
        uint8_t* p = packed + r * packed_stride;
        float *sc = scales + r * group_stride, *bi = biases + r * group_stride;
        switch (qtype) {
        case Q8_0: row_q8_0(b, nb, p, sc, bi); break;
        case Q4_0: row_q4_0(b, nb, p, sc, bi); break;
        case Q4_K: row_k(b, nb, 0, 0, p, sc, bi); break;
        case Q5_K: row_k(b, nb, 1, wide, p, sc, bi); break;
        case Q6_K: row_q6_k(b, nb, p, sc, bi); break;
        }
    }
    return 0;
}
