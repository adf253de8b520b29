
#include <math.h>
namespace alchemist_rms_norm {
static void apply(const float *x, const float *w, float *y, long long rows, long long n, float eps) {
    for (long long r = 0; r < rows; ++r) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        double sum = 0.0;
        for (long long i = 0; i < n; ++i) {
            const float sq = xr[i] * xr[i];
            sum += (double)sq;
        }
        const float mean = (float)(sum / (double)n);
        const float scale = 1.0f / sqrtf(mean + eps);
        if (w)
            for (long long i = 0; i < n; ++i) yr[i] = (xr[i] * scale) * w[i];
        else
            for (long long i = 0; i < n; ++i) yr[i] = xr[i] * scale;
    }
}
}  // namespace alchemist_rms_norm
