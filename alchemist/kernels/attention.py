"""`CausalAttentionGgml`: a generated module's causal_attention() as llama.cpp's CPU backend computes it, bit for bit.

llama.cpp without flash attention and with an F32 KV cache (build_attn_mha) computes, per query head h of
KV head h // GROUP_SIZE, with its cache cells 0.. in position order (one fresh sequence):

    kq   = ggml_mul_mat(k, q)           every score by ggml_vec_dot_f32 (llamafile_sgemm refuses: q is a
                                        permuted view when T > 1, and sgemm only takes T >= 2)
    kq   = softcap · tanhf(kq · (1/softcap))     gemma2's logit softcap, three ops (ggml_scale, ggml_tanh)
    p    = ggml_soft_max_ext(kq, mask, kq_scale)  ops.cpp soft_max_f32: kq · scale + mask; max; in chunks of
                                        8 cells exp by ggml_v_expf (vec.h, AVX2 polynomial) and a float32
                                        8-lane sum added to a double; then every p times (float)(1.0 / sum);
                                        attention sinks add expf(sink - max) to the sum
    kqv  = ggml_mul_mat(v^T, p)         T >= 2: llamafile_sgemm (tinyBLAS<8, __m256>): one 8-lane fma
                                        accumulator per output over the cells, lane = cell % 8;
                                        T == 1: ggml_vec_dot_f32 over the cells

ggml_vec_dot_f32 (AVX2, GGML_F32_STEP 32): four 8-lane fma accumulators, element i in accumulator (i / 8) % 4,
reduced (a0 + a2) + (a1 + a3), then the two 128-bit halves added and two hadds; elements past the last multiple
of 32 as libggml-cpu.so's compiled tail takes them (blocks of 8 and 4: products, then added one by one; the
last 1..3 by fma). The 8-lane sums of tinyBLAS and of the softmax: halves added, then (t0 + t2) + (t1 + t3).

Cells beyond the sequence (llama.cpp pads its KV view to 256 cells) and masked cells have probability exactly 0
and add exactly nothing, so the lanes of cell s = cache row s are all that matter: the Op computes visible
keys only. The library was compiled for AVX2 + FMA (this machine; `objdump -d libggml-cpu.so`); a build for
AVX-512 would take other lanes. The C code writes every fma as fmaf() and is compiled with -ffp-contract=off.

C runs the loops (OpenMP over query rows), and Numba calls the same C code (kernels.numba_ops); `perform` and
the tests use the numpy transcription `attention_ggml_reference`; JAX and MLX call the C code too (kernels.jax_ffi,
mlx_host). Without it they get the generated module's float32 formula as PyTensor ops
(`expand_causal_attention_ggml`, tagged "jax" and "mlx"; on Numba when the ops library cannot be built), which
equals this up to rounding.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.link.c.op import COp

from alchemist.kernels.expansion import register_expansion
from alchemist.kernels.native import register_numba_expansion

# before any namespace: the headers and the switch V_EXPF_C's eight-lane version needs
V_EXPF_INCLUDES = r"""
#if defined(__AVX2__) && defined(__FMA__) && !defined(ALCHEMIST_ATTN_PORTABLE)
#include <immintrin.h>
#define V_EXPF8 1
#else
#define V_EXPF8 0
#endif
"""

V_EXPF_C = r"""
static inline uint32_t fbits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float bitsf(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* ggml_v_expf (ggml-cpu/vec.h, the __m256 version), one lane; -inf gives +0 as the vector code does */
static inline float v_expf(float x) {
    const float r = 0x1.8p23f;
    const float z = fmaf(x, 0x1.715476p+0f, r);
    const float n = z - r;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const uint32_t e = fbits(z) << 23;
    const float k = bitsf(e + fbits(1.0f));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                         0x1.ffffecp-1f * b);
    if (!(fabsf(n) > 126.0f)) return fmaf(j, k, k);
    const uint32_t g = (n <= 0.0f) ? 0x82000000u : 0u;
    const float s1 = bitsf(g + 0x7f000000u);
    const float s2 = bitsf(e - g);
    if (fabsf(n) > 192.0f) return s1 * s1;
    return fmaf(s2, j, s2) * s1;
}
#if V_EXPF8
/* ggml_v_expf verbatim: eight lanes */
static inline __m256 v_expf8(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256i c = _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(126), _CMP_GT_OQ));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                                                     _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
                                     u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm256_movemask_ps(_mm256_castsi256_ps(c))) return _mm256_fmadd_ps(j, k, k);
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)), _mm256_set1_epi32(0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000u)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256i d = _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(192), _CMP_GT_OQ));
    return _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
                        _mm256_andnot_ps(_mm256_castsi256_ps(d),
                                         _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(c), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                                      _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)))));
}
#endif
"""

ATTENTION_C = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
""" + V_EXPF_INCLUDES + r"""
#define ATTN_AVX2 V_EXPF8
namespace alchemist_attn {
typedef long long idx_t;

""" + V_EXPF_C + r"""
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

/* q (B*T, H, D); k, v (B, S, KVH, D); qpos (B, T); kpos (B, S); sinks (H) or NULL; out (B*T, H*D).
   Returns 0, or -1 when out of memory. */
static int attend(const float *q, const float *k, const float *v, const int64_t *qpos, const int64_t *kpos,
                  const float *sinks, float *out, idx_t B, idx_t T, idx_t S, idx_t H, idx_t KVH, idx_t D,
                  idx_t window, float scale, float softcap) {
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
        const float *qr = q + ((b * T + t) * H + h) * D;
        const int64_t qp = qpos[b * T + t];
        const int64_t *kp = kpos + b * S;
        float *o = out + ((b * T + t) * H + h) * D;
        float mx = -INFINITY;
        for (idx_t s = 0; s < S8; ++s) {
            const int visible = s < S && kp[s] >= 0 && kp[s] <= qp && (!window || qp - kp[s] < window);
            if (!visible) { w[s] = -INFINITY; continue; }
            float x = vec_dot(D, k + ((b * S + s) * KVH + kh) * D, qr) * scale;
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
            axpy(D, acc + (s % lanes) * D, v + ((b * S + s) * KVH + kh) * D, w[s] * inv);
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
}  // namespace alchemist_attn
"""


# -- numpy transcription (perform, and the tests' reference) -------------------------------------------------
def _fma32(a, b, c):
    """float32 fma(a, b, c), correctly rounded: a·b is exact in float64; the float64 sum is rounded to odd
    (Boldo & Melquiond), so the final rounding to float32 is the single rounding of the exact result."""
    a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
    p = a * b
    with np.errstate(invalid="ignore"):  # infinities: s is already the answer, err NaN changes nothing
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _libm_f32(name: str):
    """libm's float function `name` (tanhf, expf: the very function the C code and ggml call), else numpy's."""
    import ctypes
    import ctypes.util

    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6"), name)
    except (OSError, AttributeError):
        return {"tanhf": np.tanh, "expf": np.exp}[name]
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return lambda x: np.float32(fn(float(np.float32(x))))


def _h(hex_literal: str):
    """A C hexadecimal float literal as float32 (exact: each has at most 24 significant bits)."""
    return np.float32(float.fromhex(hex_literal))


def v_expf_reference(x):
    """ggml_v_expf lane by lane (numpy float32 arrays)."""
    x = np.asarray(x, np.float32)
    r = _h("0x1.8p23")
    z = _fma32(x, _h("0x1.715476p0"), r)
    n = (z - r).astype(np.float32)
    b = _fma32(-n, _h("0x1.7f7d1cp-20"), _fma32(-n, _h("0x1.62e4p-1"), x))
    e = (z.view(np.uint32) << np.uint32(23)).astype(np.uint32)
    k = (e + np.float32(1).view(np.uint32)).astype(np.uint32).view(np.float32)
    u = (b * b).astype(np.float32)
    inner = _fma32(
        _fma32(_h("0x1.0e4020p-7"), b, _h("0x1.573e2ep-5")), u, _fma32(_h("0x1.555e66p-3"), b, _h("0x1.fffdb6p-2"))
    )
    j = _fma32(inner, u, (_h("0x1.ffffecp-1") * b).astype(np.float32))
    g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0)).astype(np.uint32)
    s1 = (g + np.uint32(0x7F000000)).astype(np.uint32).view(np.float32)
    s2 = (e - g).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        big = (s1 * s1).astype(np.float32)
        mid = (_fma32(s2, j, s2) * s1).astype(np.float32)
    out = np.where(np.abs(n) > 192, big, mid)
    return np.where(np.abs(n) > 126, out, _fma32(j, k, k)).astype(np.float32)


def _hsum8(v):
    v = np.asarray(v, np.float32)
    t = [np.float32(v[4 + i] + v[i]) for i in range(4)]
    return np.float32(np.float32(t[0] + t[2]) + np.float32(t[1] + t[3]))


def _reduce32(a):
    a = np.asarray(a, np.float32)
    r = ((a[0:8] + a[16:24]).astype(np.float32) + (a[8:16] + a[24:32]).astype(np.float32)).astype(np.float32)
    t = (r[0:4] + r[4:8]).astype(np.float32)
    return np.float32(np.float32(t[0] + t[1]) + np.float32(t[2] + t[3]))


def vec_dot_reference(x, y):
    """ggml_vec_dot_f32 as libggml-cpu.so (AVX2 + FMA) computes it."""
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    n = x.size
    np_ = n & ~31
    acc = np.zeros(32, np.float32)
    for i in range(0, np_, 32):
        acc = _fma32(x[i : i + 32], y[i : i + 32], acc)
    s = _reduce32(acc)
    i = np_
    while n - i >= 8:
        for p in (x[i : i + 8] * y[i : i + 8]).astype(np.float32):
            s = np.float32(s + p)
        i += 8
    if n - i >= 4:
        for p in (x[i : i + 4] * y[i : i + 4]).astype(np.float32):
            s = np.float32(s + p)
        i += 4
    for j in range(i, n):
        s = _fma32(x[j], y[j], s)
    return np.float32(s)


def attention_ggml_reference(q, keys, values, q_positions, key_positions, window=0, scale=1.0, softcap=0.0, sinks=None):
    """CausalAttentionGgml in numpy (slow; small shapes): q (B*T, H, D), keys/values (B, S, KVH, D), positions
    (B, T) and (B, S) -> (B*T, H*D)."""
    q, keys, values = (np.asarray(a, np.float32) for a in (q, keys, values))
    qpos, kpos = np.asarray(q_positions, np.int64), np.asarray(key_positions, np.int64)
    n_seq, n_keys, n_kv_head, dim = keys.shape
    n_tok, n_head = q.shape[0] // n_seq, q.shape[1]
    group = n_head // n_kv_head
    sgemm = n_tok >= 2 and dim % 4 == 0
    lanes = 8 if sgemm else 32
    s8 = -(-n_keys // 8) * 8
    scale, softcap = np.float32(scale), np.float32(softcap)
    tanhf, expf = _libm_f32("tanhf"), _libm_f32("expf")
    out = np.zeros((n_seq * n_tok, n_head, dim), np.float32)
    for b in range(n_seq):
        for t in range(n_tok):
            qp = qpos[b, t]
            vis = (kpos[b] >= 0) & (kpos[b] <= qp)
            if window:
                vis &= qp - kpos[b] < window
            for h in range(n_head):
                kh = h // group
                w = np.full(s8, -np.inf, np.float32)
                for s in np.flatnonzero(vis):
                    x = np.float32(vec_dot_reference(keys[b, s, kh], q[b * n_tok + t, h]) * scale)
                    if softcap > 0:
                        x = np.float32(tanhf(np.float32(x * np.float32(np.float32(1) / softcap))) * softcap)
                    w[s] = x
                mx = w.max()
                if sinks is not None:
                    mx = max(mx, np.float32(sinks[h]))
                if mx == -np.inf:
                    continue
                with np.errstate(invalid="ignore"):
                    e = np.where(w == -np.inf, np.float32(0), v_expf_reference((w - mx).astype(np.float32)))
                total = 0.0
                for c in range(0, s8, 8):
                    total += float(_hsum8(e[c : c + 8]))
                if sinks is not None:
                    total += float(expf(np.float32(np.float32(sinks[h]) - mx)))
                p = (e * np.float32(1.0 / total)).astype(np.float32)
                acc = np.zeros((lanes, dim), np.float32)
                for s in np.flatnonzero(vis):
                    acc[s % lanes] = _fma32(values[b, s, kh], p[s], acc[s % lanes])
                red = _hsum8 if sgemm else _reduce32
                out[b * n_tok + t, h] = [red(acc[:, d]) for d in range(dim)]
    return out.reshape(n_seq * n_tok, n_head * dim)


_GLUE_VERSION = 2  # bump when c_code (the Python-side glue) changes; the kernel source is hashed


# -- the Op ------------------------------------------------------------------------------------------------
class CausalAttentionGgml(COp):
    """causal_attention(q, keys, values, q_positions, key_positions[, sinks]) as ggml computes it (module
    docstring). q (B*T, N_HEAD, HEAD_DIM), keys/values (B, S, N_KV_HEAD, HEAD_DIM) float32, positions int64
    (B, T) and (B, S), sinks (N_HEAD,) float32 when has_sinks -> (B*T, N_HEAD*HEAD_DIM) float32.
    scale multiplies q·k (1.0 where the queries are pre-scaled), then the softcap (0: none) applies."""

    __props__ = ("n_head", "n_kv_head", "head_dim", "window", "scale", "softcap", "has_sinks")

    def __init__(self, n_head, n_kv_head, head_dim, window=0, scale=1.0, softcap=0.0, has_sinks=False):
        self.n_head, self.n_kv_head, self.head_dim = int(n_head), int(n_kv_head), int(head_dim)
        if self.n_head % self.n_kv_head:
            raise ValueError(f"CausalAttentionGgml: {n_head} query heads do not share {n_kv_head} KV heads evenly")
        self.window = int(window or 0)
        self.scale = float(np.float32(scale))
        self.softcap = float(np.float32(softcap or 0.0))
        self.has_sinks = bool(has_sinks)

    def make_node(self, q, keys, values, q_positions, key_positions, *sinks):
        q, keys, values = (pt.as_tensor_variable(x) for x in (q, keys, values))
        q_positions, key_positions = pt.as_tensor_variable(q_positions), pt.as_tensor_variable(key_positions)
        for name, x, nd in (("q", q, 3), ("keys", keys, 4), ("values", values, 4)):
            if x.type.dtype != "float32" or x.type.ndim != nd:
                raise TypeError(f"CausalAttentionGgml: {name} must be a {nd}-d float32 tensor, got {x.type}")
        q_positions, key_positions = pt.cast(q_positions, "int64"), pt.cast(key_positions, "int64")
        inputs = [q, keys, values, q_positions, key_positions]
        if self.has_sinks != bool(sinks):
            raise TypeError(f"CausalAttentionGgml(has_sinks={self.has_sinks}) called with {len(sinks)} sinks inputs")
        if sinks:
            inputs.append(pt.cast(pt.as_tensor_variable(sinks[0]), "float32"))
        width = self.n_head * self.head_dim
        out = pt.tensor(dtype="float32", shape=(q.type.shape[0], width))
        return Apply(self, inputs, [out])

    def infer_shape(self, node, shapes):
        return [(shapes[0][0], self.n_head * self.head_dim)]

    def perform(self, node, inputs, output_storage):
        q, keys, values, qpos, kpos, *sinks = inputs
        output_storage[0][0] = attention_ggml_reference(
            q, keys, values, qpos, kpos, self.window, self.scale, self.softcap, sinks[0] if sinks else None
        )

    def c_support_code(self, **kwargs):
        return ATTENTION_C

    def c_compile_args(self, **kwargs):
        from alchemist.kernels.op import _openmp_flags

        return [*_openmp_flags(), "-O3", "-ffp-contract=off"]

    def c_libraries(self, **kwargs):
        from alchemist.kernels.op import _openmp_flags

        return ["gomp"] if _openmp_flags() else []

    def c_code(self, node, name, inputs, outputs, sub):
        q, k, v, qp, kp, *sk = inputs
        (out,) = outputs
        fail = sub["fail"]
        conts = ", ".join(f"*{n}_ = NULL" for n in ("qc", "kc", "vc", "qpc", "kpc", "skc"))
        sinks = f"skc_ = PyArray_GETCONTIGUOUS({sk[0]}); if (!skc_) goto {name}_done;" if sk else ""
        sinks_ptr = "(const float *)PyArray_DATA(skc_)" if sk else "NULL"
        return f"""
        {{
            PyArrayObject {conts};
            int ok_ = 0;
            qc_ = PyArray_GETCONTIGUOUS({q}); kc_ = PyArray_GETCONTIGUOUS({k}); vc_ = PyArray_GETCONTIGUOUS({v});
            qpc_ = PyArray_GETCONTIGUOUS({qp}); kpc_ = PyArray_GETCONTIGUOUS({kp});
            if (!qc_ || !kc_ || !vc_ || !qpc_ || !kpc_) goto {name}_done;
            {sinks}
            {{
                const long long B_ = PyArray_DIM(kc_, 0), S_ = PyArray_DIM(kc_, 1), KVH_ = PyArray_DIM(kc_, 2);
                const long long D_ = PyArray_DIM(kc_, 3), H_ = PyArray_DIM(qc_, 1);
                const long long T_ = B_ ? PyArray_DIM(qc_, 0) / B_ : 0;
                if (H_ != {self.n_head} || KVH_ != {self.n_kv_head} || D_ != {self.head_dim} || PyArray_DIM(qc_, 2) != D_
                    || B_ * T_ != PyArray_DIM(qc_, 0) || PyArray_NDIM(vc_) != 4 || PyArray_DIM(vc_, 0) != B_
                    || PyArray_DIM(vc_, 1) != S_ || PyArray_DIM(vc_, 2) != KVH_ || PyArray_DIM(vc_, 3) != D_
                    || PyArray_SIZE(qpc_) != B_ * T_ || PyArray_SIZE(kpc_) != B_ * S_) {{
                    PyErr_SetString(PyExc_ValueError, "CausalAttentionGgml: inconsistent shapes");
                    goto {name}_done;
                }}
                npy_intp dims_[2] = {{(npy_intp)(B_ * T_), (npy_intp)(H_ * D_)}};
                if (!{out} || PyArray_NDIM({out}) != 2 || PyArray_DIM({out}, 0) != dims_[0] || PyArray_DIM({out}, 1) != dims_[1]
                    || !PyArray_IS_C_CONTIGUOUS({out}) || PyArray_TYPE({out}) != NPY_FLOAT32) {{
                    Py_XDECREF({out});
                    {out} = (PyArrayObject *)PyArray_EMPTY(2, dims_, NPY_FLOAT32, 0);
                    if (!{out}) goto {name}_done;
                }}
                if (alchemist_attn::attend((const float *)PyArray_DATA(qc_), (const float *)PyArray_DATA(kc_),
                    (const float *)PyArray_DATA(vc_), (const int64_t *)PyArray_DATA(qpc_), (const int64_t *)PyArray_DATA(kpc_),
                    {sinks_ptr}, (float *)PyArray_DATA({out}), B_, T_, S_, H_, KVH_, D_, {self.window}LL,
                    (float){self.scale!r}, (float){self.softcap!r}) != 0) {{
                    PyErr_NoMemory();
                    goto {name}_done;
                }}
                ok_ = 1;
            }}
            {name}_done:
            Py_XDECREF(qc_); Py_XDECREF(kc_); Py_XDECREF(vc_); Py_XDECREF(qpc_); Py_XDECREF(kpc_); Py_XDECREF(skc_);
            if (!ok_) {{ {fail} }}
        }}
        """

    def c_code_cache_version(self):
        return (_GLUE_VERSION, int(hashlib.sha256(ATTENTION_C.encode()).hexdigest()[:12], 16))


# -- the formula (other backends) and the module hook ---------------------------------------------------------
def causal_attention_formula(
    q,
    keys,
    values,
    q_positions,
    key_positions,
    n_head,
    n_kv_head,
    head_dim,
    window=0,
    scale=1.0,
    softcap=0.0,
    sinks=None,
):
    """The generated causal_attention() (templates/components/causal_attention.j2) as float32 PyTensor ops."""
    group = n_head // n_kv_head
    n_seq = keys.type.shape[0] if keys.type.shape[0] is not None else keys.shape[0]
    n_tokens = q.shape[0] // n_seq
    q = q.reshape((n_seq, n_tokens, n_kv_head, group, head_dim)).dimshuffle(0, 2, 3, 1, 4)
    q = q.reshape((n_seq * n_kv_head, group * n_tokens, head_dim))
    keys = keys.dimshuffle(0, 2, 3, 1).reshape((n_seq * n_kv_head, head_dim, -1))
    scores = pt.matmul(q, keys)
    if scale != 1.0:
        scores = scores * np.float32(scale)
    if softcap:
        scores = np.float32(softcap) * pt.tanh(scores / np.float32(softcap))
    key_pos = key_positions[:, None, :]
    query_pos = pt.tile(q_positions, (1, group))[:, :, None]
    visible = (key_pos >= 0) & (key_pos <= query_pos)
    if window:
        visible = visible & (query_pos - key_pos < window)
    scores = scores.reshape((n_seq, n_kv_head, group * n_tokens, -1))
    scores = pt.where(visible[:, None, :, :], scores, np.float32(-np.inf))
    if sinks is not None:
        sink = pt.repeat(sinks.reshape((n_kv_head, group)), n_tokens, axis=1)
        sink = pt.broadcast_to(sink[None, :, :, None], (n_seq, n_kv_head, group * n_tokens, 1))
        probs = pt.special.softmax(pt.concatenate([scores, sink], axis=-1), axis=-1)[:, :, :, :-1]
    else:
        probs = pt.special.softmax(scores, axis=-1)
    probs = probs.reshape((n_seq * n_kv_head, group * n_tokens, -1))
    values = values.dimshuffle(0, 2, 1, 3).reshape((n_seq * n_kv_head, -1, head_dim))
    out = pt.matmul(probs, values)
    out = out.reshape((n_seq, n_kv_head, group, n_tokens, head_dim)).dimshuffle(0, 3, 1, 2, 4)
    return out.reshape((n_seq * n_tokens, n_head * head_dim))


def attention_variant(module) -> dict | None:
    """How a generated module's causal_attention scales and caps its scores: {"scale", "softcap", "has_sinks"},
    read from the function's own source (the template's variants), or None when it is not one the Op knows."""
    import inspect

    fn = getattr(module, "causal_attention", None)
    if fn is None:
        return None
    signature = inspect.signature(fn).parameters
    params = list(signature)
    if params[:6] != ["q", "keys", "values", "q_positions", "key_positions", "window"] or params[6:] not in (
        [],
        ["sinks"],
    ):
        return None
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in signature.values()):
        return None  # not the template's function (e.g. this module's own replacement)
    source = inspect.getsource(fn)
    scaled = "* np.float32(SCORE_SCALE)" in source
    capped = "ATTN_LOGIT_SOFTCAP" in source
    return {
        "scale": float(module.SCORE_SCALE) if scaled else 1.0,
        "softcap": float(module.ATTN_LOGIT_SOFTCAP) if capped else 0.0,
        "has_sinks": params[6:] == ["sinks"],
    }


def ggml_causal_attention(module):
    """A replacement for `module`'s causal_attention computing as ggml does (the Op), or None when the module's
    attention is not one of the template's variants the Op reproduces."""
    variant = attention_variant(module)
    if variant is None:
        return None
    n_head, n_kv_head, head_dim = int(module.N_HEAD), int(module.N_KV_HEAD), int(module.HEAD_DIM)

    def causal_attention(q, keys, values, q_positions, key_positions, window, *sinks):
        op = CausalAttentionGgml(n_head, n_kv_head, head_dim, window, **variant)
        return op(q, keys, values, q_positions, key_positions, *sinks)

    return causal_attention


@node_rewriter([CausalAttentionGgml])
def expand_causal_attention_ggml(fgraph, node):
    op = node.op
    q, keys, values, qpos, kpos, *sinks = node.inputs
    out = causal_attention_formula(
        q,
        keys,
        values,
        qpos,
        kpos,
        op.n_head,
        op.n_kv_head,
        op.head_dim,
        op.window,
        op.scale,
        op.softcap,
        sinks[0] if sinks else None,
    )
    return [pt.specify_shape(out, node.outputs[0].type.shape) if None not in node.outputs[0].type.shape else out]


register_expansion("alchemist_expand_causal_attention_ggml", expand_causal_attention_ggml, backends=("jax", "mlx"))
# on Numba only without the ops library (otherwise Numba calls the C code: kernels.numba_ops)
register_numba_expansion("alchemist_expand_causal_attention_ggml_numba", expand_causal_attention_ggml)
