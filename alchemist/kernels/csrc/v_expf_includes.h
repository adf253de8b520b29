
#if defined(__AVX2__) && defined(__FMA__) && !defined(ALCHEMIST_ATTN_PORTABLE)
#include <immintrin.h>
#define V_EXPF8 1
#else
#define V_EXPF8 0
#endif
