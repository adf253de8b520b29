"""Numerics modes: which arithmetic a loaded model computes with.

- "exact": the generated module as written: every matmul multiplies the float32 activation by the dequantized
  weight. Differentiable; the reference for gradients (alchemist.symbolic).
- "ggml" (the default): what llama.cpp's CPU backend computes. ggml-cpu multiplies a weight of type T by first
  converting each activation row to T's `vec_dot_type` (ggml-cpu.c, type_traits_cpu), then summing integer
  products block by block, which equals dequant(W) · dequant(quant(x)) up to float32 summation order (the C
  kernels take ggml's own order, so the products are llama.cpp's bit for bit; alchemist.kernels.c_kernels; C,
  Numba, JAX and MLX all compute with them, alchemist.kernels.native, jax_ffi, mlx_host):
  - Q8_0 (blocks of 32, scale max|x|/127 stored as fp16, x·127/max rounded to nearest even: the AVX2
    quantize_row_q8_0) for Q4_0, Q5_0, Q8_0, MXFP4, IQ4_NL, NVFP4 and Q1_0; Q8_1 (the same values plus block sums) for Q4_1, Q5_1;
  - Q8_K (blocks of 256, float32 scale: quantize_row_q8_K_ref, iscale = -127/max where max is the element of
    largest magnitude) for the K-quants, IQ4_XS, TQ2_0, TQ1_0 and the grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S,
    IQ3_XXS, IQ3_S, IQ1_S, IQ1_M);
  - fp16 for F16 weights.
  Its GELU reads an fp16 lookup table (GGML_GELU_FP16, ggml-cpu/vec.h): gelu(x) = table[fp16(x)] for
  -10 < x < 10. Its SiLU is x / (1 + ggml_v_expf(-x)) in vectors of 8 (alchemist.kernels.silu). Its RMS norm sums the squares in double, in order (ggml_compute_forward_rms_norm_f32).
  Its RoPE builds cos/sin from a running product of the angle and glibc's sincosf, and rotates with fused
  multiply-adds (alchemist.kernels.rope). Its attention takes scores by ggml_vec_dot_f32, a softmax with
  ggml_v_expf and a double sum, and the values in tinyBLAS's or vec_dot's lane order (alchemist.kernels.attention).
  These are the loops of ggml-cpu compiled for AVX2 + FMA + F16C without AVX-512, the build the oracle is pinned to;
  an AVX-512 or ARM build orders them otherwise (alchemist.harness.oracle_build names both in every report).

A generated module's layers call their primitives through `ops`; `primitives(module, numerics)` is the bundle
to pass: the module's own EXACT for "exact"; for "ggml" the same bundle with llama.cpp's loops in place of its
formulas: project() through the kernels with numerics="ggml" for weights in GGUF blocks, or
alchemist.kernels.graph_rounding before the float32 product for weights held as float32 (F16/F32 tensors; every
weight when asked for weights="float32"), alchemist.kernels.gelu's table GELU, alchemist.kernels.silu's SiLU,
alchemist.kernels.rms_norm's norm, alchemist.kernels.rope's RoPE and alchemist.kernels.attention's attention.
The module itself is never changed.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import numpy as np
import pytensor.tensor as pt

from alchemist.errors import AlchemistError
from alchemist.kernels import quantized_expert_linear, quantized_linear
from alchemist.kernels.primitives import Primitives
from alchemist.kernels.attention import ggml_causal_attention
from alchemist.kernels.rms_norm import rms_norm_ggml
from alchemist.kernels.rope import ggml_rope_functions
from alchemist.kernels.silu import silu_ggml
from alchemist.kernels.gelu import gelu_fp16_table, gelu_table  # noqa: F401 (gelu_fp16_table re-exported)
from alchemist.kernels.graph_rounding import (  # noqa: F401 (_mul_f32, _div_f32 re-exported)
    Q8_0_SOURCES,
    Q8_K_SOURCES,
    _div_f32,
    _fp16,
    _mul_f32,
    round_like_q8_0,
    round_like_q8_k,
)

NUMERICS = ("ggml", "exact")
DEFAULT = "ggml"


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


# -- llama.cpp's roundings, as PyTensor expressions (the kernels' own, alchemist.kernels.graph_rounding / gelu) --
def round_activations(x, weight_type: str):
    """The activation a llama.cpp CPU matmul with a `weight_type` weight actually multiplies."""
    if weight_type in Q8_0_SOURCES:
        return round_like_q8_0(x)
    if weight_type in Q8_K_SOURCES:
        return round_like_q8_k(x)
    if weight_type == "F16":
        return _fp16(x)
    return x


def ggml_rms_norm(eps):
    """A generated module's rms_norm(x, weight=None), normalizing with ggml's loops (alchemist.kernels.rms_norm)."""

    def rms_norm(x, weight=None):
        weight = None if weight is None else pt.as_tensor_variable(weight)
        if weight is not None and weight.type.ndim != 1:  # not a per-element vector: multiply after
            return rms_norm_ggml(x, eps) * weight
        return rms_norm_ggml(x, eps, weight)

    return rms_norm


# -- the ggml bundle of a generated module's primitives ---------------------------------------------------
def primitives(module: ModuleType, numerics: str = DEFAULT) -> Primitives:
    """The primitives `module`'s forward() computes with under `numerics` (its `ops` argument)."""
    exact = module.EXACT
    if check_numerics(numerics) == "exact":
        return exact
    tensors, linear = module.TENSORS, module.linear

    def project(x, w, name, bias=None):
        weight = w[name]
        ggml_type, shape = tensors[name][0], tensors[name][1]
        if weight.dtype == "uint8":  # GGUF blocks: the kernel rounds its own input
            y = quantized_linear(x, weight, ggml_type, *shape, numerics="ggml")
            return y if bias is None else y + bias
        if weight.dtype == "uint32":  # MLX-packed (a snapshot's): llama.cpp has no arithmetic of its own for it
            return exact.project(x, w, name, bias)
        return linear(round_activations(x, ggml_type), weight, bias)

    def project_experts(x, w, name, experts, bias=None):
        weight = w[name]
        if weight.dtype == "uint8":
            ggml_type, shape = tensors[name][0], tensors[name][1]
            y = quantized_expert_linear(x, weight, experts, ggml_type, *shape, numerics="ggml")
            return y if bias is None else y + bias[experts]
        return exact.project_experts(round_activations(x, tensors[name][0]), w, name, experts, bias)

    def project_heads(x, w, name):
        # per-head matrices are held as float32 (dequantized on load): the product of the rounded activations
        return exact.project_heads(round_activations(x, tensors[name][0]), w, name)

    ggml = dict(project=project, rms_norm=ggml_rms_norm(np.float32(module.NORM_EPS)))
    if exact.project_experts is not None:
        ggml["project_experts"] = project_experts
    if exact.project_heads is not None:
        ggml["project_heads"] = project_heads
    if exact.gelu is not None:
        ggml["gelu"] = gelu_table  # ggml's fp16 table: a C op on C, the same values as PyTensor ops elsewhere
    if exact.silu is not None:
        ggml["silu"] = silu_ggml  # ggml_v_silu's lanes and scalar tail: a C op on C, x * sigmoid(x) elsewhere
    if exact.rope is not None:
        rope = ggml_rope_functions(module)  # ggml's cos/sin cache and its fused rotation (alchemist.kernels.rope)
        if rope is not None:
            ggml["rope_angles"], ggml["rope"] = rope
    # ggml's attention (vec_dot scores, v_expf softmax, sgemm/vec_dot kqv): a C op on C, the formula elsewhere
    ggml["causal_attention"] = ggml_causal_attention(module) or exact.causal_attention
    if exact.rms_norm is None:
        del ggml["rms_norm"]
    return dataclasses.replace(exact, **ggml)
