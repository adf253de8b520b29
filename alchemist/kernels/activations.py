"""llama.cpp's activation quantization, as values: what a ggml-cpu matmul actually multiplies a weight by.

ggml-cpu quantizes each activation row to the weight type's `vec_dot_type` before its integer dot products
(see c_kernels.py, "ggml numerics"): Q8_0 blocks of 32 for Q4_0/Q5_0/Q8_0/MXFP4/IQ4_NL/NVFP4/Q1_0 (and Q8_1, the same values
plus a block sum, for Q4_1/Q5_1), Q8_K blocks of 256 for the K-quants, IQ4_XS, TQ2_0, TQ1_0 and the grid i-quants. `round_rows(x, ggml_type)` returns
dequant(quant(x)): the float32 values those blocks represent. The Numba kernels multiply these by the
exactly dequantized weights (numerics="ggml" on Numba, and `QuantizedMatmul.perform`); the C kernels use the
integer blocks themselves. Loops only, so Numba compiles the same function (`round_rows_numba`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from alchemist.kernels import formats

ACT_Q8_0, ACT_Q8_K = 0, 2


def activation_kind(ggml_type: str) -> int:
    """ACT_Q8_K for the K-quants (blocks of 256), ACT_Q8_0 for the 32-blocks (Q8_1 rounds the same values)."""
    return ACT_Q8_K if formats.block_size(ggml_type)[0] == 256 else ACT_Q8_0


def _fp16(v):
    """float32 v rounded to the nearest fp16 value (ties to even), as float32 (subnormals below 2^-14)."""
    a = abs(float(v))
    if a == 0.0:
        return np.float32(v)
    _, e = math.frexp(a)  # a = m * 2^e, 0.5 <= m < 1
    step = 2.0 ** (max(e - 1, -14) - 10)  # fp16 keeps 10 bits after the leading one
    return np.float32(np.rint(float(v) / step) * step)


def _round_rows(x, kind):
    T, n = x.shape
    y = np.empty((T, n), dtype=np.float32)
    qk = 256 if kind == ACT_Q8_K else 32
    for t in range(T):
        for b in range(n // qk):
            o = b * qk
            if kind == ACT_Q8_K:
                amax = np.float32(0.0)
                mx = np.float32(0.0)
                for j in range(qk):
                    ax = abs(x[t, o + j])
                    if ax > amax:  # the first element of largest magnitude (quantize_row_q8_K_ref)
                        amax = ax
                        mx = x[t, o + j]
                if amax == 0:
                    for j in range(qk):
                        y[t, o + j] = np.float32(0.0)
                    continue
                iscale = np.float32(-127.0) / mx
                d = np.float32(1.0) / iscale
                for j in range(qk):
                    q = min(np.float32(127.0), np.rint(np.float32(iscale * x[t, o + j])))
                    y[t, o + j] = np.float32(d * q)
            else:
                amax = np.float32(0.0)
                for j in range(qk):
                    amax = max(amax, abs(x[t, o + j]))
                d = _fp16(np.float32(amax / np.float32(127.0)))
                inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
                for j in range(qk):
                    y[t, o + j] = np.float32(np.rint(np.float32(x[t, o + j] * inv)) * d)
    return y


@lru_cache(maxsize=1)
def round_rows_numba():
    """The Numba-compiled rounding (for kernels and perform)."""
    import numba

    fp16 = numba.njit(cache=False)(_fp16)
    glb = dict(_round_rows.__globals__, _fp16=fp16)
    fn = type(_round_rows)(_round_rows.__code__, glb, "_round_rows")
    return numba.njit(cache=False)(fn)


def round_rows(x: np.ndarray, ggml_type: str) -> np.ndarray:
    """x (T, n) float32 -> the values of its ggml activation blocks for a `ggml_type` weight (float32)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return round_rows_numba()(x, activation_kind(ggml_type))
