"""C++ source of the quantized matmul kernels used by `QuantizedMatmul.c_code` (PyTensor compiles it with g++).

Y (T, n_out) = X (T, n_in) @ dequant(W).T, W given as GGUF rows (n_out, row_bytes), no repacking.

Every supported block is a set of sub-blocks (16 or 32 weights) with weight = dl * q + mb, q a small
integer, dl and mb float32 (mb = 0 for the symmetric types; mb = m for Q4_1/Q5_1, -dmin * min for the
K-quants; for MXFP4 q is the doubled E2M1 value and dl = 2^(e - 128), for NVFP4 the same q under a halved
E4M3 dl per 16, for Q1_0 q = +-1 and dl = d; for IQ4_NL / IQ4_XS q is the grid value
kvalues_iq4nl[code] and dl = d, or d * (ls - 32) per 32; for TQ2_0 and TQ1_0 q = code - 1 and dl = d); dl and mb are computed
exactly as
gguf-py computes them. A format is one struct (QK, BS, SUB, NSUB, HAS_MIN, unpack); `unpack` followed by
`dot_block` / `dequantize_row` is the per-block decode any other kernel (gathered experts) can reuse.
A row's dot with x is

    sum over sub-blocks of  dl * (sum_j q_j x_j)  +  mb * (sum_j x_j)

Per block the quants are unpacked to int8 (AVX2 byte shuffles when the compiler targets AVX2+FMA, else
portable scalar code), then each sub-block's sum_j q_j x_j is an 8-lane float32 multiply-add chain and
is scaled by dl into two alternating 8-lane float32 accumulators; the mb terms go to a scalar float32
accumulator against per-16 sums of x computed once per call. The row result is the pairwise sum of the
lanes plus that scalar. So the arithmetic is float32 throughout and differs from dequantize-then-matmul
only by rounding order (the products q_j x_j are exact-input float32 products; dl is applied per
sub-block instead of per weight). For 1 < T < 16 each block is unpacked once and applied to every token,
on the K-quants its quants converted to float once per group of 4 tokens whose multiply-add chains share
them in registers; every token's operations stay in the same order, so row t of a T-token product equals the 1-token product of token t.
For T >= 16 (prefill), when PyTensor has a BLAS: panels of rows (at most ~4 MB of float32, at least one per
OpenMP thread) are dequantized exactly as gguf-py does (float32, no FMA contraction) and multiplied by sgemm,
each thread its own panels, i.e. literally dequantize-then-matmul without holding more than a panel per
thread in float32.
run_experts (the mixture-of-experts product) groups the (token, rank) pairs by their expert and runs each chosen
expert's rows through the same kernel, its routed tokens as the batch; unchosen experts are never read.
numerics="ggml" (run_ggml): llama.cpp's arithmetic, see the "ggml numerics" section below.
Output rows are split across OpenMP threads (when compiled with -fopenmp and the weights exceed 64 KB);
weights are software-prefetched 4 KB ahead.
"""

from alchemist.kernels.sources import source

# the C++ lives in csrc/quantized_matmul.cpp; its Q5 high-bit lookup table is generated here
C_SOURCE = source("quantized_matmul.cpp").replace(
    "/*Q5_HIGH_BITS*/",
    ", ".join(f"0x{sum(0x10 << 8 * j for j in range(8) if v >> j & 1):016x}ull" for v in range(256)),
)
