
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "v_expf_includes.h"

namespace alchemist_silu {
#include "v_expf.h"

static void apply(const float *x, float *y, long long rows, long long n) {
    const long long vec = n - n % 8;
    for (long long r = 0; r < rows; ++r) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        long long i = 0;
#if V_EXPF8
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i < vec; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            _mm256_storeu_ps(yr + i, _mm256_div_ps(v, _mm256_add_ps(one, v_expf8(_mm256_sub_ps(zero, v)))));
        }
#endif
        for (; i < vec; ++i) yr[i] = xr[i] / (1.0f + v_expf(0.0f - xr[i]));
        for (long long i = vec; i < n; ++i) yr[i] = xr[i] / (1.0f + expf(-xr[i]));
    }
}
}  // namespace alchemist_silu
