// MLX's affine quantization (mlx-lm's default): y = x @ W.T with W kept packed.
//
// A row of W (n_in values) is stored as n_in * bits / 32 uint32 words, its values end to end, `bits` each, least
// significant bit first (a value may straddle two words when bits is 3 or 6). Each group of `group` consecutive
// values of a row has a scale and a bias: w = scale * q + bias. The product dequantizes each weight as
// mx.dequantize does (one float32 multiply and add, no contraction), once per row per call, and accumulates it
// against each token's x in float32: dequantize-then-matmul without holding more than a row per thread in float32.
// Output rows are split across OpenMP threads.

#include <stdint.h>

#include <vector>

namespace alchemist_mlx_affine {

static inline uint32_t value_at(const uint32_t *row, int64_t i, int bits, uint32_t mask) {
    const int64_t bit = i * bits;
    const int64_t word = bit >> 5;
    const int shift = (int)(bit & 31);
    uint32_t v = row[word] >> shift;
    if (shift + bits > 32) v |= row[word + 1] << (32 - shift);  // the value continues in the next word
    return v & mask;
}

// x (T, n_in) float32, w (n_out, n_in * bits / 32) uint32, scales and biases (n_out, n_in / group) float32,
// y (T, n_out) float32.
static void matmul(const float *x, const uint32_t *w, const float *scales, const float *biases, float *y,
                   int64_t T, int64_t n_out, int64_t n_in, int bits, int64_t group) {
    const int64_t words = n_in * bits / 32, groups = n_in / group;
    const uint32_t mask = (1u << bits) - 1u;
#pragma omp parallel if (n_out * words > 16384)
    {
        std::vector<float> weights(n_in);  // one row dequantized, then dotted with every token
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n_out; r++) {
            const uint32_t *row = w + r * words;
            for (int64_t g = 0; g < groups; g++) {
                const float scale = scales[r * groups + g], bias = biases[r * groups + g];
                for (int64_t j = g * group; j < (g + 1) * group; j++)
                    weights[j] = scale * (float)value_at(row, j, bits, mask) + bias;
            }
            for (int64_t t = 0; t < T; t++) {
                const float *xt = x + t * n_in;
                float acc = 0.0f;
                for (int64_t j = 0; j < n_in; j++) acc += weights[j] * xt[j];
                y[t * n_out + r] = acc;
            }
        }
    }
}

}  // namespace alchemist_mlx_affine
