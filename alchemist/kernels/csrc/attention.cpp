
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "v_expf_includes.h"

#define ATTN_AVX2 V_EXPF8
namespace alchemist_attn {
typedef long long idx_t;

#include "v_expf.h"

/* an __m256's sum as tinyBLAS's hsum and ggml_vec_soft_max_f32 take it */
static inline float hsum8(const float *v) {
    const float t0 = v[4] + v[0], t1 = v[5] + v[1], t2 = v[6] + v[2], t3 = v[7] + v[3];
    return (t0 + t2) + (t1 + t3);
}

/* GGML_F32x8_REDUCE of ggml_vec_dot_f32's four accumulators (accumulator j at a[8j .. 8j + 7]) */
static inline float reduce32(const float *a) {
    float r[8];
    for (int l = 0; l < 8; ++l) r[l] = (a[l] + a[16 + l]) + (a[8 + l] + a[24 + l]);
    const float t0 = r[0] + r[4], t1 = r[1] + r[5], t2 = r[2] + r[6], t3 = r[3] + r[7];
    return (t0 + t1) + (t2 + t3);
}


/* ggml_vec_dot_f32 as compiled for AVX2 + FMA */
static inline float vec_dot(idx_t n, const float *x, const float *y) {
    const idx_t np = n & ~(idx_t)31;
    float s;
#if ATTN_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (idx_t i = 0; i < np; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(y + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(y + i + 24), a3);
    }
    a0 = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    s = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
#else
    float acc[32];
    for (int l = 0; l < 32; ++l) acc[l] = 0.0f;
    for (idx_t i = 0; i < np; i += 32)
        for (int l = 0; l < 32; ++l) acc[l] = fmaf(x[i + l], y[i + l], acc[l]);
    s = reduce32(acc);
#endif
    idx_t i = np;
    /* the tail loop `sumf += x[i]*y[i]`, vectorized by the compiler: products, then added in order */
    if (n - i >= 8) {
        for (; i + 8 <= n; i += 8) {
            float p[8];
            for (int l = 0; l < 8; ++l) p[l] = x[i + l] * y[i + l];
            for (int l = 0; l < 8; ++l) s = s + p[l];
        }
    }
    if (n - i >= 4) {
        float p[4];
        for (int l = 0; l < 4; ++l) p[l] = x[i + l] * y[i + l];
        for (int l = 0; l < 4; ++l) s = s + p[l];
        i += 4;
    }
    for (; i < n; ++i) s = fmaf(x[i], y[i], s);
    return s;
}

/* exp(w - mx) of 8 cells in place (masked cells hold -inf and give 0); returns their 8-lane sum */
static inline float exp8(float *w, float mx) {
#if ATTN_AVX2
    const __m256 val = v_expf8(_mm256_sub_ps(_mm256_loadu_ps(w), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(w, val);
    __m128 v2 = _mm_add_ps(_mm256_extractf128_ps(val, 1), _mm256_castps256_ps128(val));
    v2 = _mm_add_ps(v2, _mm_movehl_ps(v2, v2));
    v2 = _mm_add_ss(v2, _mm_movehdup_ps(v2));
    return _mm_cvtss_f32(v2);
#else
    for (int l = 0; l < 8; ++l) w[l] = w[l] == -INFINITY ? 0.0f : v_expf(w[l] - mx);
    return hsum8(w);
#endif
}

/* a[d] += v[d] * p (fma), d < D */
static inline void axpy(idx_t D, float *a, const float *v, float p) {
    idx_t d = 0;
#if ATTN_AVX2
    const __m256 p8 = _mm256_set1_ps(p);
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(a + d, _mm256_fmadd_ps(_mm256_loadu_ps(v + d), p8, _mm256_loadu_ps(a + d)));
#endif
    for (; d < D; ++d) a[d] = fmaf(v[d], p, a[d]);
}

/* q (B*T, H, D); k, v (B, S, KVH, D) -- or, with kslot, caches of slots of krows rows (., krows, KVH, D) whose
   slot kslot[b] holds sequence b's keys in its first S rows, read in place; qpos (B, T); kpos (B, S); sinks (H) or
   NULL; out (B*T, H*D). Returns 0, or -1 when out of memory. */
static int attend_slots(const float *q, const float *k, const float *v, const int64_t *qpos, const int64_t *kpos,
                        const float *sinks, float *out, idx_t B, idx_t T, idx_t S, idx_t H, idx_t KVH, idx_t D,
                        idx_t window, float scale, float softcap, const int64_t *kslot, idx_t krows) {
    const idx_t G = H / KVH;
    const idx_t S8 = (S + 7) & ~(idx_t)7;
    const int sgemm = T >= 2 && D % 4 == 0;  /* llamafile_sgemm (tinyBLAS<8>) for T >= 2, else vec_dot */
    const idx_t lanes = sgemm ? 8 : 32;
    const idx_t rows = B * T * H;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    int n_threads = 1;
#ifdef _OPENMP
    n_threads = omp_get_max_threads();
#endif
    const size_t per_thread = (size_t)(S8 + lanes * D);
    float *scratch = (float *)malloc(sizeof(float) * per_thread * (size_t)n_threads);
    if (!scratch) return -1;
    /* threads only where the work is worth a fork: query rows x keys they may see x D (the cache's capacity S
       is not the work: a decode step early in a long cache sees a few keys) */
    double work = 0.0;
    for (idx_t b = 0; b < B; ++b) {
        int64_t last = -1;
        for (idx_t t = 0; t < T; ++t) last = qpos[b * T + t] > last ? qpos[b * T + t] : last;
        idx_t seen = 0;
        for (idx_t s = 0; s < S; ++s) seen += kpos[b * S + s] >= 0 && kpos[b * S + s] <= last;
        work += (double)T * (double)H * (double)seen * (double)D;
    }
#pragma omp parallel for schedule(static) if (rows > 1 && work > 32768.0)
    for (idx_t r = 0; r < rows; ++r) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *w = scratch + per_thread * (size_t)tid;  /* S8 scores, then the kqv accumulators */
        float *acc = w + S8;
        const idx_t b = r / (T * H), t = (r / H) % T, h = r % H, kh = h / G;
        const idx_t kb = kslot ? kslot[b] * krows : b * S;  /* sequence b's first key row */
        const float *qr = q + ((b * T + t) * H + h) * D;
        const int64_t qp = qpos[b * T + t];
        const int64_t *kp = kpos + b * S;
        float *o = out + ((b * T + t) * H + h) * D;
        float mx = -INFINITY;
        for (idx_t s = 0; s < S8; ++s) {
            const int visible = s < S && kp[s] >= 0 && kp[s] <= qp && (!window || qp - kp[s] < window);
            if (!visible) { w[s] = -INFINITY; continue; }
            float x = vec_dot(D, k + ((kb + s) * KVH + kh) * D, qr) * scale;
            if (softcap > 0.0f) x = tanhf(x * inv_cap) * softcap;
            w[s] = x;
            mx = x > mx ? x : mx;
        }
        if (sinks && sinks[h] > mx) mx = sinks[h];
        if (mx == -INFINITY) {  /* no key visible (a padding row): nothing to attend to */
            for (idx_t d = 0; d < D; ++d) o[d] = 0.0f;
            continue;
        }
        double sum = 0.0;
        for (idx_t c = 0; c < S8; c += 8) sum += (double)exp8(w + c, mx);
        if (sinks) sum += (double)expf(sinks[h] - mx);
        const float inv = (float)(1.0 / sum);
        memset(acc, 0, sizeof(float) * (size_t)(lanes * D));
        for (idx_t s = 0; s < S; ++s) {
            const int visible = kp[s] >= 0 && kp[s] <= qp && (!window || qp - kp[s] < window);
            if (!visible) continue;  /* p = 0: fma(v, 0, acc) == acc */
            axpy(D, acc + (s % lanes) * D, v + ((kb + s) * KVH + kh) * D, w[s] * inv);
        }
        /* each output's lanes summed as the kernel does, vectorized over d (lane l of output d at acc[l*D + d]) */
        if (sgemm) {  /* tinyBLAS hsum: t_m = lane m+4 + lane m; (t0 + t2) + (t1 + t3) */
            for (int m = 0; m < 4; ++m)
                for (idx_t d = 0; d < D; ++d) acc[m * D + d] = acc[(m + 4) * D + d] + acc[m * D + d];
            for (idx_t d = 0; d < D; ++d) o[d] = (acc[d] + acc[2 * D + d]) + (acc[D + d] + acc[3 * D + d]);
        } else {  /* GGML_F32x8_REDUCE: r_m = (a_m + a_16+m) + (a_8+m + a_24+m); t_m = r_m + r_m+4; (t0 + t1) + (t2 + t3) */
            for (int m = 0; m < 8; ++m)
                for (idx_t d = 0; d < D; ++d)
                    acc[m * D + d] = (acc[m * D + d] + acc[(16 + m) * D + d]) + (acc[(8 + m) * D + d] + acc[(24 + m) * D + d]);
            for (int m = 0; m < 4; ++m)
                for (idx_t d = 0; d < D; ++d) acc[m * D + d] = acc[m * D + d] + acc[(m + 4) * D + d];
            for (idx_t d = 0; d < D; ++d) o[d] = (acc[d] + acc[D + d]) + (acc[2 * D + d] + acc[3 * D + d]);
        }
    }
    free(scratch);
    return 0;
}

/* k, v (B, S, KVH, D): each sequence's keys in its own rows */
static int attend(const float *q, const float *k, const float *v, const int64_t *qpos, const int64_t *kpos,
                  const float *sinks, float *out, idx_t B, idx_t T, idx_t S, idx_t H, idx_t KVH, idx_t D,
                  idx_t window, float scale, float softcap) {
    return attend_slots(q, k, v, qpos, kpos, sinks, out, B, T, S, H, KVH, D, window, scale, softcap, NULL, S);
}
}  // namespace alchemist_attn
