
#include <math.h>
#include <string.h>
#include <stdint.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
namespace alchemist_gelu {
static float table[65536];
static int ready = 0;

static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (e == 0x1f) bits = sign | 0x7f800000u | (m << 13);
    else if (e == 0) { f = (float)m * 5.9604644775390625e-08f; memcpy(&bits, &f, 4); bits |= sign; }
    else bits = sign | ((e + 112u) << 23) | (m << 13);
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t f2h(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    /* ggml_compute_fp32_to_fp16 (ggml-impl.h): round to nearest even */
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    uint32_t w, bits;
    memcpy(&w, &f, 4);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bb = (bias >> 1) + 0x07800000u;
    float fb;
    memcpy(&fb, &bb, 4);
    base = fb + base;
    memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

static void build(void) {
    if (ready) return;
    for (int i = 0; i < 65536; ++i) {
        const float x = h2f((uint16_t)i);
        /* ggml_gelu_f32, with 1 + a * x * x contracted into an fma as llama.cpp's build does (checked: all 65536
           entries equal its ggml_table_gelu_f16) */
        const float g = 0.5f * x * (1.0f + tanhf(0.79788456080286535587989211986876f * x * fmaf(0.044715f * x, x, 1.0f)));
        table[i] = h2f(f2h(g));
    }
    ready = 1;
}

static void apply(const float *x, float *y, long long n) {
    for (long long i = 0; i < n; ++i) {
        const float v = x[i];
        y[i] = v <= -10.0f ? 0.0f : (v >= 10.0f ? v : table[f2h(v)]);
    }
}
}  // namespace alchemist_gelu
