
#include <math.h>
#include <stdint.h>
namespace alchemist_rope {
// ggml.c ggml_rope_yarn_corr_dim(s): the pairs that turn beta_fast / beta_slow times in n_ctx_orig positions
static float corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return n_dims * logf(n_ctx_orig / (n_rot * 2 * (float)M_PI)) / (2 * logf(base));
}

static void cache(const int64_t *pos, long long n_pos, const float *ff, long long ff_stride, int n_dims,
                  float freq_base, float freq_scale, float ext_factor, float attn_factor, float beta_fast,
                  float beta_slow, int n_ctx_orig, float *out) {
    const long long n_pairs = n_dims / 2;
    const float theta_scale = powf(freq_base, -2.0f / n_dims);
    float low = 0.0f, high = 0.0f, yarn_mscale = 1.0f;
    if (ext_factor != 0.0f) {
        const float start = floorf(corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base));
        const float end = ceilf(corr_dim(n_dims, n_ctx_orig, beta_slow, freq_base));
        low = start > 0.0f ? start : 0.0f;
        high = end < (float)(n_dims - 1) ? end : (float)(n_dims - 1);
        yarn_mscale = fmaf(0.1f, logf(1.0f / freq_scale), 1.0f);
    }
    for (long long t = 0; t < n_pos; ++t) {
        float theta = (float)pos[t];
        float *c = out + t * n_pairs * 2;
        for (long long i = 0; i < n_pairs; ++i) {
            const float extrap = ff ? theta / ff[i * ff_stride] : theta;
            const float interp = freq_scale * extrap;
            float th = interp, mscale = attn_factor;
            if (ext_factor != 0.0f) {
                const float diff = high - low;
                const float y = ((float)i - low) / (0.001f > diff ? 0.001f : diff);
                const float ramp = 1.0f - (y < 0.0f ? 0.0f : (y > 1.0f ? 1.0f : y));
                const float mix = ramp * ext_factor;
                th = fmaf(interp, 1.0f - mix, extrap * mix);
                mscale = yarn_mscale * attn_factor;
            }
            float s, co;
            sincosf(th, &s, &co);
            c[2 * i] = co * mscale;
            c[2 * i + 1] = s * mscale;
            theta *= theta_scale;
        }
    }
}

// x, y: (n_pos, n_head, head_dim) contiguous; c: (n_pos, n_dims/2, 2)
static void rotate(const float *x, const float *c, float *y, long long n_pos, long long n_head, long long head_dim,
                   int n_dims, int neox) {
    const long long n_pairs = n_dims / 2;
    const long long n_fused = neox ? n_pairs : (n_pairs / 2) * 2;  // NORM: ggml's vector loop; the odd pair is scalar
    for (long long t = 0; t < n_pos; ++t) {
        const float *ct = c + t * n_pairs * 2;
        for (long long h = 0; h < n_head; ++h) {
            const float *xr = x + (t * n_head + h) * head_dim;
            float *yr = y + (t * n_head + h) * head_dim;
            if (neox) {
                for (long long i = 0; i < n_pairs; ++i) {
                    const float co = ct[2 * i], s = ct[2 * i + 1];
                    const float x0 = xr[i], x1 = xr[i + n_pairs];
                    const float x1s = x1 * s, x1c = x1 * co;
                    yr[i] = fmaf(x0, co, -x1s);
                    yr[i + n_pairs] = fmaf(x0, s, x1c);
                }
            } else {
                for (long long i = 0; i < n_pairs; ++i) {
                    const float co = ct[2 * i], s = ct[2 * i + 1];
                    const float x0 = xr[2 * i], x1 = xr[2 * i + 1];
                    const float x1s = x1 * s, x1c = x1 * co;
                    if (i < n_fused) {
                        yr[2 * i] = fmaf(x0, co, -x1s);
                        yr[2 * i + 1] = fmaf(x0, s, x1c);
                    } else {
                        const float x0c = x0 * co, x0s = x0 * s;
                        yr[2 * i] = x0c - x1s;
                        yr[2 * i + 1] = x0s + x1c;
                    }
                }
            }
            for (long long d = n_dims; d < head_dim; ++d) yr[d] = xr[d];
        }
    }
}
}  // namespace alchemist_rope
