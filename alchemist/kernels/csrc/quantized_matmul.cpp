
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifndef ALCHEMIST_HAVE_BLAS
#define ALCHEMIST_HAVE_BLAS 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AQ_AVX2 1
#else
#define AQ_AVX2 0
#endif

/* VNNI's vpdpbusd (AVX-512 VNNI with VL, or AVX-VNNI): four u8 x s8 products summed into each int32 lane in one
   instruction, without saturating. Used for two or more activation rows of the 32-blocks (vnni_rows);
   -DALCHEMIST_VNNI=0 turns it off on a CPU that has it (the tests compare both). In the K-quants' panels
   vpdpwssd in place of madd + add measured no faster, so they keep the AVX2 sequence. */
#if AQ_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define AQ_VNNI_HW 1
#define aq_dpbusd(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif AQ_AVX2 && defined(__AVXVNNI__)
#define AQ_VNNI_HW 1
#define aq_dpbusd(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define AQ_VNNI_HW 0
#endif
#if defined(ALCHEMIST_VNNI) && !ALCHEMIST_VNNI
#define AQ_VNNI 0
#else
#define AQ_VNNI AQ_VNNI_HW
#endif

#include "iq_grids.h"

namespace alchemist_q {

typedef long long idx_t;

/* The weights stream from DRAM once per call: prefetch this far ahead of the block being read (the
   hardware prefetchers stop at 4 KB page boundaries; this took a 178 MB Q8_0 matvec from ~4 to ~12 GB/s). */
enum { PREFETCH = 4096 };

/* ------------------------------------------------------------------ scalars */
static inline float f16(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (e == 0x1f) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) {
        f = (float)m * 5.9604644775390625e-08f; /* m * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint32_t u32le(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* K-quant 6-bit scale / min j of 8 from the 12 packed bytes (llama.cpp get_scale_min_k4). */
static inline void k_scale_min(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ------------------------------------------------------------------ float vectors of VL lanes
   AVX-512: 16 lanes; AVX2+FMA: 8 lanes; otherwise a portable 8-lane struct (the compiler may vectorize) */
#if defined(__AVX512F__) && AQ_AVX2
enum { VL = 16 };
typedef __m512 vf;
static inline vf vf_zero() { return _mm512_setzero_ps(); }
static inline vf vf_q(const int8_t *q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline float vf_hsum(vf a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); /* l, l + 8 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));         /* + l + 4 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                                 /* + l + 2 */
    s = _mm_add_ss(s, _mm_movehdup_ps(s));                                                  /* + l + 1 */
    return _mm_cvtss_f32(s);
}
#elif AQ_AVX2
enum { VL = 8 };
typedef __m256 vf;
static inline vf vf_zero() { return _mm256_setzero_ps(); }
static inline vf vf_q(const int8_t *q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline void vf_store(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline float vf_hsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* l, l + 4 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                       /* + l + 2 */
    s = _mm_add_ss(s, _mm_movehdup_ps(s));                                        /* + l + 1 */
    return _mm_cvtss_f32(s);
}
#else
enum { VL = 8 };
struct vf { float v[8]; };
static inline vf vf_zero() { vf r; for (int l = 0; l < 8; ++l) r.v[l] = 0.0f; return r; }
static inline vf vf_q(const int8_t *q) { vf r; for (int l = 0; l < 8; ++l) r.v[l] = (float)q[l]; return r; }
static inline vf vf_load(const float *p) { vf r; for (int l = 0; l < 8; ++l) r.v[l] = p[l]; return r; }
static inline vf vf_mul(vf a, vf b) { vf r; for (int l = 0; l < 8; ++l) r.v[l] = a.v[l] * b.v[l]; return r; }
static inline vf vf_fma(vf a, vf b, vf c) { vf r; for (int l = 0; l < 8; ++l) r.v[l] = a.v[l] * b.v[l] + c.v[l]; return r; }
static inline vf vf_set1(float a) { vf r; for (int l = 0; l < 8; ++l) r.v[l] = a; return r; }
static inline vf vf_add(vf a, vf b) { vf r; for (int l = 0; l < 8; ++l) r.v[l] = a.v[l] + b.v[l]; return r; }
static inline void vf_store(float *p, vf a) { for (int l = 0; l < 8; ++l) p[l] = a.v[l]; }
static inline float vf_hsum(vf a) {
    float s[4];
    for (int l = 0; l < 4; ++l) s[l] = a.v[l] + a.v[l + 4];
    return ((s[0] + s[2]) + (s[1] + s[3]));
}
#endif

#if AQ_AVX2
static inline __m256i i8_set1(int v) { return _mm256_set1_epi8((char)v); }
/* byte j = 0xFF where bit j of the 32-bit little-endian word at p is set */
static inline __m256i bytes_from_bits_32(const uint8_t *p) {
    uint32_t x32;
    memcpy(&x32, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}
/* 16 bytes -> 32 bytes: low nibbles then high nibbles */
static inline __m256i nibbles_32(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, i8_set1(0xF));
}
static inline __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void store32(int8_t *q, __m256i v) { _mm256_storeu_si256((__m256i *)q, v); }
static inline __m256i srl8(__m256i v, int n, int mask) { /* (v >> n) & mask per byte */
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(n)), i8_set1(mask));
}
#endif

/* ------------------------------------------------------------------ block formats
   unpack(b, q, dl, mb): q[QK] int8 quants (returned pointer; may point into the block), dl[NSUB] scales,
   mb[NSUB] offsets (HAS_MIN only). */
struct Q8_0 {
    enum { QK = 32, BS = 34, SUB = 32, NSUB = 1, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *, float *dl, float *) {
        dl[0] = f16(b);
        return (const int8_t *)(b + 2);
    }
};

struct Q4_0 {
    enum { QK = 32, BS = 18, SUB = 32, NSUB = 1, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        dl[0] = f16(b);
#if AQ_AVX2
        store32(q, _mm256_sub_epi8(nibbles_32(b + 2), i8_set1(8)));
#else
        for (int j = 0; j < 16; ++j) {
            q[j] = (int8_t)((b[2 + j] & 0xF) - 8);
            q[j + 16] = (int8_t)((b[2 + j] >> 4) - 8);
        }
#endif
        return q;
    }
};

struct Q4_1 {
    enum { QK = 32, BS = 20, SUB = 32, NSUB = 1, HAS_MIN = 1 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *mb) {
        dl[0] = f16(b);
        mb[0] = f16(b + 2);
#if AQ_AVX2
        store32(q, nibbles_32(b + 4));
#else
        for (int j = 0; j < 16; ++j) {
            q[j] = (int8_t)(b[4 + j] & 0xF);
            q[j + 16] = (int8_t)(b[4 + j] >> 4);
        }
#endif
        return q;
    }
};

template <int MIN>
static inline void unpack_q5(const uint8_t *qh, const uint8_t *qs, int8_t *q) {
#if AQ_AVX2
    __m256i v = _mm256_or_si256(nibbles_32(qs), _mm256_and_si256(bytes_from_bits_32(qh), i8_set1(0x10)));
    if (!MIN) v = _mm256_sub_epi8(v, i8_set1(16));
    store32(q, v);
#else
    const uint32_t h = u32le(qh);
    for (int j = 0; j < 16; ++j) {
        q[j] = (int8_t)(((qs[j] & 0xF) | (((h >> j) & 1u) << 4)) - (MIN ? 0 : 16));
        q[j + 16] = (int8_t)(((qs[j] >> 4) | (((h >> (j + 16)) & 1u) << 4)) - (MIN ? 0 : 16));
    }
#endif
}

struct Q5_0 {
    enum { QK = 32, BS = 22, SUB = 32, NSUB = 1, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        dl[0] = f16(b);
        unpack_q5<0>(b + 2, b + 6, q);
        return q;
    }
};

struct Q5_1 {
    enum { QK = 32, BS = 24, SUB = 32, NSUB = 1, HAS_MIN = 1 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *mb) {
        dl[0] = f16(b);
        mb[0] = f16(b + 2);
        unpack_q5<1>(b + 4, b + 8, q);
        return q;
    }
};

struct Q2_K {
    enum { QK = 256, BS = 84, SUB = 16, NSUB = 16, HAS_MIN = 1 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *mb) {
        const uint8_t *sc = b, *qs = b + 16;
        const float d = f16(b + 80), dmin = f16(b + 82);
        for (int k = 0; k < 16; ++k) {
            dl[k] = d * (float)(sc[k] & 0xF);
            mb[k] = -(dmin * (float)(sc[k] >> 4));
        }
        for (int h = 0; h < 2; ++h) {
#if AQ_AVX2
            const __m256i v = load32(qs + 32 * h);
            for (int s = 0; s < 4; ++s) store32(q + h * 128 + s * 32, srl8(v, 2 * s, 3));
#else
            for (int s = 0; s < 4; ++s)
                for (int l = 0; l < 32; ++l) q[h * 128 + s * 32 + l] = (int8_t)((qs[h * 32 + l] >> (2 * s)) & 3);
#endif
        }
        return q;
    }
};

struct Q3_K {
    enum { QK = 256, BS = 110, SUB = 16, NSUB = 16, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
        const float d = f16(b + 108);
        for (int k = 0; k < 16; ++k) {
            const int low = k < 8 ? (sc[k] & 0xF) : (sc[k - 8] >> 4);
            const int high = (sc[8 + (k & 3)] >> (2 * (k >> 2))) & 3;
            dl[k] = d * (float)((low | (high << 4)) - 32);
        }
#if AQ_AVX2
        const __m256i hm = load32(hmask);
        for (int h = 0; h < 2; ++h) {
            const __m256i v = load32(qs + 32 * h);
            for (int s = 0; s < 4; ++s) {
                const __m256i bit = i8_set1(1 << (h * 4 + s));
                const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
                store32(q + h * 128 + s * 32, _mm256_sub_epi8(srl8(v, 2 * s, 3), _mm256_and_si256(clear, i8_set1(4))));
            }
        }
#else
        for (int h = 0; h < 2; ++h)
            for (int s = 0; s < 4; ++s)
                for (int l = 0; l < 32; ++l)
                    q[h * 128 + s * 32 + l] =
                        (int8_t)(((qs[h * 32 + l] >> (2 * s)) & 3) - (((hmask[l] >> (h * 4 + s)) & 1) ? 0 : 4));
#endif
        return q;
    }
};

template <int HIGH>
static inline const int8_t *unpack_q45k(const uint8_t *b, int8_t *q, float *dl, float *mb) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *qh = b + 16, *qs = HIGH ? b + 48 : b + 16;
    for (int j = 0; j < 8; ++j) {
        int sc, mn;
        k_scale_min(j, b + 4, &sc, &mn);
        dl[j] = d * (float)sc;
        mb[j] = -(dmin * (float)mn);
    }
#if AQ_AVX2
    const __m256i hbits = HIGH ? load32(qh) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
        const __m256i v = load32(qs + 32 * c);
        __m256i lo = _mm256_and_si256(v, i8_set1(0xF)), hi = srl8(v, 4, 0xF);
        if (HIGH) {
            const __m256i b0 = i8_set1(1 << (2 * c)), b1 = i8_set1(1 << (2 * c + 1));
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, b0), b0), i8_set1(0x10)));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, b1), b1), i8_set1(0x10)));
        }
        store32(q + 64 * c, lo);
        store32(q + 64 * c + 32, hi);
    }
#else
    for (int c = 0; c < 4; ++c)
        for (int a = 0; a < 2; ++a)
            for (int l = 0; l < 32; ++l) {
                int v = (qs[c * 32 + l] >> (4 * a)) & 0xF;
                if (HIGH) v |= ((qh[l] >> (2 * c + a)) & 1) << 4;
                q[(2 * c + a) * 32 + l] = (int8_t)v;
            }
#endif
    return q;
}

struct Q4_K {
    enum { QK = 256, BS = 144, SUB = 32, NSUB = 8, HAS_MIN = 1 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *mb) { return unpack_q45k<0>(b, q, dl, mb); }
};

struct Q5_K {
    enum { QK = 256, BS = 176, SUB = 32, NSUB = 8, HAS_MIN = 1 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *mb) { return unpack_q45k<1>(b, q, dl, mb); }
};

struct Q6_K {
    enum { QK = 256, BS = 210, SUB = 16, NSUB = 16, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        for (int k = 0; k < 16; ++k) dl[k] = d * (float)sc[k];
        for (int h = 0; h < 2; ++h) {
#if AQ_AVX2
            const __m256i l0 = load32(ql + 64 * h), l1 = load32(ql + 64 * h + 32), hv = load32(qh + 32 * h);
            const __m256i m32 = i8_set1(32);
            const __m256i lows[4] = {_mm256_and_si256(l0, i8_set1(0xF)), _mm256_and_si256(l1, i8_set1(0xF)), srl8(l0, 4, 0xF),
                                     srl8(l1, 4, 0xF)};
            for (int s = 0; s < 4; ++s) {
                const __m256i high = _mm256_slli_epi16(srl8(hv, 2 * s, 3), 4);
                store32(q + h * 128 + s * 32, _mm256_sub_epi8(_mm256_or_si256(lows[s], high), m32));
            }
#else
            for (int s = 0; s < 4; ++s)
                for (int l = 0; l < 32; ++l) {
                    const int lo = (ql[h * 64 + (s & 1) * 32 + l] >> (4 * (s >> 1))) & 0xF;
                    const int hi = (qh[h * 32 + l] >> (2 * s)) & 3;
                    q[h * 128 + s * 32 + l] = (int8_t)((lo | (hi << 4)) - 32);
                }
#endif
        }
        return q;
    }
};

/* MXFP4: one E8M0 exponent byte e, then 32 four-bit E2M1 codes (low nibbles, then high nibbles, as Q4_0).
   q = the doubled E2M1 value (kvalues_mxfp4), dl = 2^(e - 128) (ggml_e8m0_to_fp32_half): dl * q is exact. */
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

struct MXFP4 {
    enum { QK = 32, BS = 17, SUB = 32, NSUB = 1, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        dl[0] = e8m0_half(b[0]);
#if AQ_AVX2
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_MXFP4));
        store32(q, _mm256_shuffle_epi8(table, nibbles_32(b + 1)));
#else
        for (int j = 0; j < 16; ++j) {
            q[j] = KVALUES_MXFP4[b[1 + j] & 0xF];
            q[j + 16] = KVALUES_MXFP4[b[1 + j] >> 4];
        }
#endif
        return q;
    }
};

/* NVFP4: 64 weights as 4 sub-blocks of 16: four unsigned E4M3 scale bytes, then 32 bytes of four-bit E2M1 codes
   (sub-block s: low nibbles of bytes 8s..8s+7, then their high nibbles). q = the doubled E2M1 value
   (kvalues_mxfp4), dl[s] = the E4M3 value halved (ggml_ue4m3_to_fp32; 0 and 0x7F, its NaN, are 0): exact. */
static inline float ue4m3_half(uint8_t x) {
    if (x == 0 || x == 0x7F) return 0.0f;
    const int e = (x >> 3) & 0xF, m = x & 7;
    return (e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7)) * 0.5f;
}

struct NVFP4 {
    enum { QK = 64, BS = 36, SUB = 16, NSUB = 4, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        for (int s = 0; s < 4; ++s) {
            dl[s] = ue4m3_half(b[s]);
            for (int j = 0; j < 8; ++j) {
                q[16 * s + j] = KVALUES_MXFP4[b[4 + 8 * s + j] & 0xF];
                q[16 * s + 8 + j] = KVALUES_MXFP4[b[4 + 8 * s + j] >> 4];
            }
        }
        return q;
    }
};

/* Q1_0: an fp16 d, then 128 sign bits (weight j: bit j % 8 of byte j / 8, set +1, clear -1): q = +-1, dl = d
   for each of its four 32s. */
struct Q1_0 {
    enum { QK = 128, BS = 18, SUB = 32, NSUB = 4, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        const float d = f16(b);
        for (int j = 0; j < 128; ++j) q[j] = (b[2 + j / 8] >> (j % 8)) & 1 ? 1 : -1;
        for (int s = 0; s < 4; ++s) dl[s] = d;
        return q;
    }
};

/* IQ4_NL: an fp16 d, then 32 four-bit codes (low nibbles, then high nibbles, as Q4_0) into the non-linear grid
   kvalues_iq4nl: q = the grid value, dl = d. IQ4_XS: 256 weights as 8 such sub-blocks of 32 under one fp16 d
   (then scales_h, uint16, and scales_l[4]), sub-block s scaled by a 6-bit ls (its low 4 bits the nibble s & 1 of
   scales_l[s / 2], its high 2 bits bits 2s, 2s + 1 of scales_h): dl = d * (ls - 32), exact in float32. */
static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline void iq4_codes(const uint8_t *qs, int8_t *q) {
#if AQ_AVX2
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL));
    store32(q, _mm256_shuffle_epi8(table, nibbles_32(qs)));
#else
    for (int j = 0; j < 16; ++j) {
        q[j] = KVALUES_IQ4NL[qs[j] & 0xF];
        q[j + 16] = KVALUES_IQ4NL[qs[j] >> 4];
    }
#endif
}

struct IQ4_NL {
    enum { QK = 32, BS = 18, SUB = 32, NSUB = 1, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        dl[0] = f16(b);
        iq4_codes(b + 2, q);
        return q;
    }
};

/* the 6-bit scale of IQ4_XS sub-block s, minus 32 */
static inline int iq4_xs_scale(const uint8_t *b, int s) {
    const unsigned scales_h = (unsigned)b[2] | ((unsigned)b[3] << 8);
    return (int)(((b[4 + s / 2] >> (4 * (s & 1))) & 0xF) | (((scales_h >> (2 * s)) & 3) << 4)) - 32;
}

struct IQ4_XS {
    enum { QK = 256, BS = 136, SUB = 32, NSUB = 8, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        const float d = f16(b);
        for (int s = 0; s < 8; ++s) {
            dl[s] = d * (float)iq4_xs_scale(b, s);
            iq4_codes(b + 8 + 16 * s, q + 32 * s);
        }
        return q;
    }
};

/* a ternary block (TQ2_0, TQ1_0) unpacked: q = code - 1 (codes 0, 1, 2 from Q::codes), one scale d per 256 given
   as 8 equal sub-block scales */
template <class Q>
static inline const int8_t *ternary_unpack(const uint8_t *b, int8_t *q, float *dl) {
    const float d = f16(b + Q::D_AT);
    for (int s = 0; s < 8; ++s) dl[s] = d;
    Q::codes(b, q);
    for (int i = 0; i < 256; ++i) q[i] = (int8_t)(q[i] - 1);
    return q;
}

/* TQ2_0 (ternary): 64 bytes of 2-bit codes, then an fp16 d. Bits 2n of byte b of 32-byte chunk j hold element
   128j + 32n + b as code c, weight d * (c - 1) (codes 0, 1, 2; a 3 decodes to 2 as gguf-py and ggml read it). */
struct TQ2_0 {
    enum { QK = 256, BS = 66, SUB = 32, NSUB = 8, HAS_MIN = 0, D_AT = 64 };
    /* the codes 0, 1, 2 in element order */
    static inline void codes(const uint8_t *b, int8_t *c) {
        for (int j = 0; j < 2; ++j)
            for (int n = 0; n < 4; ++n)
                for (int m = 0; m < 32; ++m) c[128 * j + 32 * n + m] = (int8_t)((b[32 * j + m] >> (2 * n)) & 3);
    }
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        return ternary_unpack<TQ2_0>(b, q, dl);
    }
};

/* TQ1_0 (ternary, 1.69 bits): 48 bytes of five base-3 digits each, 4 bytes of four, then an fp16 d. Digit n of a
   byte q is the top of 3 * (q * 3^n mod 256) in 8.8 fixed point (ggml's dequantize_row_tq1_0): byte m of the first
   32 holds elements 32n + m, byte m of the next 16 holds 160 + 16n + m, byte j of the last 4 holds 240 + 4n + j;
   weight d * (digit - 1). */
struct TQ1_0 {
    enum { QK = 256, BS = 54, SUB = 32, NSUB = 8, HAS_MIN = 0, D_AT = 52 };
    static inline int8_t trit(uint8_t q, int n) {
        static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
        const uint8_t shifted = (uint8_t)(q * pow3[n]);
        return (int8_t)(((uint16_t)shifted * 3) >> 8);
    }
    /* the digits 0, 1, 2 in element order */
    static inline void codes(const uint8_t *b, int8_t *c) {
        for (int n = 0; n < 5; ++n)
            for (int m = 0; m < 32; ++m) c[32 * n + m] = trit(b[m], n);
        for (int n = 0; n < 5; ++n)
            for (int m = 0; m < 16; ++m) c[160 + 16 * n + m] = trit(b[32 + m], n);
        for (int n = 0; n < 4; ++n)
            for (int j = 0; j < 4; ++j) c[240 + 4 * n + j] = trit(b[48 + j], n);
    }
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        return ternary_unpack<TQ1_0>(b, q, dl);
    }
};

/* The grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): every 8 (IQ2) or 4 (IQ3) weights are a grid entry of
   magnitudes (iq_grids.h) with a sign each, under an integer scale 2 * ls + 1 per 32 or per 16 weights and an fp16
   d per 256: weight = d * MULT * scale * sign * magnitude. codes() gives the signed magnitudes w (element order)
   and the scale of each 16 weights; unpack() the weights as the exact kernels take them (SUB 16). */
template <class Q>
static inline const int8_t *grid_unpack(const uint8_t *b, int8_t *q, float *dl) {
    int16_t sc[16];
    Q::codes(b, q, sc);
    const float d = Q::scale_d(b);
    for (int g = 0; g < 16; ++g) dl[g] = d * (float)sc[g] * Q::mult();
    return q;
}

/* the 8 magnitudes of `grid` row `index` with the signs of `bits` (bit j: weight j negative) */
static inline void signed_group(const uint8_t *row, unsigned bits, int n, int8_t *w) {
    for (int j = 0; j < n; ++j) w[j] = (int8_t)((bits >> j) & 1 ? -(int)row[j] : (int)row[j]);
}

/* IQ2_XXS: fp16 d, then per 32 weights 8 bytes: 4 grid indices (8 weights each), then a uint32 of four 7-bit sign
   indices (KSIGNS) and the 4-bit ls in its top bits */
struct IQ2_XXS {
    enum { QK = 256, BS = 66, SUB = 16, NSUB = 16, HAS_MIN = 0 };
    static inline float mult() { return 0.125f; }
    static inline float scale_d(const uint8_t *b) { return f16(b); }
    static inline void codes(const uint8_t *b, int8_t *w, int16_t *sc) {
        for (int s = 0; s < 8; ++s) {
            const uint8_t *p = b + 2 + 8 * s;
            uint32_t aux;
            memcpy(&aux, p + 4, 4);
            for (int j = 0; j < 4; ++j)
                signed_group(alchemist_iq::iq2_xxs_grid[p[j]], alchemist_iq::ksigns[(aux >> (7 * j)) & 127], 8,
                             w + 32 * s + 8 * j);
            sc[2 * s] = sc[2 * s + 1] = (int16_t)(2 * (aux >> 28) + 1);
        }
    }
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        return grid_unpack<IQ2_XXS>(b, q, dl);
    }
};

/* IQ2_XS: fp16 d, 32 uint16 (9-bit grid index, 7-bit sign index into KSIGNS; 8 weights each), 8 bytes of ls
   (low nibble for the first 16 weights of each 32, high for the second) */
struct IQ2_XS {
    enum { QK = 256, BS = 74, SUB = 16, NSUB = 16, HAS_MIN = 0 };
    static inline float mult() { return 0.125f; }
    static inline float scale_d(const uint8_t *b) { return f16(b); }
    static inline void codes(const uint8_t *b, int8_t *w, int16_t *sc) {
        for (int k = 0; k < 32; ++k) {
            const unsigned q = (unsigned)(b[2 + 2 * k] | (b[3 + 2 * k] << 8));
            signed_group(alchemist_iq::iq2_xs_grid[q & 511], alchemist_iq::ksigns[q >> 9], 8, w + 8 * k);
        }
        for (int s = 0; s < 8; ++s) {
            sc[2 * s] = (int16_t)(2 * (b[66 + s] & 15) + 1);
            sc[2 * s + 1] = (int16_t)(2 * (b[66 + s] >> 4) + 1);
        }
    }
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        return grid_unpack<IQ2_XS>(b, q, dl);
    }
};

/* IQ2_S: fp16 d, 32 low bytes of 10-bit grid indices, 32 sign bytes (8 weights each), 8 bytes of the indices' top
   2 bits (2 per group of a 32), 8 bytes of ls (low nibble: the first 16 weights of a 32, high: the second) */
struct IQ2_S {
    enum { QK = 256, BS = 82, SUB = 16, NSUB = 16, HAS_MIN = 0 };
    static inline float mult() { return 0.125f; }
    static inline float scale_d(const uint8_t *b) { return f16(b); }
    static inline void codes(const uint8_t *b, int8_t *w, int16_t *sc) {
        for (int s = 0; s < 8; ++s) {
            for (int j = 0; j < 4; ++j) {
                const unsigned index = b[2 + 4 * s + j] | ((b[66 + s] << (8 - 2 * j)) & 0x300);
                signed_group(alchemist_iq::iq2_s_grid[index], b[34 + 4 * s + j], 8, w + 32 * s + 8 * j);
            }
            sc[2 * s] = (int16_t)(2 * (b[74 + s] & 15) + 1);
            sc[2 * s + 1] = (int16_t)(2 * (b[74 + s] >> 4) + 1);
        }
    }
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        return grid_unpack<IQ2_S>(b, q, dl);
    }
};

/* IQ3_XXS: fp16 d, 64 grid indices (4 weights each), then per 32 weights a uint32 of four 7-bit sign indices
   (KSIGNS, 8 weights each) and the 4-bit ls in its top bits */
struct IQ3_XXS {
    enum { QK = 256, BS = 98, SUB = 16, NSUB = 16, HAS_MIN = 0 };
    static inline float mult() { return 0.25f; }
    static inline float scale_d(const uint8_t *b) { return f16(b); }
    static inline void codes(const uint8_t *b, int8_t *w, int16_t *sc) {
        for (int s = 0; s < 8; ++s) {
            uint32_t aux;
            memcpy(&aux, b + 66 + 4 * s, 4);
            for (int j = 0; j < 4; ++j) {
                const unsigned signs = alchemist_iq::ksigns[(aux >> (7 * j)) & 127];
                signed_group(alchemist_iq::iq3_xxs_grid[b[2 + 8 * s + 2 * j]], signs, 4, w + 32 * s + 8 * j);
                signed_group(alchemist_iq::iq3_xxs_grid[b[3 + 8 * s + 2 * j]], signs >> 4, 4, w + 32 * s + 8 * j + 4);
            }
            sc[2 * s] = sc[2 * s + 1] = (int16_t)(2 * (aux >> 28) + 1);
        }
    }
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        return grid_unpack<IQ3_XXS>(b, q, dl);
    }
};

/* IQ3_S: fp16 d, 64 low bytes of 9-bit grid indices (4 weights each), 8 bytes of their top bits (one per index of
   a 32), 32 bytes of sign bits, 4 bytes of ls (low nibble: the first 32 of a pair of 32s, high: the second) */
struct IQ3_S {
    enum { QK = 256, BS = 110, SUB = 16, NSUB = 16, HAS_MIN = 0 };
    static inline float mult() { return 1.0f; }
    static inline float scale_d(const uint8_t *b) { return f16(b); }
    static inline void codes(const uint8_t *b, int8_t *w, int16_t *sc) {
        for (int s = 0; s < 8; ++s) {
            for (int j = 0; j < 8; ++j) {
                const unsigned index = b[2 + 8 * s + j] | ((b[66 + s] << (8 - j)) & 256);
                signed_group(alchemist_iq::iq3_s_grid[index], b[74 + 4 * s + j / 2] >> (4 * (j & 1)), 4,
                             w + 32 * s + 4 * j);
            }
            const int ls = (b[106 + s / 2] >> (4 * (s & 1))) & 15;
            sc[2 * s] = sc[2 * s + 1] = (int16_t)(2 * ls + 1);
        }
    }
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        return grid_unpack<IQ3_S>(b, q, dl);
    }
};

/* IQ1_S and IQ1_M: groups of 8 weights from a grid of -1, 0, 1, each group shifted by +-1/8 (delta): weight =
   d * (2 ls + 1) * (g +- 1/8), written w = 8 g +- 1 with MULT 1/8 (as ggml's tiled matmul holds them).
   IQ1_S: fp16 d, 32 low bytes of 11-bit grid indices, per 32 weights a uint16 (3 index bits per group, ls in
   bits 12..14, the delta's sign in bit 15). IQ1_M: 32 low index bytes, per 16 weights a byte (3 index bits and
   the delta's sign per group of 8), 4 uint16 of 3-bit ls per 16 whose top nibbles hold the fp16 d. */
static inline void iq1_group(unsigned index, int negative, int8_t *w) {
    const int8_t *row = alchemist_iq::iq1_s_grid[index];
    for (int j = 0; j < 8; ++j) w[j] = (int8_t)(8 * row[j] + (negative ? -1 : 1));
}

struct IQ1_S {
    enum { QK = 256, BS = 50, SUB = 16, NSUB = 16, HAS_MIN = 0 };
    static inline float mult() { return 0.125f; }
    static inline float scale_d(const uint8_t *b) { return f16(b); }
    static inline unsigned qh(const uint8_t *b, int s) { return (unsigned)(b[34 + 2 * s] | (b[35 + 2 * s] << 8)); }
    static inline void codes(const uint8_t *b, int8_t *w, int16_t *sc) {
        for (int s = 0; s < 8; ++s) {
            const unsigned h = qh(b, s);
            for (int l = 0; l < 4; ++l) iq1_group(b[2 + 4 * s + l] | (((h >> (3 * l)) & 7) << 8), h & 0x8000, w + 32 * s + 8 * l);
            sc[2 * s] = sc[2 * s + 1] = (int16_t)(2 * ((h >> 12) & 7) + 1);
        }
    }
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        return grid_unpack<IQ1_S>(b, q, dl);
    }
};

struct IQ1_M {
    enum { QK = 256, BS = 56, SUB = 16, NSUB = 16, HAS_MIN = 0 };
    static inline float mult() { return 0.125f; }
    static inline unsigned sc16(const uint8_t *b, int k) { return (unsigned)(b[48 + 2 * k] | (b[49 + 2 * k] << 8)); }
    static inline float scale_d(const uint8_t *b) {
        const unsigned h = (sc16(b, 0) >> 12) | ((sc16(b, 1) >> 8) & 0x00f0) | ((sc16(b, 2) >> 4) & 0x0f00) | (sc16(b, 3) & 0xf000);
        const uint8_t bytes[2] = {(uint8_t)(h & 0xff), (uint8_t)(h >> 8)};
        return f16(bytes);
    }
    static inline void codes(const uint8_t *b, int8_t *w, int16_t *sc) {
        for (int s = 0; s < 8; ++s) {
            for (int l = 0; l < 4; ++l) {
                const unsigned h = b[32 + 2 * s + l / 2] >> (4 * (l & 1));
                iq1_group(b[4 * s + l] | ((h & 7) << 8), h & 8, w + 32 * s + 8 * l);
            }
            const unsigned v = sc16(b, s / 2) >> (6 * (s & 1));
            sc[2 * s] = (int16_t)(2 * (v & 7) + 1);
            sc[2 * s + 1] = (int16_t)(2 * ((v >> 3) & 7) + 1);
        }
    }
    static inline const int8_t *unpack(const uint8_t *b, int8_t *q, float *dl, float *) {
        return grid_unpack<IQ1_M>(b, q, dl);
    }
};

/* ------------------------------------------------------------------ the shared inner product */
struct Acc {
    vf a0, a1;
    float m;
};

static inline void acc_zero(Acc *acc) {
    acc->a0 = vf_zero();
    acc->a1 = vf_zero();
    acc->m = 0.0f;
}

static inline float acc_total(const Acc *acc) { return vf_hsum(vf_add(acc->a0, acc->a1)) + acc->m; }

/* one unpacked block against x (the block's QK activations) and xs16 (their per-16 sums) */
template <class Q>
static inline void dot_block(const int8_t *q, const float *dl, const float *mb, const float *x, const float *xs16, Acc *acc) {
    for (int s = 0; s < Q::NSUB; ++s) {
        const int8_t *qs = q + s * Q::SUB;
        const float *xx = x + s * Q::SUB;
        vf t = vf_mul(vf_q(qs), vf_load(xx));
        for (int l = VL; l < Q::SUB; l += VL) t = vf_fma(vf_q(qs + l), vf_load(xx + l), t);
        if (s & 1)
            acc->a1 = vf_fma(vf_set1(dl[s]), t, acc->a1);
        else
            acc->a0 = vf_fma(vf_set1(dl[s]), t, acc->a0);
        if (Q::HAS_MIN) {
            const float xs = Q::SUB == 16 ? xs16[s] : xs16[2 * s] + xs16[2 * s + 1];
            acc->m += mb[s] * xs;
        }
    }
}

/* dot_block for NT tokens at once: each 8-lane quant vector is converted to float once and multiplied into
   NT chains kept in registers; per token the operations and their order are dot_block's, so every token's
   result is bit-identical to the one-token product. x[k] / xs16[k]: token k's block activations / sums. */
template <class Q, int NT>
static inline void dot_block_nt(const int8_t *q, const float *dl, const float *mb, const float *const *x,
                                const float *const *xs16, Acc *acc) {
    for (int s = 0; s < Q::NSUB; ++s) {
        const int8_t *qs = q + s * Q::SUB;
        vf t[NT];
        {
            const vf qv = vf_q(qs);
            for (int k = 0; k < NT; ++k) t[k] = vf_mul(qv, vf_load(x[k] + s * Q::SUB));
        }
        for (int l = VL; l < Q::SUB; l += VL) {
            const vf qv = vf_q(qs + l);
            for (int k = 0; k < NT; ++k) t[k] = vf_fma(qv, vf_load(x[k] + s * Q::SUB + l), t[k]);
        }
        const vf d = vf_set1(dl[s]);
        for (int k = 0; k < NT; ++k) {
            if (s & 1)
                acc[k].a1 = vf_fma(d, t[k], acc[k].a1);
            else
                acc[k].a0 = vf_fma(d, t[k], acc[k].a0);
            if (Q::HAS_MIN) {
                const float xs = Q::SUB == 16 ? xs16[k][s] : xs16[k][2 * s] + xs16[k][2 * s + 1];
                acc[k].m += mb[s] * xs;
            }
        }
    }
}

static void sums16(const float *x, idx_t n, float *out) {
    for (idx_t g = 0; g < n / 16; ++g) {
        const float *p = x + 16 * g;
        float s[8];
        for (int l = 0; l < 8; ++l) s[l] = p[l] + p[l + 8];
        out[g] = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
    }
}

/* exact dequantization of one row into n_in floats: dl * q (+ mb), in gguf-py's float32 operations (this
   file is compiled with -ffp-contract=off, so q * dl + mb is not fused) */
template <class Q>
static inline void dequantize_row(const uint8_t *row, idx_t nb, float *out) {
    alignas(64) int8_t qbuf[Q::QK];
    float dl[Q::NSUB], mb[Q::NSUB];
    for (idx_t b = 0; b < nb; ++b) {
        const int8_t *q = Q::unpack(row + b * Q::BS, qbuf, dl, mb);
        float *o = out + b * Q::QK;
        for (int s = 0; s < Q::NSUB; ++s) {
            const vf d = vf_set1(dl[s]), m = vf_set1(Q::HAS_MIN ? mb[s] : 0.0f);
            for (int l = 0; l < Q::SUB; l += VL) {
                const vf v = vf_mul(d, vf_q(q + s * Q::SUB + l));
                vf_store(o + s * Q::SUB + l, Q::HAS_MIN ? vf_add(v, m) : v);
            }
        }
    }
}

#if ALCHEMIST_HAVE_BLAS
/* T >= BLAS_MIN_T: panels of rows, each dequantized and multiplied with sgemm by one OpenMP thread (the BLAS
   itself runs single-threaded here, see backends._one_blas_thread: the threads split the panels instead) */
enum { BLAS_MIN_T = 16 };
template <class Q>
static int run_blas(const uint8_t *W, idx_t n_out, idx_t n_in, const float *X, idx_t T, float *Y) {
    const idx_t nb = n_in / Q::QK, rb = nb * Q::BS;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    idx_t panel = (idx_t)(1048576 / n_in) / 16 * 16; /* at most ~4 MB of float32 weights per thread */
    const idx_t share = ((n_out + threads - 1) / threads + 15) / 16 * 16; /* every thread gets a panel */
    if (panel > share) panel = share;
    if (panel < 16) panel = 16;
    if (panel > n_out) panel = n_out;
    const idx_t n_panels = (n_out + panel - 1) / panel;
    int status = 0;
#pragma omp parallel if (n_panels > 1)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(panel * n_in));
        if (!buf) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic)
        for (idx_t p = 0; p < n_panels; ++p) {
            if (!buf) continue;
            const idx_t o0 = p * panel, np_ = n_out - o0 < panel ? n_out - o0 : panel;
            for (idx_t r = 0; r < np_; ++r) dequantize_row<Q>(W + (o0 + r) * rb, nb, buf + r * n_in);
            /* column-major view: Y[o0:o0+np_, :] (ld n_out) = buf^T (np_ x n_in) @ X^T (n_in x T) */
            char ta = 'T', tb = 'N';
            int m = (int)np_, n = (int)T, k = (int)n_in, lda = (int)n_in, ldb = (int)n_in, ldc = (int)n_out;
            float one = 1.0f, zero = 0.0f;
            sgemm_(&ta, &tb, &m, &n, &k, &one, buf, &lda, X, &ldb, &zero, Y + o0, &ldc);
        }
        free(buf);
    }
    return status;
}
#endif

template <class Q>
static int run(const uint8_t *W, idx_t n_out, idx_t n_in, const float *X, idx_t T, float *Y) {
#if ALCHEMIST_HAVE_BLAS
    if (T >= BLAS_MIN_T && n_in <= 0x7fffffff / 2 && n_out <= 0x7fffffff && T <= 0x7fffffff)
        return run_blas<Q>(W, n_out, n_in, X, T, Y);
#endif
    const idx_t nb = n_in / Q::QK, rb = nb * Q::BS, ng = n_in / 16;
    float *xs16 = NULL;
    if (Q::HAS_MIN) {
        xs16 = (float *)malloc(sizeof(float) * (size_t)(T * ng + 1));
        if (!xs16) return -1;
        for (idx_t t = 0; t < T; ++t) sums16(X + t * n_in, n_in, xs16 + t * ng);
    }
    const int threaded = (double)n_out * (double)rb * (double)T >= 65536.0;
    if (T == 1) {
#pragma omp parallel for schedule(static) if (threaded)
        for (idx_t o = 0; o < n_out; ++o) {
            const uint8_t *row = W + o * rb;
            Acc acc;
            alignas(64) int8_t qbuf[Q::QK];
            float dl[Q::NSUB], mb[Q::NSUB];
            acc_zero(&acc);
            for (idx_t b = 0; b < nb; ++b) {
                __builtin_prefetch(row + b * Q::BS + PREFETCH);
                const int8_t *q = Q::unpack(row + b * Q::BS, qbuf, dl, mb);
                dot_block<Q>(q, dl, mb, X + b * Q::QK, xs16 ? xs16 + b * (Q::QK / 16) : NULL, &acc);
            }
            Y[o] = acc_total(&acc);
        }
    } else {
        enum { TC = 64 }; /* tokens per pass over a row's blocks */
        /* grouping tokens pays on the K-quants (Q6_K ~2x at T = 8); on Q8_0 / Q5_0, whose quants are read
           straight from the block, it measured ~10% slower */
        enum { GROUPED = Q::QK == 256 };
        const idx_t n_chunks = (T + TC - 1) / TC;
#pragma omp parallel for schedule(static) collapse(2) if (threaded)
        for (idx_t o = 0; o < n_out; ++o) {
            for (idx_t c = 0; c < n_chunks; ++c) {
                const uint8_t *row = W + o * rb;
                const idx_t t0 = c * TC, nt = T - t0 < TC ? T - t0 : TC;
                Acc acc[TC];
                alignas(64) int8_t qbuf[Q::QK];
                float dl[Q::NSUB], mb[Q::NSUB];
                for (idx_t t = 0; t < nt; ++t) acc_zero(&acc[t]);
                for (idx_t b = 0; b < nb; ++b) {
                    __builtin_prefetch(row + b * Q::BS + PREFETCH);
                    const int8_t *q = Q::unpack(row + b * Q::BS, qbuf, dl, mb);
                    if (!GROUPED) {
                        for (idx_t t = 0; t < nt; ++t)
                            dot_block<Q>(q, dl, mb, X + (t0 + t) * n_in + b * Q::QK,
                                         xs16 ? xs16 + (t0 + t) * ng + b * (Q::QK / 16) : NULL, &acc[t]);
                        continue;
                    }
                    /* tokens in groups of 4 (registers: 4 chains + the quant vector), then the rest */
                    for (idx_t t = 0; t < nt;) {
                        const idx_t g = nt - t >= 4 ? 4 : nt - t;
                        const float *xp[4], *sp[4] = {NULL, NULL, NULL, NULL};
                        for (idx_t k = 0; k < g; ++k) {
                            xp[k] = X + (t0 + t + k) * n_in + b * Q::QK;
                            if (xs16) sp[k] = xs16 + (t0 + t + k) * ng + b * (Q::QK / 16);
                        }
                        switch (g) {
                        case 4: dot_block_nt<Q, 4>(q, dl, mb, xp, sp, acc + t); break;
                        case 3: dot_block_nt<Q, 3>(q, dl, mb, xp, sp, acc + t); break;
                        case 2: dot_block_nt<Q, 2>(q, dl, mb, xp, sp, acc + t); break;
                        default: dot_block_nt<Q, 1>(q, dl, mb, xp, sp, acc + t); break;
                        }
                        t += g;
                    }
                }
                for (idx_t t = 0; t < nt; ++t) Y[(t0 + t) * n_out + o] = acc_total(&acc[t]);
            }
        }
    }
    free(xs16);
    return 0;
}

/* rows idx[0..T) of W, dequantized exactly (an embedding lookup); -1 - t if idx[t] is out of range */
template <class Q>
static idx_t embed(const uint8_t *W, idx_t n_rows, idx_t n_in, const int64_t *idx, idx_t T, float *Y) {
    const idx_t nb = n_in / Q::QK, rb = nb * Q::BS;
    for (idx_t t = 0; t < T; ++t)
        if (idx[t] < -n_rows || idx[t] >= n_rows) return -1 - t;
    for (idx_t t = 0; t < T; ++t) {
        const idx_t r = idx[t] < 0 ? idx[t] + n_rows : idx[t];
        dequantize_row<Q>(W + r * rb, nb, Y + t * n_in);
    }
    return 0;
}

/* ================================================================== ggml numerics
   llama.cpp's CPU backend (ggml-cpu) multiplies a weight of type T by first quantizing each activation row to
   T's vec_dot_type and then taking integer dot products per block:
     Q8_0 (blocks of 32: d = fp16(max|x| / 127), q = round-to-even(x * 127 / max|x|)) for Q4_0, Q5_0, Q8_0, MXFP4;
     Q8_1 (Q8_0's values plus s = fp16(d * sum q), d before its fp16 rounding)      for Q4_1, Q5_1;
     Q8_K (blocks of 256: the element of largest |x| sets iscale = -127 / x, q = min(127, round(iscale * x)),
           d = 1 / iscale in float32, and bsums: integer sums of each 16)           for the K-quants.
   (quantize_row_q8_0 / q8_1 in ggml-cpu/arch/x86/quants.c, quantize_row_q8_K_ref in ggml-quants.c.)
   A row's product is then, per weight block b with sub-block scales dl and offsets mb (see unpack):
     dx_b * sum_s dl[s] * (sum_j q_j xq_j)  +  offsets:  mb * s_b (Q8_1),  dx_b * sum_s mb[s] * bsum_s (K-quants)
   The integer sums are exact, so the result equals dequant(W) . dequant(quant(x)) up to float32 summation
   order. On AVX2 the float operations are ggml-cpu's own, in its order, so the products are llama.cpp's bit
   for bit: the 32-blocks per block as ggml_vec_dot_*_q8_0 / tinyBLAS take them (any T), Q4_K / Q5_K / Q6_K
   as ggml_vec_dot_q*_K_q8_K below 8 rows and as ggml's tiled matmul from 8 rows on (GgmlDot, the panels).
   Q2_K / Q3_K (and non-AVX2 builds) keep the per-sub-block order of dot_block_int: float32 eps apart. */
enum { ACT_Q8_0 = 0, ACT_Q8_1 = 1, ACT_Q8_K = 2 };

/* PER_BLOCK: activation blocks per weight block (NVFP4's 64 weights meet two Q8_0 blocks of 32) */
template <class Q>
struct ActOf {
    enum { KIND = Q::QK == 256 ? ACT_Q8_K : (Q::HAS_MIN ? ACT_Q8_1 : ACT_Q8_0) };
    enum { PER_BLOCK = KIND == ACT_Q8_0 ? Q::QK / 32 : 1 };
};

static inline float fp32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t fp32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* float32 -> the nearest fp16 value (ties to even), returned as float32: ggml's GGML_CPU_FP32_TO_FP16 */
static inline float round_fp16(float f) {
#if defined(__F16C__)
    return _cvtsh_ss(_cvtss_sh(f, 0));
#else
    /* ggml_compute_fp32_to_fp16 (ggml-impl.h), then back */
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    float base = (__builtin_fabsf(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = fp32_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = fp32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = fp32_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    const uint16_t h = (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
    uint8_t b[2] = {(uint8_t)(h & 0xFF), (uint8_t)(h >> 8)};
    return f16(b);
#endif
}

/* round half to even, as _mm256_round_ps(_MM_ROUND_NEAREST) and ggml's nearest_int do for |v| < 2^22 */
static inline int round_even(float v) { return (int)__builtin_nearbyintf(v); }

/* T activation rows quantized for weights of format Q: q (T, n) int8, d (T, nb) per weight block,
   s16 (T, n / 16) integer sums of 16, s1 (T, nb) Q8_1's s */
struct ActRows {
    int8_t *q;
    float *d, *s1;
    int16_t *s16; /* int16 as block_q8_K's bsums: |sum of 16 int8| <= 2048 */
    int32_t *s4;  /* T == 1, Q4_0 / Q5_0: OFF x the sums of 4, an 8-lane vector per block (OffsetCodes) */
    void *mem;
};

static int act_alloc(ActRows *a, idx_t T, idx_t n, idx_t nb) {
    const size_t nq = (size_t)(T * n), nd = (size_t)(T * nb), n16 = (size_t)(T * (n / 16));
    a->mem = malloc(nq + 64 + sizeof(float) * 2 * (nd + 1) + sizeof(int16_t) * (n16 + 1) + 32 + sizeof(int32_t) * (nq / 4 + 16));
    if (!a->mem) return -1;
    a->d = (float *)a->mem;
    a->s1 = a->d + nd + 1;
    a->s16 = (int16_t *)(a->s1 + nd + 1);
    a->q = (int8_t *)(a->s16 + n16 + 16);
    a->s4 = (int32_t *)(((uintptr_t)(a->q + nq) + 63) & ~(uintptr_t)63);
    return 0;
}

static inline void int_sums16(const int8_t *q, idx_t n, int16_t *out) {
    for (idx_t g = 0; g < n / 16; ++g) {
        int32_t s = 0;
        for (int j = 0; j < 16; ++j) s += q[16 * g + j];
        out[g] = (int16_t)s;
    }
}

/* one row x (n) -> its ggml activation blocks */
template <int KIND>
static void quantize_act_row(const float *x, idx_t n, int8_t *q, float *d, float *s1, int16_t *s16) {
    if (KIND == ACT_Q8_K) {
        for (idx_t b = 0; b < n / 256; ++b) {
            const float *xb = x + 256 * b;
            int8_t *qb = q + 256 * b;
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < 256; ++j) {
                const float ax = __builtin_fabsf(xb[j]);
                if (ax > amax) {
                    amax = ax;
                    max = xb[j];
                }
            }
            if (amax == 0.0f) {
                d[b] = 0.0f;
                memset(qb, 0, 256);
                continue;
            }
            const float iscale = -127.0f / max;
            for (int j = 0; j < 256; ++j) {
                const int v = round_even(iscale * xb[j]);
                qb[j] = (int8_t)(v < 127 ? (v > -128 ? v : -128) : 127);
            }
            d[b] = 1.0f / iscale;
        }
    } else {
        for (idx_t b = 0; b < n / 32; ++b) {
            const float *xb = x + 32 * b;
            int8_t *qb = q + 32 * b;
            float amax = 0.0f;
            for (int j = 0; j < 32; ++j) {
                const float ax = __builtin_fabsf(xb[j]);
                amax = ax > amax ? ax : amax;
            }
            const float dd = amax / 127.0f;
            const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int j = 0; j < 32; ++j) {
                const int v = round_even(xb[j] * id);
                qb[j] = (int8_t)(v < 127 ? (v > -128 ? v : -128) : 127);
                sum += qb[j];
            }
            d[b] = round_fp16(dd);
            if (KIND == ACT_Q8_1) s1[b] = round_fp16(dd * (float)sum);
        }
    }
    int_sums16(q, n, s16);
}

/* Q4_0 / Q5_0 store q + OFF as unsigned codes (OffsetCodes below) */
template <class Q>
struct CodeOffset {
    enum { OFF = 0 };
};
template <>
struct CodeOffset<Q4_0> {
    enum { OFF = 8 };
};
template <>
struct CodeOffset<Q5_0> {
    enum { OFF = 16 };
};

template <class Q>
static void quantize_acts(const float *X, idx_t T, idx_t n, ActRows *a) {
    const idx_t nb = n / Q::QK * ActOf<Q>::PER_BLOCK; /* activation blocks per row */
#pragma omp parallel for schedule(static) if (T >= 8 && T * n >= 65536)
    for (idx_t t = 0; t < T; ++t) {
        quantize_act_row<ActOf<Q>::KIND>(X + t * n, n, a->q + t * n, a->d + t * nb, a->s1 + t * nb, a->s16 + t * (n / 16));
        if (CodeOffset<Q>::OFF && T == 1) /* only the one-row Q4_0 / Q5_0 loop reads them */
            for (idx_t g = 0; g < n / 4; ++g) {
                const int8_t *q = a->q + t * n + 4 * g;
                a->s4[t * (n / 4) + g] = CodeOffset<Q>::OFF * ((int32_t)q[0] + q[1] + q[2] + q[3]);
            }
    }
}

/* sum_s dl[s] * (q . xq over sub-block s), times dx, added into acc (AVX2: 8 float lanes) */
#if AQ_AVX2
typedef __m256 acc8;
static inline acc8 acc8_zero() { return _mm256_setzero_ps(); }
static inline float acc8_total(acc8 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* 32 int8 products summed in fours: lane i = sum of elements 4i..4i+3 (ggml's mul_sum_i8_pairs) */
static inline __m256i dot32(__m256i w, __m256i aw, const int8_t *x) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), _mm256_set1_epi16(1));
}
template <class Q>
static inline acc8 dot_block_int(const int8_t *q, const float *dl, const int8_t *xq, float dx, acc8 acc) {
    for (int c = 0; c < Q::QK / 32; ++c) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
        const __m256 v = _mm256_cvtepi32_ps(dot32(w, _mm256_sign_epi8(w, w), xq + 32 * c));
        const __m256 sc = Q::SUB == 32 ? _mm256_set1_ps(dl[c] * dx)
                                        : _mm256_set_m128(_mm_set1_ps(dl[2 * c + 1] * dx), _mm_set1_ps(dl[2 * c] * dx));
        acc = _mm256_fmadd_ps(sc, v, acc);
    }
    return acc;
}
#else
struct acc8 { float v; };
static inline acc8 acc8_zero() { acc8 a = {0.0f}; return a; }
static inline float acc8_total(acc8 a) { return a.v; }
template <class Q>
static inline acc8 dot_block_int(const int8_t *q, const float *dl, const int8_t *xq, float dx, acc8 acc) {
    for (int s = 0; s < Q::NSUB; ++s) {
        int32_t isum = 0;
        for (int j = 0; j < Q::SUB; ++j) isum += (int32_t)q[s * Q::SUB + j] * (int32_t)xq[s * Q::SUB + j];
        acc.v += (dl[s] * dx) * (float)isum;
    }
    return acc;
}
#endif

#if AQ_AVX2
/* Q4_0 / Q5_0 store q + OFF as unsigned codes. A lane of 4 products is then sum(code * x) - OFF * sum(x): the
   same integer as ggml's sum((code - OFF) * x) with its sign trick, in fewer instructions (maddubs takes the
   codes as they are; OFF x the activations' sums of 4 is computed once per token). Used where CodeOffset<Q>::OFF
   is not 0. */
/* codes(b): the block's 32 codes; halves(b, lo, hi): the same as two 16-byte halves */
template <class Q>
struct OffsetCodes {
    static inline __m256i codes(const uint8_t *) { return _mm256_setzero_si256(); }
    static inline void halves(const uint8_t *, __m128i *, __m128i *) {}
};
static inline void nibble_halves(const uint8_t *p, __m128i *lo, __m128i *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0xF);
    *lo = _mm_and_si128(v, m4);
    *hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
}
template <>
struct OffsetCodes<Q4_0> {
    static inline __m256i codes(const uint8_t *b) { return nibbles_32(b + 2); }
    static inline void halves(const uint8_t *b, __m128i *lo, __m128i *hi) { nibble_halves(b + 2, lo, hi); }
};
/* Q5_0's fifth bits: byte j of Q5_HIGH_BITS[v] is 0x10 where bit j of v is set. Four table reads on the
   integer side instead of a broadcast, shuffle, compare and mask on the vector side, which bounds this loop. */
static const uint64_t Q5_HIGH_BITS[256] = {/*Q5_HIGH_BITS*/};
static inline void q5_high_halves(const uint8_t *p, __m128i *lo, __m128i *hi) {
    const uint32_t qh = u32le(p);
    *lo = _mm_insert_epi64(_mm_cvtsi64_si128((long long)Q5_HIGH_BITS[qh & 255]), (long long)Q5_HIGH_BITS[(qh >> 8) & 255], 1);
    *hi = _mm_insert_epi64(_mm_cvtsi64_si128((long long)Q5_HIGH_BITS[(qh >> 16) & 255]), (long long)Q5_HIGH_BITS[qh >> 24], 1);
}
template <>
struct OffsetCodes<Q5_0> {
    static inline __m256i codes(const uint8_t *b) {
        __m128i lo, hi;
        q5_high_halves(b + 2, &lo, &hi);
        return _mm256_or_si256(nibbles_32(b + 6), _mm256_set_m128i(hi, lo));
    }
    static inline void halves(const uint8_t *b, __m128i *lo, __m128i *hi) {
        __m128i nlo, nhi, blo, bhi;
        nibble_halves(b + 6, &nlo, &nhi);
        q5_high_halves(b + 2, &blo, &bhi);
        *lo = _mm_or_si128(nlo, blo);
        *hi = _mm_or_si128(nhi, bhi);
    }
};

/* Zen 1 executes each 256-bit operation as two 128-bit ones: there the loop below computes on 128-bit halves
   (no lane-crossing inserts to build 256-bit codes) and four rows at a time (sharing the activation loads).
   -DALCHEMIST_OFFSET_HALVES=0 or 1 picks either on any AVX2 CPU (the tests run both). */
#if defined(ALCHEMIST_OFFSET_HALVES)
#define AQ_OFFSET_HALVES ALCHEMIST_OFFSET_HALVES
#elif defined(__znver1__)
#define AQ_OFFSET_HALVES 1
#else
#define AQ_OFFSET_HALVES 0
#endif

/* Rows o .. o + R - 1 of a Q4_0 / Q5_0 weight times one activation row. Per block, lane i holds the integer
   sum(code * x) - OFF * sum(x) over elements 4i .. 4i + 3 and acc = fma(dw * dx, float(lanes), acc); the row is
   acc8_total(acc). The halves compute lanes 0-3 and 4-7 apart with the same operations: the same sums. */
template <class Q, int R>
static inline void offset_rows(const uint8_t *W, idx_t rb, idx_t nb, const ActRows *a, idx_t o, float *Y) {
#if AQ_OFFSET_HALVES
    const __m128i ones = _mm_set1_epi16(1);
    __m128 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm_setzero_ps();
    for (idx_t b = 0; b < nb; ++b) {
        const __m128i x0 = _mm_loadu_si128((const __m128i *)(a->q + 32 * b)), x1 = _mm_loadu_si128((const __m128i *)(a->q + 32 * b + 16));
        const __m128i off0 = _mm_load_si128((const __m128i *)(a->s4 + 8 * b)), off1 = _mm_load_si128((const __m128i *)(a->s4 + 8 * b + 4));
        const float dx = a->d[b];
        for (int r = 0; r < R; ++r) {
            const uint8_t *blk = W + (o + r) * rb + b * Q::BS;
            __builtin_prefetch(blk + PREFETCH);
            __m128i c0, c1;
            OffsetCodes<Q>::halves(blk, &c0, &c1);
            const __m128i l0 = _mm_sub_epi32(_mm_madd_epi16(_mm_maddubs_epi16(c0, x0), ones), off0);
            const __m128i l1 = _mm_sub_epi32(_mm_madd_epi16(_mm_maddubs_epi16(c1, x1), ones), off1);
            const __m128 sc = _mm_set1_ps(f16(blk) * dx);
            lo[r] = _mm_fmadd_ps(sc, _mm_cvtepi32_ps(l0), lo[r]);
            hi[r] = _mm_fmadd_ps(sc, _mm_cvtepi32_ps(l1), hi[r]);
        }
    }
    for (int r = 0; r < R; ++r) Y[o + r] = acc8_total(_mm256_set_m128(hi[r], lo[r]));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) {
        const uint8_t *row = W + (o + r) * rb;
        __m256 acc = _mm256_setzero_ps();
        for (idx_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * Q::BS;
            __builtin_prefetch(blk + PREFETCH);
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + 32 * b));
            const __m256i off = _mm256_load_si256((const __m256i *)(a->s4 + 8 * b));
            const __m256i lanes = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(OffsetCodes<Q>::codes(blk), xv), ones), off);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(blk) * a->d[b]), _mm256_cvtepi32_ps(lanes), acc);
        }
        Y[o + r] = acc8_total(acc);
    }
#endif
}
#endif

/* the offset part of block b of one activation row */
template <class Q>
static inline float offset_block(const float *mb, const ActRows *a, idx_t row_n, idx_t nb, idx_t t, idx_t b) {
    if (!Q::HAS_MIN) return 0.0f;
    if (ActOf<Q>::KIND == ACT_Q8_1) return mb[0] * a->s1[t * nb + b];
    const int16_t *s16 = a->s16 + t * (row_n / 16) + b * (Q::QK / 16);
    float m = 0.0f;
    for (int s = 0; s < Q::NSUB; ++s) m += mb[s] * (float)(Q::SUB == 16 ? s16[s] : s16[2 * s] + s16[2 * s + 1]);
    return a->d[t * nb + b] * m;
}

/* The K-quants on AVX2: ggml-cpu's own vec_dot_q4_K / q5_K / q6_K_q8_K (arch/x86/quants.c), operation for
   operation, so a row's product is llama.cpp's to the bit. Per super-block the sub-block scales multiply the
   integer sums in 8 int32 lanes (lane k: elements 4k..4k+3 of every 32), then acc[k] = fma(d, float(lane k),
   acc[k]); the row is the 8-lane pairwise sum plus the mins term (Q4_K: 4 float lanes, Q5_K: one scalar).
   Other targets (and Q2_K / Q3_K) keep dot_block_int's per-sub-block order: float32 eps apart. */
template <class Q>
struct GgmlDot {
    enum { EXACT = 0 };
    static inline float dot(const uint8_t *, idx_t, const int8_t *, const float *, const int16_t *) { return 0.0f; }
};

/* the types ggml's tiled matmul takes from GGML_TILED_MIN_T rows on (the others keep vec_dot at every T) */
template <class Q>
struct GgmlTiled {
    enum { YES = 1 };
};
template <>
struct GgmlTiled<TQ2_0> {
    enum { YES = 0 };
};
template <>
struct GgmlTiled<TQ1_0> {
    enum { YES = 0 };
};
template <>
struct GgmlTiled<NVFP4> {
    enum { YES = 0 };
};
template <>
struct GgmlTiled<Q1_0> {
    enum { YES = 0 };
};

/* Q1_0: ggml_vec_dot_q1_0_q8_0, at every T. On AVX2 ggml-cpu's own (arch/x86): per block, each 32 of the
   activations (one Q8_0 block) signed by the weights' bits as 8 int32 lanes (elements 4k..4k+3), then
   t = dy0 * lanes0, t = fma(dy_k, lanes_k, t) for the next three, acc = fma(d, t, acc); the row is the 8-lane
   sum. Elsewhere ggml's generic loop: per 32 the integer sum times dy added into a block sum, times d into the
   row. */
template <>
struct GgmlDot<Q1_0> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *) {
        alignas(32) int8_t q[128];
        float dl[4];
#if AQ_AVX2
        acc8 acc = acc8_zero();
        for (idx_t i = 0; i < nb; ++i) {
            Q1_0::unpack(x + i * Q1_0::BS, q, dl, 0);
            __m256 t = _mm256_setzero_ps();
            for (int c = 0; c < 4; ++c) {
                const __m256i w = _mm256_load_si256((const __m256i *)(q + 32 * c));
                const __m256 lanes = _mm256_cvtepi32_ps(dot32(w, _mm256_sign_epi8(w, w), yq + 128 * i + 32 * c));
                const __m256 dy = _mm256_set1_ps(yd[4 * i + c]);
                t = c == 0 ? _mm256_mul_ps(dy, lanes) : _mm256_fmadd_ps(dy, lanes, t);
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(dl[0]), t, acc);
        }
        return acc8_total(acc);
#else
        float sumf = 0.0f;
        for (idx_t i = 0; i < nb; ++i) {
            Q1_0::unpack(x + i * Q1_0::BS, q, dl, 0);
            float t = 0.0f;
            for (int c = 0; c < 4; ++c) {
                int sum = 0;
                for (int j = 0; j < 32; ++j) sum += q[32 * c + j] * yq[128 * i + 32 * c + j];
                t += yd[4 * i + c] * (float)sum;
            }
            sumf += dl[0] * t;
        }
        return sumf;
#endif
    }
};

/* NVFP4: ggml_vec_dot_nvfp4_q8_0, at every T. On AVX2 ggml-cpu's own (arch/x86): per block, each 32 of the
   activations (one Q8_0 block, dy) meets two sub-blocks of 16 as 8 int32 lanes (elements 4k..4k+3), the lanes
   of sub-block s scaled by dy * d[s], acc = fma(lanes, scales, acc); the row is the 8-lane sum. Elsewhere the
   generic loop: sumf += (dy * d) * (integer sum of the 16), one fma per sub-block. yd: the Q8_0 d of every 32
   activations, two per block. */
template <>
struct GgmlDot<NVFP4> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *) {
        alignas(32) int8_t q[64];
        float dl[4];
#if AQ_AVX2
        acc8 acc = acc8_zero();
        for (idx_t i = 0; i < nb; ++i) {
            NVFP4::unpack(x + i * NVFP4::BS, q, dl, 0);
            for (int c = 0; c < 2; ++c) {
                const __m256i w = _mm256_load_si256((const __m256i *)(q + 32 * c));
                const __m256 lanes = _mm256_cvtepi32_ps(dot32(w, _mm256_sign_epi8(w, w), yq + 64 * i + 32 * c));
                const float dy = yd[2 * i + c];
                acc = _mm256_fmadd_ps(lanes, _mm256_set_m128(_mm_set1_ps(dy * dl[2 * c + 1]), _mm_set1_ps(dy * dl[2 * c])), acc);
            }
        }
        return acc8_total(acc);
#else
        float sumf = 0.0f;
        for (idx_t i = 0; i < nb; ++i) {
            NVFP4::unpack(x + i * NVFP4::BS, q, dl, 0);
            for (int s = 0; s < 4; ++s) {
                int sum = 0;
                for (int j = 0; j < 16; ++j) sum += q[16 * s + j] * yq[64 * i + 16 * s + j];
                sumf = __builtin_fmaf(yd[2 * i + s / 2] * dl[s], (float)sum, sumf);
            }
        }
        return sumf;
#endif
    }
};


#if AQ_AVX2
/* the 12 packed 6-bit scales and mins -> utmp[0..1] = 8 scales, utmp[2..3] = 8 mins, one byte each */
static inline void k_scales_mins(const uint8_t *packed, uint32_t utmp[4]) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    memcpy(utmp, packed, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
}

/* the int16 scale of sub-block i broadcast over 16 int16 lanes (ggml's get_scale_shuffle_k4) */
static inline __m256i k4_scale(__m256i scales, int i) {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((2 * i) | ((2 * i + 1) << 8))));
}

/* sub-block scales and mins of a Q4_K / Q5_K block, as ggml widens them: 8 scales twice, 8 mins */
static inline void k45_scales(const uint8_t *b, __m256i *scales, __m128i *mins) {
    uint32_t utmp[4];
    k_scales_mins(b + 4, utmp);
    const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
    const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
    *scales = _mm256_set_m128i(sc128, sc128);
    *mins = _mm256_extracti128_si256(mins_and_scales, 1);
}

/* the 8 per-32 activation sums from the 16 per-16 bsums, times the 8 mins: 4 int32 lanes */
static inline __m128i k45_mins_dot(const int16_t *bsums, __m128i mins) {
    const __m256i q8sums = _mm256_loadu_si256((const __m256i *)bsums);
    const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
    return _mm_madd_epi16(mins, q8s);
}

/* the scaled integer sums of one Q4_K (HIGH = 0) or Q5_K (HIGH = 1) super-block: 8 int32 lanes, ggml's order.
   Per 64 quants j, the low nibbles (plus qh bit 2j on Q5_K) meet the first 32 activations, the high nibbles
   (plus bit 2j + 1) the next 32. */
template <int HIGH>
static inline __m256i k45_block_sumi(const uint8_t *b, __m256i scales, const int8_t *q8) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const uint8_t *qs = HIGH ? b + 48 : b + 16;
    const __m256i hbits = HIGH ? load32(b + 16) : _mm256_setzero_si256();
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const __m256i bits = load32(qs + 32 * j);
        __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        if (HIGH) {
            const __m256i hm0 = _mm256_set1_epi8((char)(1 << (2 * j))), hm1 = _mm256_set1_epi8((char)(1 << (2 * j + 1)));
            lo = _mm256_add_epi8(lo, _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hm0), 2 * j), 4));
            hi = _mm256_add_epi8(hi, _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hm1), 2 * j + 1), 4));
        }
        const __m256i p16l = _mm256_madd_epi16(k4_scale(scales, 2 * j), _mm256_maddubs_epi16(lo, load32((const uint8_t *)q8 + 64 * j)));
        const __m256i p16h = _mm256_madd_epi16(k4_scale(scales, 2 * j + 1), _mm256_maddubs_epi16(hi, load32((const uint8_t *)q8 + 64 * j + 32)));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
    }
    return sumi;
}

template <>
struct GgmlDot<Q4_K> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *ybs) {
        __m256 acc = _mm256_setzero_ps();
        __m128 acc_m = _mm_setzero_ps();
        for (idx_t i = 0; i < nb; ++i) {
            const uint8_t *b = x + i * Q4_K::BS;
            __builtin_prefetch(b + PREFETCH);
            const float d = yd[i] * f16(b);
            const float dmin = -yd[i] * f16(b + 2);
            __m256i scales;
            __m128i mins;
            k45_scales(b, &scales, &mins);
            acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(k45_mins_dot(ybs + 16 * i, mins)), acc_m);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(k45_block_sumi<0>(b, scales, yq + 256 * i)), acc);
        }
        acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
        acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
        return acc8_total(acc) + _mm_cvtss_f32(acc_m);
    }
};

template <>
struct GgmlDot<Q5_K> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *ybs) {
        __m256 acc = _mm256_setzero_ps();
        float summs = 0.0f;
        for (idx_t i = 0; i < nb; ++i) {
            const uint8_t *b = x + i * Q5_K::BS;
            __builtin_prefetch(b + PREFETCH);
            const float d = yd[i] * f16(b);
            const float dmin = -yd[i] * f16(b + 2);
            __m256i scales;
            __m128i mins;
            k45_scales(b, &scales, &mins);
            const __m128i prod = k45_mins_dot(ybs + 16 * i, mins);
            const __m128i zero = _mm_setzero_si128();
            const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, zero), zero);
            summs = __builtin_fmaf(dmin, (float)_mm_extract_epi32(hsum, 0), summs); /* ggml's summs += dmin * i, contracted */
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(k45_block_sumi<1>(b, scales, yq + 256 * i)), acc);
        }
        return acc8_total(acc) + summs;
    }
};

template <>
struct GgmlDot<Q6_K> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *ybs) {
        const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
        __m256 acc = _mm256_setzero_ps();
        for (idx_t i = 0; i < nb; ++i) {
            const uint8_t *b = x + i * Q6_K::BS;
            __builtin_prefetch(b + PREFETCH);
            const float d = yd[i] * f16(b + 208);
            const uint8_t *q4 = b, *qh = b + 128;
            const int8_t *q8 = yq + 256 * i;
            const __m128i scales = _mm_loadu_si128((const __m128i *)(b + 192));
            /* the quants are stored + 32: subtract 32 * scale * (sum of the activations), two sub-blocks per lane */
            const __m256i q8sclsub =
                _mm256_slli_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(ybs + 16 * i)), _mm256_cvtepi8_epi16(scales)), 5);
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 2; ++j) {
                const __m256i q4bits1 = load32(q4 + 64 * j), q4bits2 = load32(q4 + 64 * j + 32), q4bitsH = load32(qh + 32 * j);
                const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
                const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
                const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
                const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
                const __m256i q6[4] = {_mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0),
                                       _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1),
                                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2),
                                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3)};
                __m256i p16[4];
                for (int g = 0; g < 4; ++g) {
                    const int is = 4 * j + g; /* sub-blocks 2 is, 2 is + 1: 8 bytes of each scale */
                    const __m128i sc = _mm_shuffle_epi8(scales, _mm_set_epi64x(0x0101010101010101LL * (2 * is + 1), 0x0101010101010101LL * (2 * is)));
                    p16[g] = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), _mm256_maddubs_epi16(q6[g], load32((const uint8_t *)q8 + 128 * j + 32 * g)));
                }
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16[0], p16[1]));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16[2], p16[3]));
            }
            sumi = _mm256_sub_epi32(sumi, q8sclsub);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        }
        return acc8_total(acc);
    }
};
#endif

#if AQ_AVX2
/* ggml_vec_dot_iq4_xs_q8_K: per super-block the 8 sub-blocks' lanes of 4 products times their scale (ls - 32) are
   summed as integers, then acc = fma(d * dy, float(lanes), acc); the row is the 8-lane sum. */
template <>
struct GgmlDot<IQ4_XS> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *) {
        __m256 acc = _mm256_setzero_ps();
        alignas(64) int8_t q[256];
        float dl[8];
        for (idx_t i = 0; i < nb; ++i) {
            const uint8_t *b = x + i * IQ4_XS::BS;
            __builtin_prefetch(b + PREFETCH);
            IQ4_XS::unpack(b, q, dl, 0);
            __m256i sumi = _mm256_setzero_si256();
            for (int s = 0; s < 8; ++s) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * s));
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(yq + 256 * i + 32 * s));
                const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p16, _mm256_set1_epi16((short)iq4_xs_scale(b, s))));
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b) * yd[i]), _mm256_cvtepi32_ps(sumi), acc);
        }
        return acc8_total(acc);
    }
};
#endif

#if AQ_AVX2
/* ggml_vec_dot_tq2_0_q8_K and ggml_vec_dot_tq1_0_q8_K (the ternary types): the codes 0..2 against the activations,
   16-bit lane e of every 32-element vector's maddubs pairing elements 2e, 2e+1, so that 32-bit lane k holds, over
   the 8 vectors, elements 4k..4k+3 of each, minus the activation sums bsums[2k] + bsums[2k+1] (which turns the
   codes into -1, 0, 1), all in integers (TQ1_0's base-3 digits decoded first: its avg-based decode gives the same
   codes); then acc = float(lanes) * (dy * d) + acc (ggml's mul and add, contracted to one fma by its compiler)
   and the row is the 8-lane sum. llama.cpp takes vec_dot at every batch size (no tinyBLAS or tiled kernel has
   them). */
template <class Q>
static inline float ternary_dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *ybs) {
    const __m256i ones = _mm256_set1_epi16(1);
    alignas(32) int8_t c[256];
    __m256 acc = _mm256_setzero_ps();
    for (idx_t i = 0; i < nb; ++i) {
        const uint8_t *b = x + i * Q::BS;
        const int8_t *q8 = yq + 256 * i;
        Q::codes(b, c);
        __m256i sumi = _mm256_setzero_si256();
        for (int v = 0; v < 8; ++v) {
            const __m256i codes = _mm256_load_si256((const __m256i *)(c + 32 * v));
            const __m256i y = _mm256_loadu_si256((const __m256i *)(q8 + 32 * v));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, y), ones));
        }
        const __m256i bsum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(ybs + 16 * i)), ones);
        sumi = _mm256_sub_epi32(sumi, bsum);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(yd[i] * f16(b + Q::D_AT)), acc);
    }
    return acc8_total(acc);
}

/* ggml_vec_dot_iq2_xxs/iq2_xs/iq2_s/iq3_xxs/iq3_s_q8_K: the magnitudes against the activations with the signs moved
   onto them (maddubs: 16-bit lane e pairs elements 2e, 2e+1 of each 32), times the scale of their 16 (madd), so that
   32-bit lane k holds, over the 8 vectors, elements 4k..4k+3 of each times their scales, all in integers; then
   acc = float(lanes) * (d * dy) + acc (fma) and the row is MULT times the 8-lane sum. vec_dot below 8 rows, ggml's
   tiled matmul from 8 on (grid_int_scales), as llama.cpp switches. */
template <class Q>
static inline float grid_dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd) {
    alignas(32) int8_t w[256];
    int16_t sc[16];
    __m256 acc = _mm256_setzero_ps();
    for (idx_t i = 0; i < nb; ++i) {
        const uint8_t *b = x + i * Q::BS;
        Q::codes(b, w, sc);
        __m256i sumi = _mm256_setzero_si256();
        for (int v = 0; v < 8; ++v) {
            const __m256i wv = _mm256_load_si256((const __m256i *)(w + 32 * v));
            const __m256i y = _mm256_loadu_si256((const __m256i *)(yq + 256 * i + 32 * v));
            const __m256i dot = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(y, wv));
            const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[2 * v + 1]), _mm_set1_epi16(sc[2 * v]));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(dot, scales));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(Q::scale_d(b) * yd[i]), _mm256_cvtepi32_ps(sumi), acc);
    }
    return Q::mult() * acc8_total(acc);
}

#define ALCHEMIST_GRID_DOT(Q)                                                                                     \
    template <>                                                                                                   \
    struct GgmlDot<Q> {                                                                                           \
        enum { EXACT = 1 };                                                                                       \
        static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *) { \
            return grid_dot<Q>(x, nb, yq, yd);                                                                    \
        }                                                                                                         \
    };
ALCHEMIST_GRID_DOT(IQ2_XXS)
ALCHEMIST_GRID_DOT(IQ2_XS)
ALCHEMIST_GRID_DOT(IQ2_S)
ALCHEMIST_GRID_DOT(IQ3_XXS)
ALCHEMIST_GRID_DOT(IQ3_S)
#undef ALCHEMIST_GRID_DOT

/* ggml_vec_dot_iq1_s_q8_K / iq1_m_q8_K: the grid values (g = (w + 4) >> 3 of w = 8 g +- 1) and the deltas apart.
   IQ1_S: the grid's 8 lanes as the others (scale per 32), acc = fma(d * dy, lanes, acc), and the deltas as one
   integer per block, sum over 32s of (bsums of the 32) * sign * scale, into a scalar acc1 += (d * dy) * that;
   the row is the 8-lane sum + acc1 / 8. IQ1_M: the deltas in lanes too (maddubs of 1 with the activations signed
   by the delta, times the scale of their 16), a second 8-lane acc; the row is sum(acc) + sum(acc2) / 8. */
template <>
struct GgmlDot<IQ1_S> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *ybs) {
        alignas(32) int8_t w[256];
        int16_t sc[16];
        __m256 acc = _mm256_setzero_ps();
        float acc1 = 0.0f;
        for (idx_t i = 0; i < nb; ++i) {
            const uint8_t *b = x + i * IQ1_S::BS;
            IQ1_S::codes(b, w, sc);
            __m256i sumi = _mm256_setzero_si256();
            int sumi1 = 0;
            for (int v = 0; v < 8; ++v) {
                const __m256i wv = _mm256_load_si256((const __m256i *)(w + 32 * v));
                const __m256i g = _mm256_srai_epi16(_mm256_add_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(wv)), _mm256_set1_epi16(4)), 3);
                const __m256i g2 = _mm256_srai_epi16(_mm256_add_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(wv, 1)), _mm256_set1_epi16(4)), 3);
                const __m256i gv = _mm256_permute4x64_epi64(_mm256_packs_epi16(g, g2), 0xd8);
                const __m256i y = _mm256_loadu_si256((const __m256i *)(yq + 256 * i + 32 * v));
                const __m256i dot = _mm256_maddubs_epi16(_mm256_sign_epi8(gv, gv), _mm256_sign_epi8(y, gv));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(dot, _mm256_set1_epi16(sc[2 * v])));
                const int sign = (IQ1_S::qh(b, v) & 0x8000) ? -1 : 1;
                sumi1 += (ybs[16 * i + 2 * v] + ybs[16 * i + 2 * v + 1]) * sign * sc[2 * v];
            }
            const float d = yd[i] * IQ1_S::scale_d(b);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            acc1 = __builtin_fmaf(d, (float)sumi1, acc1);
        }
        return acc8_total(acc) + 0.125f * acc1;
    }
};

template <>
struct GgmlDot<IQ1_M> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *) {
        alignas(32) int8_t w[256];
        int16_t sc[16];
        __m256 acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
        const __m256i ones = _mm256_set1_epi8(1);
        for (idx_t i = 0; i < nb; ++i) {
            const uint8_t *b = x + i * IQ1_M::BS;
            IQ1_M::codes(b, w, sc);
            __m256i sumi1 = _mm256_setzero_si256(), sumi2 = _mm256_setzero_si256();
            for (int v = 0; v < 8; ++v) {
                const __m256i wv = _mm256_load_si256((const __m256i *)(w + 32 * v));
                const __m256i g = _mm256_srai_epi16(_mm256_add_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(wv)), _mm256_set1_epi16(4)), 3);
                const __m256i g2 = _mm256_srai_epi16(_mm256_add_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(wv, 1)), _mm256_set1_epi16(4)), 3);
                const __m256i gv = _mm256_permute4x64_epi64(_mm256_packs_epi16(g, g2), 0xd8);
                const __m256i g8 = _mm256_add_epi8(gv, gv), g8b = _mm256_add_epi8(g8, g8);
                const __m256i delta = _mm256_sub_epi8(wv, _mm256_add_epi8(g8b, g8b)); /* w - 8 g, byte by byte */
                const __m256i y = _mm256_loadu_si256((const __m256i *)(yq + 256 * i + 32 * v));
                const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[2 * v + 1]), _mm_set1_epi16(sc[2 * v]));
                const __m256i dot1 = _mm256_maddubs_epi16(_mm256_sign_epi8(gv, gv), _mm256_sign_epi8(y, gv));
                const __m256i dot2 = _mm256_maddubs_epi16(ones, _mm256_sign_epi8(y, delta));
                sumi1 = _mm256_add_epi32(sumi1, _mm256_madd_epi16(dot1, scales));
                sumi2 = _mm256_add_epi32(sumi2, _mm256_madd_epi16(dot2, scales));
            }
            const __m256 d = _mm256_set1_ps(yd[i] * IQ1_M::scale_d(b));
            acc1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi1), acc1);
            acc2 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi2), acc2);
        }
        return acc8_total(acc1) + 0.125f * acc8_total(acc2);
    }
};

template <>
struct GgmlDot<TQ2_0> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *ybs) {
        return ternary_dot<TQ2_0>(x, nb, yq, yd, ybs);
    }
};

template <>
struct GgmlDot<TQ1_0> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd, const int16_t *ybs) {
        return ternary_dot<TQ1_0>(x, nb, yq, yd, ybs);
    }
};
#endif

/* Where llama.cpp's one-row product (T == 1, when tinyBLAS declines) sums in another order than its batched
   tinyBLAS one, which dot_block_int follows. ggml_vec_dot_iq4_nl_q8_0 on AVX2 alternates the blocks between two
   accumulators, adds them, and takes an odd last block as a scalar (fma: libggml-cpu contracts). */
template <class Q>
struct OneRowDot {
    enum { EXACT = 0 };
    static inline float dot(const uint8_t *, idx_t, const int8_t *, const float *) { return 0.0f; }
};

#if AQ_AVX2
template <>
struct OneRowDot<IQ4_NL> {
    enum { EXACT = 1 };
    static inline float dot(const uint8_t *x, idx_t nb, const int8_t *yq, const float *yd) {
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        alignas(32) int8_t q[32];
        float dl[1];
        idx_t b = 0;
        for (; b + 1 < nb; b += 2)
            for (int k = 0; k < 2; ++k) { /* block b + k into accumulator k */
                IQ4_NL::unpack(x + (b + k) * IQ4_NL::BS, q, dl, 0);
                const __m256i w = _mm256_loadu_si256((const __m256i *)q);
                const __m256 v = _mm256_cvtepi32_ps(dot32(w, _mm256_sign_epi8(w, w), yq + 32 * (b + k)));
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(yd[b + k] * dl[0]), v, acc[k]);
            }
        float sum = acc8_total(_mm256_add_ps(acc[0], acc[1]));
        for (; b < nb; ++b) {
            IQ4_NL::unpack(x + b * IQ4_NL::BS, q, dl, 0);
            int32_t isum = 0;
            for (int j = 0; j < 32; ++j) isum += (int32_t)q[j] * (int32_t)yq[32 * b + j];
            sum = __builtin_fmaf(yd[b] * dl[0], (float)isum, sum);
        }
        return sum;
    }
};
#endif

#if AQ_AVX2
/* T >= 8: ggml-cpu's tiled K-quant matmul (ggml-cpu/tiled, which llama.cpp takes for 8 or more activation rows).
   Per super-block the integer sums are reduced whole: s1 = sum_s sc[s] * (q . xq over sub-block s) and
   s2 = sum_s mn[s] * bsum_s; then res = d * float(s1), minus dmin * float(s2) in one fma, and
   acc = fma(res, dx, acc) super-block after super-block. Integer sums are exact in any order. */
enum { GGML_TILED_MIN_T = 8 };

/* a K-quant block's integer sub-block scales (sc) and mins (mn), and its fp16 d / dmin */
template <class Q>
static inline void k_int_scales(const uint8_t *b, int32_t *sc, int32_t *mn, float *d, float *dmin) {
    if (Q::QK == 256 && Q::NSUB == 16) { /* Q6_K: int8 scales, d after them */
        for (int k = 0; k < 16; ++k) sc[k] = (int8_t)b[192 + k];
        *d = f16(b + 208);
        *dmin = 0.0f;
        return;
    }
    for (int j = 0; j < 8; ++j) {
        int s, m;
        k_scale_min(j, b + 4, &s, &m);
        sc[j] = s;
        mn[j] = m;
    }
    *d = f16(b);
    *dmin = f16(b + 2);
}

/* IQ4_XS in ggml's tiled matmul: the 8 scales ls - 32, no mins */
template <>
inline void k_int_scales<IQ4_XS>(const uint8_t *b, int32_t *sc, int32_t *mn, float *d, float *dmin) {
    for (int s = 0; s < 8; ++s) {
        sc[s] = iq4_xs_scale(b, s);
        mn[s] = 0;
    }
    *d = f16(b);
    *dmin = 0.0f;
}

/* the grid i-quants in ggml's tiled matmul: the scale 2 ls + 1 of each 16 weights, d times MULT (tiled.cpp folds
   the 0.125 / 0.25 into the block's d: exact, a power of two), no mins */
template <class Q>
static inline void grid_int_scales(const uint8_t *b, int32_t *sc, int32_t *mn, float *d, float *dmin) {
    alignas(32) int8_t w[256];
    int16_t sc16[16];
    Q::codes(b, w, sc16);
    for (int g = 0; g < 16; ++g) sc[g] = sc16[g];
    for (int s = 0; s < 8; ++s) mn[s] = 0;
    *d = Q::scale_d(b) * Q::mult();
    *dmin = 0.0f;
}
#define ALCHEMIST_GRID_SCALES(Q)                                                                  \
    template <>                                                                                   \
    inline void k_int_scales<Q>(const uint8_t *b, int32_t *sc, int32_t *mn, float *d, float *dmin) { \
        grid_int_scales<Q>(b, sc, mn, d, dmin);                                                   \
    }
ALCHEMIST_GRID_SCALES(IQ2_XXS)
ALCHEMIST_GRID_SCALES(IQ2_XS)
ALCHEMIST_GRID_SCALES(IQ2_S)
ALCHEMIST_GRID_SCALES(IQ3_XXS)
ALCHEMIST_GRID_SCALES(IQ3_S)
ALCHEMIST_GRID_SCALES(IQ1_S)
ALCHEMIST_GRID_SCALES(IQ1_M)
#undef ALCHEMIST_GRID_SCALES

/* Batched products (T >= 8 for the K-quants, T >= 16 for the 32-blocks) as register-blocked panels: PR weight
   rows are unpacked once into int8 codes and integer scales, then swept over tiles of PT tokens with PR x PT
   accumulators. Each (row, token) pair keeps its one-token arithmetic (its own lanes, block after block), so
   a row of the result does not depend on the tile it was computed in. Rows past n_out and tokens past T
   are padded with zero codes and not stored. */
enum { PANEL_ROWS = 4 };

struct Panel {
    int8_t *q;       /* PANEL_ROWS x n_in codes */
    float *dl, *d, *dmin; /* 32-blocks: dl per block; K-quants: d, dmin per block */
    int32_t *sc;      /* K-quants: 16 scales per block */
    int16_t *mn16;    /* K-quants: 8 mins per block, int16 for madd */
    void *mem;
};

static int panel_alloc(Panel *p, idx_t n_in) {
    const idx_t nb32 = n_in / 32, nb = n_in / 256 + 1;
    p->mem = calloc(1, (size_t)(PANEL_ROWS * n_in + 64) + sizeof(float) * (size_t)(PANEL_ROWS * (nb32 + 2 * nb) + 8) +
                           sizeof(int32_t) * (size_t)(PANEL_ROWS * nb * 20 + 32));
    if (!p->mem) return -1;
    p->dl = (float *)p->mem;
    p->d = p->dl + PANEL_ROWS * nb32 + 2;
    p->dmin = p->d + PANEL_ROWS * nb + 2;
    p->sc = (int32_t *)(p->dmin + PANEL_ROWS * nb + 4);
    p->mn16 = (int16_t *)(p->sc + PANEL_ROWS * nb * 16 + 8);
    p->q = (int8_t *)(p->mn16 + PANEL_ROWS * nb * 8 + 16);
    return 0;
}

/* rows o0 .. o0 + nr of W into the panel; the rest of its rows get zero codes */
template <class Q>
static void panel_fill(Panel *p, const uint8_t *W, idx_t rb, idx_t n_in, idx_t o0, int nr) {
    const idx_t nb = n_in / Q::QK;
    alignas(64) int8_t qbuf[Q::QK];
    float dl[Q::NSUB], mb[Q::NSUB];
    for (int r = 0; r < PANEL_ROWS; ++r)
        for (idx_t b = 0; b < nb; ++b) {
            int8_t *dst = p->q + r * n_in + b * Q::QK;
            if (r >= nr) {
                memset(dst, 0, Q::QK);
                if (Q::QK == 32) p->dl[r * nb + b] = 0.0f;
                else {
                    p->d[r * nb + b] = p->dmin[r * nb + b] = 0.0f;
                    memset(p->sc + (r * nb + b) * 16, 0, 16 * sizeof(int32_t));
                    memset(p->mn16 + (r * nb + b) * 8, 0, 8 * sizeof(int16_t));
                }
                continue;
            }
            const uint8_t *blk = W + (o0 + r) * rb + b * Q::BS;
            memcpy(dst, Q::unpack(blk, qbuf, dl, mb), Q::QK);
            if (Q::QK == 32) p->dl[r * nb + b] = dl[0];
            else {
                int32_t mn[8] = {0};
                k_int_scales<Q>(blk, p->sc + (r * nb + b) * 16, mn, p->d + r * nb + b, p->dmin + r * nb + b);
                for (int s = 0; s < 8; ++s) p->mn16[(r * nb + b) * 8 + s] = (int16_t)mn[s];
            }
        }
}

/* 32-blocks with Q8_0 activations: per pair, acc = fma(dl * dx, float(lanes of 4 products), acc) per block
   (dot_block_int's order), then the 8 lanes summed: PANEL_ROWS x 3 tokens */
template <class Q>
static void panel_gemm_32(const Panel *p, const ActRows *a, const int8_t *zeros, idx_t n_in, idx_t T, idx_t o0, int nr,
                          idx_t n_out, float *Y) {
    enum { PT = 3 };
    const idx_t nb = n_in / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    for (idx_t t0 = 0; t0 < T; t0 += PT) {
        const int nt = T - t0 < PT ? (int)(T - t0) : PT;
        const int8_t *xr[PT];
        const float *dxr[PT];
        static const float dzero[1] = {0.0f};
        for (int t = 0; t < PT; ++t) {
            xr[t] = t < nt ? a->q + (t0 + t) * n_in : zeros;
            dxr[t] = t < nt ? a->d + (t0 + t) * nb : dzero;
        }
        __m256 acc[PANEL_ROWS][PT];
        for (int r = 0; r < PANEL_ROWS; ++r)
            for (int t = 0; t < PT; ++t) acc[r][t] = _mm256_setzero_ps();
        for (idx_t b = 0; b < nb; ++b) {
            __m256i xv[PT];
            float dx[PT];
            for (int t = 0; t < PT; ++t) {
                xv[t] = _mm256_loadu_si256((const __m256i *)(xr[t] + 32 * b));
                dx[t] = t < nt ? dxr[t][b] : 0.0f;
            }
            for (int r = 0; r < PANEL_ROWS; ++r) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(p->q + r * n_in + 32 * b));
                const __m256i aw = _mm256_sign_epi8(w, w);
                const float dl = p->dl[r * nb + b];
                for (int t = 0; t < PT; ++t) {
                    const __m256 v = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[t], w)), ones));
                    acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(dl * dx[t]), v, acc[r][t]);
                }
            }
        }
        for (int r = 0; r < nr; ++r)
            for (int t = 0; t < nt; ++t) Y[(t0 + t) * n_out + o0 + r] = acc8_total(acc[r][t]);
    }
}

/* the K-quants: ggml's tiled arithmetic per pair (see above), PANEL_ROWS x 2 tokens. The super-blocks are taken
   in chunks of K_CHUNK so that the chunk of every token's activations stays in L2 while the panel sweeps the
   tokens; acc carries each pair's sum from chunk to chunk, in block order. Q4_K / Q5_K codes are unsigned:
   maddubs takes them as they are (Q6_K's signed codes need the sign trick). The 8 pairs of a super-block (lane
   r + 4 t) are finished together: their integer sums reduced in one tree, then res = d * s1 (- dmin * s2 in
   one fma) and acc = fma(res, dx, acc) as 8-lane vector operations, each lane the scalar's float steps. */
enum { K_CHUNK = 4 };

/* acc + a . b summed in int16 pairs */
static inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }

/* the lane sums of v0 .. v3: [sum v0, sum v1, sum v2, sum v3] (int32 adds in another order: the same integers) */
static inline __m128i lane_sums4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
}

template <class Q>
static void panel_gemm_k(const Panel *p, const ActRows *a, const int8_t *zeros, idx_t n_in, idx_t T, idx_t o0, int nr,
                         idx_t n_out, float *Y, float *acc) {
    enum { PT = 2 };
    static_assert(PANEL_ROWS == 4, "a super-block's pairs fill the 8 lanes of one vector");
    static const int16_t no_sums[16] = {0};
    const idx_t nb = n_in / 256, n_pairs = (T + PT - 1) / PT;
    for (idx_t i = 0; i < 8 * n_pairs; ++i) acc[i] = 0.0f;
    for (idx_t b0 = 0; b0 < nb; b0 += K_CHUNK) {
        const idx_t b1 = b0 + K_CHUNK < nb ? b0 + K_CHUNK : nb;
        for (idx_t t0 = 0; t0 < T; t0 += PT) {
            const int nt = T - t0 < PT ? (int)(T - t0) : PT;
            const int8_t *xr[PT];
            for (int t = 0; t < PT; ++t) xr[t] = t < nt ? a->q + (t0 + t) * n_in : zeros;
            for (idx_t b = b0; b < b1; ++b) {
                __m256i isum[PANEL_ROWS][PT];
                for (int r = 0; r < PANEL_ROWS; ++r)
                    for (int t = 0; t < PT; ++t) isum[r][t] = _mm256_setzero_si256();
                for (int c = 0; c < 8; ++c) {
                    __m256i xv[PT];
                    for (int t = 0; t < PT; ++t) xv[t] = _mm256_loadu_si256((const __m256i *)(xr[t] + 256 * b + 32 * c));
                    for (int r = 0; r < PANEL_ROWS; ++r) {
                        const int32_t *sc = p->sc + (r * nb + b) * 16;
                        const __m256i w = _mm256_loadu_si256((const __m256i *)(p->q + r * n_in + 256 * b + 32 * c));
                        const __m256i s16 = Q::SUB == 32 ? _mm256_set1_epi16((short)sc[c])
                                                         : _mm256_set_m128i(_mm_set1_epi16((short)sc[2 * c + 1]), _mm_set1_epi16((short)sc[2 * c]));
                        if (Q::HAS_MIN) {
                            for (int t = 0; t < PT; ++t) isum[r][t] = madd_add(isum[r][t], _mm256_maddubs_epi16(w, xv[t]), s16);
                        } else {
                            const __m256i aw = _mm256_sign_epi8(w, w);
                            for (int t = 0; t < PT; ++t)
                                isum[r][t] = madd_add(isum[r][t], _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[t], w)), s16);
                        }
                    }
                }
                const __m128i d4 = _mm_castps_si128(_mm_set_ps(p->d[3 * nb + b], p->d[2 * nb + b], p->d[nb + b], p->d[b]));
                const __m256 d = _mm256_castsi256_ps(_mm256_set_m128i(d4, d4));
                const __m256i s1 = _mm256_set_m128i(lane_sums4(isum[0][1], isum[1][1], isum[2][1], isum[3][1]),
                                                    lane_sums4(isum[0][0], isum[1][0], isum[2][0], isum[3][0]));
                __m256 res = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s1));
                if (Q::HAS_MIN) { /* s2: the 8 mins times the 8 per-32 sums (hadd of the per-16 bsums) */
                    __m128i s32[PT];
                    for (int t = 0; t < PT; ++t) {
                        const int16_t *bs = t < nt ? a->s16 + (t0 + t) * (n_in / 16) + 16 * b : no_sums;
                        const __m256i v = _mm256_loadu_si256((const __m256i *)bs);
                        s32[t] = _mm_hadd_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                    }
                    const __m256i xs = _mm256_set_m128i(s32[1], s32[0]);
                    __m256i m[PANEL_ROWS];
                    for (int r = 0; r < PANEL_ROWS; ++r)
                        m[r] = _mm256_madd_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p->mn16 + (r * nb + b) * 8))), xs);
                    const __m256i s2 = _mm256_hadd_epi32(_mm256_hadd_epi32(m[0], m[1]), _mm256_hadd_epi32(m[2], m[3]));
                    const __m128 dm4 = _mm_set_ps(p->dmin[3 * nb + b], p->dmin[2 * nb + b], p->dmin[nb + b], p->dmin[b]);
                    res = _mm256_fnmadd_ps(_mm256_set_m128(dm4, dm4), _mm256_cvtepi32_ps(s2), res); /* fma(-dmin, s2, res) */
                }
                const __m256 dx = _mm256_set_m128(_mm_set1_ps(nt > 1 ? a->d[(t0 + 1) * nb + b] : 0.0f), _mm_set1_ps(a->d[t0 * nb + b]));
                float *ac = acc + 8 * (t0 / PT);
                _mm256_storeu_ps(ac, _mm256_fmadd_ps(res, dx, _mm256_loadu_ps(ac)));
            }
        }
    }
    for (int r = 0; r < nr; ++r)
        for (idx_t t = 0; t < T; ++t) Y[t * n_out + o0 + r] = acc[8 * (t / PT) + r + 4 * (t % PT)];
}

template <class Q>
static int run_ggml_panels(const uint8_t *W, idx_t n_out, idx_t n_in, const ActRows *a, idx_t T, float *Y, int threaded) {
    const idx_t rb = (n_in / Q::QK) * Q::BS, n_panels = (n_out + PANEL_ROWS - 1) / PANEL_ROWS;
    int8_t *zeros = (int8_t *)calloc((size_t)n_in + 64, 1);
    if (!zeros) return -1;
    int failed = 0;
#pragma omp parallel if (threaded)
    {
        Panel p;
        float *acc = (float *)malloc(sizeof(float) * (size_t)(PANEL_ROWS * (T + 1) + 8));
        if (!acc || panel_alloc(&p, n_in) != 0) {
            free(acc);
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (idx_t i = 0; i < n_panels; ++i) {
                const idx_t o0 = i * PANEL_ROWS;
                const int nr = n_out - o0 < PANEL_ROWS ? (int)(n_out - o0) : PANEL_ROWS;
                panel_fill<Q>(&p, W, rb, n_in, o0, nr);
                if (Q::QK == 32) panel_gemm_32<Q>(&p, a, zeros, n_in, T, o0, nr, n_out, Y);
                else panel_gemm_k<Q>(&p, a, zeros, n_in, T, o0, nr, n_out, Y, acc);
            }
            free(p.mem);
            free(acc);
        }
    }
    free(zeros);
    return failed ? -1 : 0;
}
#else
enum { GGML_TILED_MIN_T = 0 };
template <class Q>
static int run_ggml_panels(const uint8_t *, idx_t, idx_t, const ActRows *, idx_t, float *, int) { return -1; }
#endif

#if AQ_VNNI
/* Two or more activation rows of the 32-blocks with Q8_0 activations: dot_block_int's arithmetic with
   its integer lanes from vpdpbusd. vpdpbusd multiplies unsigned by signed bytes, so the codes q go in as
   q + 128 (q XOR 0x80, once per weight block for all NT tokens) and each lane starts from -128 x the sum of
   its 4 activations (bias): lane i = sum over 4i..4i+3 of q x, the integer ggml's sign trick and maddubs give
   (Q8_0 activations lie in [-127, 127]: no int16 step that could saturate), then the same cvt and fma per
   block, so the same bits. Each 32-block costs a token 4 vector operations instead of 7. */
template <class Q>
struct VnniRows {
    enum { YES = Q::QK == 32 && Q::NSUB == 1 && !Q::HAS_MIN && ActOf<Q>::KIND == ACT_Q8_0 && !GgmlDot<Q>::EXACT };
};

/* The activations of groups of up to 8 tokens packed for the loop below: per group and block, each token's
   8 int32 lanes of -128 x the sums of its 4 activations (bias) and its 32 int8 activations, then the 8 tokens'
   Q8_0 scales dx. One pointer walks it: the token's operands sit at fixed offsets. */
enum { VNNI_GROUP = 8, VNNI_TOKEN_BYTES = 64, VNNI_BLOCK_BYTES = VNNI_GROUP * VNNI_TOKEN_BYTES + 32 };

static uint8_t *vnni_pack(const ActRows *a, idx_t T, idx_t n_in) {
    const idx_t nb = n_in / 32, groups = (T + VNNI_GROUP - 1) / VNNI_GROUP;
    uint8_t *mem = (uint8_t *)aligned_alloc(64, (size_t)((groups * nb * VNNI_BLOCK_BYTES + 127) / 64 * 64));
    if (!mem) return NULL;
    memset(mem, 0, (size_t)(groups * nb * VNNI_BLOCK_BYTES));
    for (idx_t t = 0; t < T; ++t)
        for (idx_t b = 0; b < nb; ++b) {
            uint8_t *blk = mem + ((t / VNNI_GROUP) * nb + b) * VNNI_BLOCK_BYTES;
            const int8_t *x = a->q + t * n_in + 32 * b;
            int32_t *bias = (int32_t *)(blk + (t % VNNI_GROUP) * VNNI_TOKEN_BYTES);
            for (int i = 0; i < 8; ++i) bias[i] = -128 * ((int32_t)x[4 * i] + x[4 * i + 1] + x[4 * i + 2] + x[4 * i + 3]);
            memcpy(blk + (t % VNNI_GROUP) * VNNI_TOKEN_BYTES + 32, x, 32);
            ((float *)(blk + VNNI_GROUP * VNNI_TOKEN_BYTES))[t % VNNI_GROUP] = a->d[t * nb + b];
        }
    return mem;
}

/* output row o times the NT tokens of one packed group (their accumulators stay in registers). The scales
   dl x dx of the 8 tokens come from one vector multiply (the same float product as the scalar one) and each
   token's is broadcast by a permute (a scalar multiply and broadcast per token, or broadcasts from a stack
   copy, which made GCC store the accumulators every block, were 1.6x slower at 8 tokens). */
template <class Q, int NT>
static inline void vnni_rows(const uint8_t *row, idx_t nb, const uint8_t *pack, float *y, idx_t n_out) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    alignas(32) int8_t qbuf[32];
    float dl[1], mb[1];
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (idx_t b = 0; b < nb; ++b) {
        __builtin_prefetch(row + b * Q::BS + PREFETCH);
        const uint8_t *p = pack + b * VNNI_BLOCK_BYTES;
        const int8_t *q = Q::unpack(row + b * Q::BS, qbuf, dl, mb);
        const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)q), flip);
        const __m256 scales = _mm256_mul_ps(_mm256_set1_ps(dl[0]), _mm256_load_ps((const float *)(p + VNNI_GROUP * VNNI_TOKEN_BYTES)));
        for (int t = 0; t < NT; ++t) {
            const __m256i bias = _mm256_load_si256((const __m256i *)(p + t * VNNI_TOKEN_BYTES));
            const __m256i x = _mm256_load_si256((const __m256i *)(p + t * VNNI_TOKEN_BYTES + 32));
            const __m256 s = _mm256_permutevar8x32_ps(scales, _mm256_set1_epi32(t));
            acc[t] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(aq_dpbusd(bias, u, x)), acc[t]);
        }
    }
    for (int t = 0; t < NT; ++t) y[t * n_out] = acc8_total(acc[t]);
}

/* output rows o0 .. o1 - 1 times every token, a group of 8 at a time over the range: the range's weights
   (VNNI_ROWS rows) stay in L2 and the group's packed activations in L1 while the other groups come through */
enum { VNNI_ROWS = 32 };

template <class Q, int NT>
static void vnni_range(const uint8_t *W, idx_t rb, idx_t nb, const uint8_t *g, idx_t o0, idx_t o1, float *yg, idx_t n_out) {
    for (idx_t o = o0; o < o1; ++o) vnni_rows<Q, NT>(W + o * rb, nb, g, yg + o, n_out);
}

/* a 32-block row unpacked once for every token group: per block its float scale and 32 int8 codes */
struct Unpacked32 {
    enum { QK = 32, BS = 36, SUB = 32, NSUB = 1, HAS_MIN = 0 };
    static inline const int8_t *unpack(const uint8_t *b, int8_t *, float *dl, float *) {
        memcpy(dl, b, 4);
        return (const int8_t *)(b + 4);
    }
};

template <class Q>
static void vnni_groups(const uint8_t *W, idx_t rb, idx_t nb, const uint8_t *pack, idx_t T, idx_t o0, idx_t o1,
                        float *Y, idx_t n_out) {
    for (idx_t t0 = 0; t0 < T; t0 += VNNI_GROUP) {
        const uint8_t *g = pack + (t0 / VNNI_GROUP) * nb * VNNI_BLOCK_BYTES;
        float *yg = Y + t0 * n_out;
        switch (T - t0 < VNNI_GROUP ? (int)(T - t0) : VNNI_GROUP) {
        case 1: vnni_range<Q, 1>(W, rb, nb, g, o0, o1, yg, n_out); break;
        case 2: vnni_range<Q, 2>(W, rb, nb, g, o0, o1, yg, n_out); break;
        case 3: vnni_range<Q, 3>(W, rb, nb, g, o0, o1, yg, n_out); break;
        case 4: vnni_range<Q, 4>(W, rb, nb, g, o0, o1, yg, n_out); break;
        case 5: vnni_range<Q, 5>(W, rb, nb, g, o0, o1, yg, n_out); break;
        case 6: vnni_range<Q, 6>(W, rb, nb, g, o0, o1, yg, n_out); break;
        case 7: vnni_range<Q, 7>(W, rb, nb, g, o0, o1, yg, n_out); break;
        default: vnni_range<Q, 8>(W, rb, nb, g, o0, o1, yg, n_out); break;
        }
    }
}

/* Output rows in ranges of VNNI_ROWS, one range per OpenMP task. With more than one token group the range's
   blocks are first unpacked (Unpacked32), so a Q4_0 / Q5_0 block is decoded once and not once per group. */
template <class Q>
static int run_vnni(const uint8_t *W, idx_t n_out, idx_t n_in, const ActRows *a, idx_t T, float *Y, int threaded) {
    const idx_t nb = n_in / 32, rb = nb * Q::BS, n_ranges = (n_out + VNNI_ROWS - 1) / VNNI_ROWS;
    const int unpack = T > VNNI_GROUP;
    uint8_t *pack = vnni_pack(a, T, n_in);
    if (!pack) return -1;
    int failed = 0;
#pragma omp parallel if (threaded)
    {
        uint8_t *buf = unpack ? (uint8_t *)malloc((size_t)(VNNI_ROWS * nb * Unpacked32::BS)) : NULL;
        if (unpack && !buf) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (idx_t i = 0; i < n_ranges; ++i) {
                const idx_t o0 = i * VNNI_ROWS, o1 = n_out - o0 < VNNI_ROWS ? n_out : o0 + VNNI_ROWS;
                if (!unpack) {
                    vnni_groups<Q>(W, rb, nb, pack, T, o0, o1, Y, n_out);
                    continue;
                }
                alignas(32) int8_t qbuf[32];
                float mb[1];
                for (idx_t o = o0; o < o1; ++o)
                    for (idx_t b = 0; b < nb; ++b) {
                        uint8_t *dst = buf + ((o - o0) * nb + b) * Unpacked32::BS;
                        memcpy(dst + 4, Q::unpack(W + o * rb + b * Q::BS, qbuf, (float *)dst, mb), 32);
                    }
                vnni_groups<Unpacked32>(buf, nb * Unpacked32::BS, nb, pack, T, 0, o1 - o0, Y + o0, n_out);
            }
        }
        free(buf);
    }
    free(pack);
    return failed ? -1 : 0;
}
#else
template <class Q>
struct VnniRows {
    enum { YES = 0 };
};
template <class Q>
static int run_vnni(const uint8_t *, idx_t, idx_t, const ActRows *, idx_t, float *, int) { return -1; }
#endif

/* Which arithmetic a T-row product takes (each row's own, whatever the other rows):
   - Q4_K / Q5_K / Q6_K (AVX2): ggml's vec_dot for T < 8, its tiled matmul for T >= 8 (run_ggml_panels), as
     llama.cpp switches (ggml-cpu/tiled, ggml_tiled_min_batch);
   - the 32-blocks with Q8_0 activations: the integer per-block order of a one-token product at every T, with
     vpdpbusd from T >= 2 where the CPU has VNNI (run_vnni), else in register-blocked panels from T >= 16;
     Q4_1 / Q5_1 (Q8_1's fp16 block sum s in the offset term) the same in the token-chunked loop below;
   - Q2_K / Q3_K at T >= 16: the activation blocks dequantized (d * q, as ggml's dequantize_row_q8_K) and
     multiplied by the float kernel (run<Q>): the same values up to float32 summation order. */
enum { GGML_FLOAT_MIN_T = 16, GGML_PANEL_MIN_T = 16 };

template <class Q>
static int run_ggml(const uint8_t *W, idx_t n_out, idx_t n_in, const float *X, idx_t T, float *Y) {
    static_assert(ActOf<Q>::PER_BLOCK == 1 || GgmlDot<Q>::EXACT, "the paths below index one activation block per weight block");
    const idx_t nb = n_in / Q::QK, rb = nb * Q::BS, nd = nb * ActOf<Q>::PER_BLOCK;
    ActRows a;
    if (act_alloc(&a, T, n_in, nd) != 0) return -1;
    quantize_acts<Q>(X, T, n_in, &a);
    const int threaded = (double)n_out * (double)rb * (double)T >= 65536.0;
    if (VnniRows<Q>::YES && T >= 2) {
        const int status = run_vnni<Q>(W, n_out, n_in, &a, T, Y, threaded);
        free(a.mem);
        return status;
    }
    if ((GgmlDot<Q>::EXACT && GgmlTiled<Q>::YES && T >= GGML_TILED_MIN_T) ||
        (AQ_AVX2 && ActOf<Q>::KIND == ACT_Q8_0 && ActOf<Q>::PER_BLOCK == 1 && T >= GGML_PANEL_MIN_T)) {
        const int status = run_ggml_panels<Q>(W, n_out, n_in, &a, T, Y, threaded);
        free(a.mem);
        return status;
    }
    if (T >= GGML_FLOAT_MIN_T && ActOf<Q>::KIND != ACT_Q8_1 && !GgmlDot<Q>::EXACT) {
        float *xr = (float *)malloc(sizeof(float) * (size_t)(T * n_in));
        if (!xr) {
            free(a.mem);
            return -1;
        }
        for (idx_t t = 0; t < T; ++t)
            for (idx_t b = 0; b < nb; ++b) {
                const float d = a.d[t * nb + b];
                for (int j = 0; j < Q::QK; ++j) xr[t * n_in + b * Q::QK + j] = d * (float)a.q[t * n_in + b * Q::QK + j];
            }
        free(a.mem);
        const int status = run<Q>(W, n_out, n_in, xr, T, Y);
        free(xr);
        return status;
    }
    if (GgmlDot<Q>::EXACT) {
#pragma omp parallel for schedule(static) collapse(2) if (threaded)
        for (idx_t o = 0; o < n_out; ++o)
            for (idx_t t = 0; t < T; ++t)
                Y[t * n_out + o] = GgmlDot<Q>::dot(W + o * rb, nb, a.q + t * n_in, a.d + t * nd, a.s16 + t * (n_in / 16));
        free(a.mem);
        return 0;
    }
    if (T == 1 && OneRowDot<Q>::EXACT) {
#pragma omp parallel for schedule(static) if (threaded)
        for (idx_t o = 0; o < n_out; ++o) Y[o] = OneRowDot<Q>::dot(W + o * rb, nb, a.q, a.d);
        free(a.mem);
        return 0;
    }
#if AQ_AVX2
    if (T == 1 && CodeOffset<Q>::OFF) {
        enum { R = AQ_OFFSET_HALVES ? 4 : 1 };
        const idx_t n_groups = n_out / R;
#pragma omp parallel for schedule(static) if (threaded)
        for (idx_t g = 0; g < n_groups; ++g) offset_rows<Q, R>(W, rb, nb, &a, g * R, Y);
        for (idx_t o = n_groups * R; o < n_out; ++o) offset_rows<Q, 1>(W, rb, nb, &a, o, Y);
        free(a.mem);
        return 0;
    }
#endif
    if (T == 1) {
#pragma omp parallel for schedule(static) if (threaded)
        for (idx_t o = 0; o < n_out; ++o) {
            const uint8_t *row = W + o * rb;
            alignas(64) int8_t qbuf[Q::QK];
            float dl[Q::NSUB], mb[Q::NSUB];
            acc8 acc = acc8_zero();
            float macc = 0.0f;
            for (idx_t b = 0; b < nb; ++b) {
                __builtin_prefetch(row + b * Q::BS + PREFETCH);
                const int8_t *q = Q::unpack(row + b * Q::BS, qbuf, dl, mb);
                acc = dot_block_int<Q>(q, dl, a.q + b * Q::QK, a.d[b], acc);
                if (Q::HAS_MIN) macc += offset_block<Q>(mb, &a, n_in, nb, 0, b);
            }
            Y[o] = acc8_total(acc) + macc;
        }
        free(a.mem);
        return 0;
    }
    enum { TC = 16 }; /* tokens per pass over a row's blocks */
    const idx_t n_chunks = (T + TC - 1) / TC;
#pragma omp parallel for schedule(static) collapse(2) if (threaded)
    for (idx_t o = 0; o < n_out; ++o) {
        for (idx_t c = 0; c < n_chunks; ++c) {
            const uint8_t *row = W + o * rb;
            const idx_t t0 = c * TC, nt = T - t0 < TC ? T - t0 : TC;
            acc8 acc[TC];
            float macc[TC];
            alignas(64) int8_t qbuf[Q::QK];
            float dl[Q::NSUB], mb[Q::NSUB];
            for (idx_t t = 0; t < nt; ++t) {
                acc[t] = acc8_zero();
                macc[t] = 0.0f;
            }
            for (idx_t b = 0; b < nb; ++b) {
                __builtin_prefetch(row + b * Q::BS + PREFETCH);
                const int8_t *q = Q::unpack(row + b * Q::BS, qbuf, dl, mb);
                for (idx_t t = 0; t < nt; ++t) {
                    acc[t] = dot_block_int<Q>(q, dl, a.q + (t0 + t) * n_in + b * Q::QK, a.d[(t0 + t) * nb + b], acc[t]);
                    if (Q::HAS_MIN) macc[t] += offset_block<Q>(mb, &a, n_in, nb, t0 + t, b);
                }
            }
            for (idx_t t = 0; t < nt; ++t) Y[(t0 + t) * n_out + o] = acc8_total(acc[t]) + macc[t];
        }
    }
    free(a.mem);
    return 0;
}


/* Mixture of experts: Y[t, j, :] = X[t] (X[t, j] when x_per_rank) @ dequant(W[ids[t, j]]).T, W (n_expert, n_out,
   row bytes). The (t, j) pairs are grouped by expert and each expert's rows go through run<Q> once, with
   its routed tokens as the batch: only the chosen experts' blocks are read, and a pair's result is the
   one-token product of its row (run<Q>'s contract for T < 16). 0: done; 1: out of memory; -1 - i: ids[i]
   is not an expert. */
template <class Q, int GGML>
static idx_t run_experts(const uint8_t *W, idx_t n_expert, idx_t n_out, idx_t n_in, const float *X, int x_per_rank,
                         const int64_t *ids, idx_t T, idx_t K, float *Y) {
    const idx_t rb = (n_in / Q::QK) * Q::BS, n = T * K;
    for (idx_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= n_expert) return -1 - i;
    idx_t *start = (idx_t *)calloc((size_t)(n_expert + 1), sizeof(idx_t));
    idx_t *order = (idx_t *)malloc(sizeof(idx_t) * (size_t)(n + 1));
    float *xb = (float *)malloc(sizeof(float) * (size_t)(n * n_in + 1));
    float *yb = (float *)malloc(sizeof(float) * (size_t)(n * n_out + 1));
    idx_t status = 0;
    if (!start || !order || !xb || !yb) {
        status = 1;
        goto done;
    }
    for (idx_t i = 0; i < n; ++i) start[ids[i] + 1] += 1;
    for (idx_t e = 0; e < n_expert; ++e) start[e + 1] += start[e];
    {
        idx_t *fill = (idx_t *)malloc(sizeof(idx_t) * (size_t)(n_expert + 1));
        if (!fill) {
            status = 1;
            goto done;
        }
        memcpy(fill, start, sizeof(idx_t) * (size_t)(n_expert + 1));
        for (idx_t i = 0; i < n; ++i) order[fill[ids[i]]++] = i; /* pairs in (t, j) order within an expert */
        free(fill);
    }
    for (idx_t e = 0; e < n_expert; ++e) {
        const idx_t a = start[e], cnt = start[e + 1] - start[e];
        if (!cnt) continue;
        for (idx_t r = 0; r < cnt; ++r) {
            const idx_t i = order[a + r];
            memcpy(xb + r * n_in, X + (x_per_rank ? i : i / K) * n_in, sizeof(float) * (size_t)n_in);
        }
        const int failed = GGML ? run_ggml<Q>(W + e * n_out * rb, n_out, n_in, xb, cnt, yb)
                                : run<Q>(W + e * n_out * rb, n_out, n_in, xb, cnt, yb);
        if (failed != 0) {
            status = 1;
            goto done;
        }
        for (idx_t r = 0; r < cnt; ++r) memcpy(Y + order[a + r] * n_out, yb + r * n_out, sizeof(float) * (size_t)n_out);
    }
done:
    free(start);
    free(order);
    free(xb);
    free(yb);
    return status;
}

}  // namespace alchemist_q
