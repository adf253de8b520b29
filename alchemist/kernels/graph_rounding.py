"""llama.cpp's activation rounding written as PyTensor graph ops (the numerics="ggml" path of backends without a
kernel: JAX, MLX), bit for bit as ggml-cpu rounds (see alchemist.kernels.activations for the same in numpy/Numba).
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt

Q8_0_SOURCES = ("Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1", "MXFP4", "IQ4_NL", "NVFP4", "Q1_0")
Q8_K_SOURCES = (
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "TQ2_0", "TQ1_0", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
    "IQ1_S", "IQ1_M",
)  # fmt: skip


def round_half_even(x):
    """x rounded to the nearest integer, ties to even, from floor (MLX has no round-half-to-even op): floor(x + 1/2)
    is right except at a tie that lands on an odd integer, which goes one down. Computed in float64, where x + 1/2
    is exact for any float32 x (and for float64 x below 2^52)."""
    x64 = pt.as_tensor_variable(x).astype("float64")
    r = pt.floor(x64 + 0.5)
    tie = pt.eq(r - x64, 0.5)
    odd = pt.eq(r - 2 * pt.floor(r * 0.5), 1)
    return (r - pt.and_(tie, odd).astype("float64")).astype(x.dtype)


def _fp16(x):
    """float32 x rounded to the nearest fp16 value (ties to even; fp16 subnormals below 2^-14), as float32.

    Computed in float64 rather than through a float16 cast: PyTensor has no C code for float16, and a fused
    elementwise loop containing one falls back to Python for every element (minutes per step on a real model).
    Dividing by the power of two `step` and multiplying back are exact, so only the rounding rounds. Values
    beyond fp16's range (65504) are not turned into inf: activations and their block scales never reach it.
    """
    x64 = pt.as_tensor_variable(x).astype("float64")
    magnitude = pt.abs(x64)
    exponent = pt.maximum(pt.floor(pt.log2(pt.switch(magnitude > 0, magnitude, 1.0))), -14.0)
    # fp16 keeps 10 bits after the leading one; a power of two (pow is exact for integer exponents; MLX has no exp2)
    step = pt.power(np.float64(2.0), exponent - 10.0)
    return (round_half_even(x64 / step) * step).astype("float32")


def _mul_f32(x, scale):
    """float32(x · scale), exactly as C computes it.

    Written plainly, PyTensor's rewrites sink the product into the switch that guards a zero scale and
    canonicalize x · (127 / m) into (x · 127) / m, which rounds differently (41.499996 becomes 41.5, so an
    activation lands on the other integer). The product of two float32 values is exact in float64, so
    casting both up, multiplying, and casting back gives the float32 product whatever the rewrites do.
    """
    return (x.astype("float64") * scale.astype("float64")).astype("float32")


def _div_f32(x, y):
    """float32(x / y), correctly rounded: the rewrites would turn 1 / (-127 / m) into m / -127 (see _mul_f32);
    a float64 quotient rounded to float32 is the correctly rounded float32 quotient (53 >= 2·24 + 2 bits)."""
    return (pt.as_tensor_variable(x).astype("float64") / y.astype("float64")).astype("float32")


def round_like_q8_0(x):
    """x (T, n), n % 32 == 0 -> the values llama.cpp's Q8_0 activation blocks represent."""
    blocks = x.reshape((x.shape[0], -1, 32))
    amax = pt.max(pt.abs(blocks), axis=-1, keepdims=True)
    inverse = pt.switch(pt.eq(amax, 0), np.float32(0), np.float32(127) / amax)
    q = round_half_even(_mul_f32(blocks, inverse))
    return _mul_f32(q, _fp16(amax / np.float32(127))).reshape(x.shape)


def round_like_q8_k(x):
    """x (T, n), n % 256 == 0 -> the values llama.cpp's Q8_K activation blocks represent."""
    blocks = x.reshape((x.shape[0], -1, 256))
    hi, lo = pt.max(blocks, axis=-1, keepdims=True), pt.min(blocks, axis=-1, keepdims=True)
    signed_max = pt.switch(hi >= -lo, hi, lo)  # ggml takes the first element of largest |x| (ties aside)
    zero = pt.eq(signed_max, 0)
    iscale = np.float32(-127) / pt.switch(zero, np.float32(1), signed_max)
    q = pt.minimum(round_half_even(_mul_f32(blocks, iscale)), np.float32(127))
    return pt.switch(zero, np.float32(0), _mul_f32(q, _div_f32(np.float32(1), iscale))).reshape(x.shape)
