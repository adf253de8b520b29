"""`GeluTable`: ggml-cpu's GELU, a lookup in a table of fp16 values (GGML_GELU_FP16, ggml-cpu/vec.h).

    y = 0                        for x <= -10
    y = x                        for x >= 10
    y = table[fp16(x)]           otherwise, table[h] = fp16(gelu_tanh(float(h))) in float32 arithmetic

The numerics="ggml" modules use it for their gelu(): it is what llama.cpp computes, and on C a table read is
~10x cheaper than the float tanh of the exact path (a 128-token gemma prefill spent a fifth of its time in
the tanh GELU). C: one loop over the elements with the table built once per process; Numba calls the same C
(kernels.numba_ops), and so do JAX and MLX (kernels.jax_ffi, mlx_host). Without those libraries: the same values as
PyTensor ops (`gelu_fp16_table`, via a rewrite tagged "jax" and "mlx"; on Numba too).
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.link.c.op import COp

from alchemist.kernels.c_same_shape import same_shape_c_code
from alchemist.kernels.expansion import register_expansion
from alchemist.kernels.native import register_numba_expansion
from alchemist.kernels.graph_rounding import _fp16
from alchemist.kernels.sources import source

GELU_C = source("gelu.cpp")


class GeluTable(COp):
    """x float32 (any shape) -> ggml's table GELU of x (see the module docstring)."""

    computes_ggml_kernel = True  # kernels.expansion: JAX and MLX call its C code where they can

    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        if x.type.dtype != "float32":
            raise TypeError(f"GeluTable: x must be float32, got {x.type}")
        return Apply(self, [x], [x.type()])

    def infer_shape(self, node, shapes):
        return [shapes[0]]

    def perform(self, node, inputs, output_storage):
        (x,) = inputs
        x = np.asarray(x, dtype=np.float32)
        h = x.astype(np.float16).astype(np.float32)  # numpy rounds to nearest even, as F16C does
        inner = ((np.float32(0.044715) * h).astype(np.float64) * h + 1.0).astype(np.float32)  # the fma, see below
        g = np.float32(0.5) * h * (np.float32(1) + np.tanh(np.float32(0.7978845608028654) * h * inner))
        y = np.where(x <= -10, np.float32(0), np.where(x >= 10, x, g.astype(np.float16).astype(np.float32)))
        output_storage[0][0] = y.astype(np.float32)

    def c_support_code(self, **kwargs):
        return GELU_C

    def c_compile_args(self, **kwargs):
        return ["-O3", "-ffp-contract=off"]

    def c_init_code(self, **kwargs):
        return ["alchemist_gelu::build();"]

    def c_code(self, node, name, inputs, outputs, sub):
        (x,) = inputs
        (y,) = outputs
        fail = sub["fail"]
        return same_shape_c_code(
            x,
            y,
            fail,
            f"""
            alchemist_gelu::apply((const float *)PyArray_DATA(xc_), (float *)PyArray_DATA({y}), (long long)PyArray_SIZE(xc_));
            """,
        )

    def c_code_cache_version(self):
        import hashlib

        return (1, int(hashlib.sha256(GELU_C.encode()).hexdigest()[:12], 16))


def gelu_fp16_table(x):
    """ggml's table GELU as PyTensor ops: gelu of the fp16-rounded input, rounded to fp16; exact outside (-10, 10)."""
    x16 = _fp16(x)
    # llama.cpp's table was built with 1 + a*x*x contracted into one fma: a product of two float32 values is
    # exact in float64, so float64 arithmetic rounded once to float32 gives the fused result
    inner = (np.float32(0.044715) * x16).astype("float64") * x16.astype("float64") + 1.0
    g = np.float32(0.5) * x16 * (1 + pt.tanh(np.float32(0.7978845608028654) * x16 * inner.astype("float32")))
    return pt.switch(x <= -10, np.float32(0), pt.switch(x >= 10, x, _fp16(g)))


def gelu_table(x):
    """ggml's table GELU of x (float32): the C kernel on C, PyTensor ops elsewhere."""
    return GeluTable()(x)


@node_rewriter([GeluTable])
def expand_gelu_table(fgraph, node):
    return [gelu_fp16_table(node.inputs[0])]


register_expansion("alchemist_expand_gelu_table", expand_gelu_table, backends=("jax", "mlx"))
# on Numba only without the ops library (otherwise Numba calls the C code: kernels.numba_ops)
register_numba_expansion("alchemist_expand_gelu_table_numba", expand_gelu_table)
