"""Numerics modes: which arithmetic a loaded model computes with.

- "exact": the generated module as written: every matmul multiplies the float32 activation by the dequantized
  weight. Differentiable; the reference for gradients (alchemist.symbolic).
- "ggml" (the default): what llama.cpp's CPU backend computes. ggml-cpu multiplies a weight of type T by first
  converting each activation row to T's `vec_dot_type` (ggml-cpu.c, type_traits_cpu), then summing integer
  products block by block, which equals dequant(W) · dequant(quant(x)) up to float32 summation order:
  - Q8_0 (blocks of 32, scale max|x|/127 stored as fp16, x·127/max rounded to nearest even: the AVX2
    quantize_row_q8_0) for Q4_0, Q5_0, Q8_0 and MXFP4; Q8_1 (the same values plus block sums) for Q4_1, Q5_1;
  - Q8_K (blocks of 256, float32 scale: quantize_row_q8_K_ref, iscale = -127/max where max is the element of
    largest magnitude) for the K-quants;
  - fp16 for F16 weights.
  Its GELU reads an fp16 lookup table (GGML_GELU_FP16, ggml-cpu/vec.h): gelu(x) = table[fp16(x)] for
  -10 < x < 10.

Generated modules never change: `with_numerics(module, "ggml")` returns a fresh copy of the module whose
kernels, project() and gelu() compute that way. The copy is re-snapshotted under a source hash of its own, so
its step graphs go to (and load from) the on-disk graph cache like the exact module's, under other keys.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from types import ModuleType

import numpy as np
import pytensor.tensor as pt

from alchemist.errors import AlchemistError

NUMERICS = ("ggml", "exact")
DEFAULT = "ggml"

Q8_0_SOURCES = ("Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1", "MXFP4")
Q8_K_SOURCES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_NUMERICS_ATTR = "_alchemist_numerics"


def check_numerics(numerics: str) -> str:
    """`numerics` itself, or an AlchemistError naming it and the choices."""
    if numerics not in NUMERICS:
        raise AlchemistError(f"numerics={numerics!r}: unknown numerics mode (choose from {', '.join(NUMERICS)})")
    return numerics


def resolve_numerics(numerics: str | None, llamacpp_rounding: bool = False) -> str:
    """The numerics asked for: `numerics` (None: DEFAULT); llamacpp_rounding=True (`--llamacpp-rounding`, the
    older diagnostic flag) is numerics="ggml"."""
    if llamacpp_rounding:
        if numerics not in (None, "ggml"):
            raise AlchemistError(f"--llamacpp-rounding means --numerics ggml; it contradicts numerics={numerics!r}")
        return "ggml"
    return check_numerics(DEFAULT if numerics is None else numerics)


def numerics_of(module: ModuleType) -> str:
    """The numerics a (possibly with_numerics-copied) generated module computes with."""
    return getattr(module, _NUMERICS_ATTR, "exact")


# -- llama.cpp's roundings, as PyTensor expressions --------------------------------------------------------
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
    step = pt.exp2(exponent - 10.0)  # fp16 keeps 10 bits after the leading one
    return (pt.round(x64 / step, mode="half_to_even") * step).astype("float32")


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
    """x (..., n), n % 32 == 0 -> the values llama.cpp's Q8_0 activation blocks represent."""
    x = pt.as_tensor_variable(x)
    blocks = x.reshape((-1, 32))  # blocks never straddle rows: n is a multiple of 32
    amax = pt.max(pt.abs(blocks), axis=-1, keepdims=True)
    inverse = pt.switch(pt.eq(amax, 0), np.float32(0), np.float32(127) / amax)
    q = pt.round(_mul_f32(blocks, inverse), mode="half_to_even")
    return _mul_f32(q, _fp16(amax / np.float32(127))).reshape(x.shape)


def round_like_q8_k(x):
    """x (..., n), n % 256 == 0 -> the values llama.cpp's Q8_K activation blocks represent."""
    x = pt.as_tensor_variable(x)
    blocks = x.reshape((-1, 256))
    hi, lo = pt.max(blocks, axis=-1, keepdims=True), pt.min(blocks, axis=-1, keepdims=True)
    signed_max = pt.switch(hi >= -lo, hi, lo)  # ggml takes the first element of largest |x| (ties aside)
    zero = pt.eq(signed_max, 0)
    iscale = np.float32(-127) / pt.switch(zero, np.float32(1), signed_max)
    q = pt.minimum(pt.round(_mul_f32(blocks, iscale), mode="half_to_even"), np.float32(127))
    return pt.switch(zero, np.float32(0), _mul_f32(q, _div_f32(np.float32(1), iscale))).reshape(x.shape)


def round_activations(x, weight_type: str):
    """The activation a llama.cpp CPU matmul with a `weight_type` weight actually multiplies."""
    if weight_type in Q8_0_SOURCES:
        return round_like_q8_0(x)
    if weight_type in Q8_K_SOURCES:
        return round_like_q8_k(x)
    if weight_type == "F16":
        return _fp16(x)
    return x


def gelu_fp16_table(x):
    """ggml's table GELU: gelu of the fp16-rounded input, rounded to fp16; exact outside (-10, 10)."""
    x16 = _fp16(x)
    g = (
        np.float32(0.5)
        * x16
        * (1 + pt.tanh(np.float32(0.7978845608028654) * x16 * (1 + np.float32(0.044715) * x16 * x16)))
    )
    return pt.switch(x <= -10, np.float32(0), pt.switch(x >= 10, x, _fp16(g)))


# -- the ggml copy of a generated module ------------------------------------------------------------------
def _takes_numerics(kernel) -> bool:
    try:
        return "numerics" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


def ggml_kernels(quantized_linear, quantized_expert_linear=None):
    """(linear, expert_linear): the kernels called with numerics="ggml" where they take the keyword, else the
    exact kernel on the activation rounded in the graph (the same values up to float32 summation order)."""
    if _takes_numerics(quantized_linear):

        def linear(x, w_blocks, ggml_type, n_out, n_in):
            return quantized_linear(x, w_blocks, ggml_type, n_out, n_in, numerics="ggml")

    else:

        def linear(x, w_blocks, ggml_type, n_out, n_in):
            return quantized_linear(round_activations(x, ggml_type), w_blocks, ggml_type, n_out, n_in)

    if quantized_expert_linear is None:
        return linear, None
    if _takes_numerics(quantized_expert_linear):

        def expert_linear(x, w_blocks, ids, ggml_type, n_expert, n_out, n_in):
            return quantized_expert_linear(x, w_blocks, ids, ggml_type, n_expert, n_out, n_in, numerics="ggml")

    else:

        def expert_linear(x, w_blocks, ids, ggml_type, n_expert, n_out, n_in):
            x = round_activations(x, ggml_type)
            return quantized_expert_linear(x, w_blocks, ids, ggml_type, n_expert, n_out, n_in)

    return linear, expert_linear


def with_numerics(module: ModuleType, numerics: str = DEFAULT) -> ModuleType:
    """`module` computing with `numerics`: the module itself for "exact"; for "ggml" a fresh copy of it (see the
    module docstring) that the graph cache treats as a module of its own."""
    from alchemist.runtime.engine import _AS_IMPORTED, _SOURCE_SHA256, import_generated

    if check_numerics(numerics) == "exact" or numerics_of(module) == numerics:
        return module
    if numerics_of(module) != "exact":
        raise AlchemistError(f"with_numerics: {module.__name__} already computes with numerics={numerics_of(module)!r}")
    copy = import_generated(module.__file__, name_suffix=f"_{numerics}")
    tensors = copy.TENSORS
    linear, expert_linear = ggml_kernels(copy.quantized_linear, getattr(copy, "quantized_expert_linear", None))
    copy.quantized_linear = linear
    if expert_linear is not None:
        copy.quantized_expert_linear = expert_linear

    # a weight held as float32 (F16/F32 tensors; every tensor on JAX/MLX) goes through linear(): its input is
    # rounded here; GGUF blocks (uint8) go to the kernel above, which rounds its own input
    exact_project = copy.project

    def project(x, w, name, bias=None):
        if w[name].dtype != "uint8":
            x = round_activations(x, tensors[name][0])
        return exact_project(x, w, name, bias)

    copy.project = project
    if hasattr(copy, "project_experts"):
        exact_project_experts = copy.project_experts

        def project_experts(x, w, name, experts, bias=None):
            if w[name].dtype != "uint8":
                x = round_activations(x, tensors[name][0])
            return exact_project_experts(x, w, name, experts, bias)

        copy.project_experts = project_experts
    if hasattr(copy, "gelu"):
        copy.gelu = gelu_fp16_table
    copy.__dict__[_NUMERICS_ATTR] = numerics
    # re-snapshot: the patched copy is "as imported" for the graph cache, under a hash that is not the exact
    # module's (the rounding code itself is hashed with alchemist's sources, runtime/numerics.py)
    source = Path(copy.__file__).read_bytes()
    copy.__dict__[_SOURCE_SHA256] = hashlib.sha256(source + f"numerics={numerics}".encode()).hexdigest()
    copy.__dict__[_AS_IMPORTED] = {k: v for k, v in vars(copy).items() if k != _AS_IMPORTED}
    return copy
