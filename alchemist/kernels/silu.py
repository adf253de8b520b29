"""`SiluGgml`: ggml-cpu's SiLU, bit for bit (ggml_vec_silu_f32 / ggml_vec_swiglu_f32, ggml-cpu/vec.cpp).

Along each row (the last axis) ggml takes the elements in vectors of 8 and a scalar tail:

    y = x / (1 + ggml_v_expf(0 - x))     the first n - n % 8 elements (ggml_v_silu, AVX2 + FMA)
    y = x / (1 + expf(-x))               the last n % 8 (ggml_silu_f32, the C library's expf)

ggml's SwiGLU multiplies that by the up projection in a separate float32 product, so silu(gate) * up as the
generated modules write it is ggml's swiglu once silu() is this. The numerics="ggml" modules use it for their
silu(). C runs the loops (ggml_v_expf eight lanes at a time on AVX2 + FMA, lane by lane elsewhere; shared with
kernels.attention) and Numba, JAX and MLX call them (kernels.numba_ops, jax_ffi, mlx_host); `perform` is the numpy
transcription; without the C kernels JAX and MLX get the generated module's x · sigmoid(x) (equal up to rounding).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.link.c.op import COp

from alchemist import libm
from alchemist.kernels.attention import v_expf_reference
from alchemist.kernels.c_same_shape import same_shape_c_code
from alchemist.kernels.expansion import register_expansion
from alchemist.kernels.native import register_numba_expansion
from alchemist.kernels.sources import source

SILU_C = source("silu.cpp")


def silu_reference(x: np.ndarray) -> np.ndarray:
    """ggml's SiLU of x along its last axis, in numpy (float32)."""
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1] if x.ndim else 1
    vec = n - n % 8
    y = np.empty_like(x)
    with np.errstate(over="ignore"):
        y[..., :vec] = x[..., :vec] / (np.float32(1) + v_expf_reference(np.float32(0) - x[..., :vec]))
    expf = libm.f32("expf")  # ggml's scalar tail calls it; numpy's float32 exp rounds differently
    tail = x[..., vec:]
    y[..., vec:] = tail / (
        np.float32(1) + np.array([expf(-float(v)) for v in tail.reshape(-1)], np.float32).reshape(tail.shape)
    )
    return y.astype(np.float32)


class SiluGgml(COp):
    """x float32 (at least 1-d) -> ggml's SiLU of x, rows along the last axis (see the module docstring)."""

    computes_ggml_kernel = True  # kernels.expansion: JAX and MLX call its C code where they can

    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        if x.type.dtype != "float32" or x.type.ndim < 1:
            raise TypeError(f"SiluGgml: x must be a float32 array of at least one dimension, got {x.type}")
        return Apply(self, [x], [x.type()])

    def infer_shape(self, node, shapes):
        return [shapes[0]]

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = silu_reference(inputs[0])

    def c_support_code(self, **kwargs):
        return SILU_C

    def c_compile_args(self, **kwargs):
        return ["-O3", "-ffp-contract=off"]

    def c_code(self, node, name, inputs, outputs, sub):
        (x,) = inputs
        (y,) = outputs
        return same_shape_c_code(
            x,
            y,
            sub["fail"],
            f"""
            const long long n_ = (long long)PyArray_DIM(xc_, PyArray_NDIM(xc_) - 1);
            const long long rows_ = n_ ? (long long)PyArray_SIZE(xc_) / n_ : 0;
            alchemist_silu::apply((const float *)PyArray_DATA(xc_), (float *)PyArray_DATA({y}), rows_, n_);
            """,
        )

    def c_code_cache_version(self):
        return (1, int(hashlib.sha256(SILU_C.encode()).hexdigest()[:12], 16))


def silu_formula(x):
    """x · sigmoid(x): the generated modules' SiLU, equal to ggml's up to rounding."""
    return x * pt.sigmoid(x)


def silu_ggml(x):
    """ggml's SiLU of x (float32): the C loops on C, the formula elsewhere."""
    return SiluGgml()(x)


@node_rewriter([SiluGgml])
def expand_silu_ggml(fgraph, node):
    return [silu_formula(node.inputs[0])]


register_expansion("alchemist_expand_silu_ggml", expand_silu_ggml, backends=("jax", "mlx"))
# on Numba only without the ops library (otherwise Numba calls the C code: kernels.numba_ops)
register_numba_expansion("alchemist_expand_silu_ggml_numba", expand_silu_ggml)
