"""`RmsNormGgml`: ggml-cpu's RMS norm (ggml_compute_forward_rms_norm_f32), bit for bit.

    sum   = Σ (double)(x_i · x_i)        products in float32, summed in order in double
    mean  = (float)(sum / n)
    scale = 1.0f / sqrtf(mean + eps)
    y_i   = x_i · scale               (· w_i when the norm has a learned scale: ggml_mul after it, or the fused
                                     RMS_NORM+MUL, both (x_i · scale) · w_i)

The exact modules' rms_norm (x · reciprocal(sqrt(mean(x²) + eps))) computes the same quantity, but PyTensor's
canonicalizer rewrites it into x / sqrt(sum · (1/n) + eps), folding any scale on x (gemma's embedding scale)
into the same fused division: the result differs from ggml's in the last bit for about half the elements, and
a last-bit change in an activation flips its Q8 rounding now and then (~1e-7 NMSE on the next matmul). The
numerics="ggml" modules use this Op, which the rewrites cannot see into. C and Numba run the loops above;
JAX and MLX call the C loops (kernels.jax_ffi, mlx_host), or without them get the float32 formula as PyTensor ops
(`expand_rms_norm_ggml`, tagged "jax" and "mlx").
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.link.c.op import COp

from alchemist.kernels.c_same_shape import same_shape_c_code
from alchemist.kernels.expansion import register_expansion
from alchemist.kernels.sources import source

RMS_NORM_C = source("rms_norm.cpp")


def _rms_rows(x, w, eps):
    """x (rows, n) -> ggml's norm of each row, times w (n,) unless w is empty."""
    rows, n = x.shape
    y = np.empty((rows, n), dtype=np.float32)
    for r in range(rows):
        s = 0.0
        for i in range(n):
            sq = np.float32(x[r, i] * x[r, i])
            s += np.float64(sq)
        mean = np.float32(s / n)
        scale = np.float32(1.0) / np.sqrt(np.float32(mean + eps))
        for i in range(n):
            y[r, i] = np.float32(x[r, i] * scale)
            if w.size:
                y[r, i] = np.float32(y[r, i] * w[i])
    return y


@lru_cache(maxsize=1)
def rms_rows_numba():
    """The Numba-compiled loops (no fastmath: the order of the double sum is part of the result)."""
    import numba

    return numba.njit(cache=False)(_rms_rows)


class RmsNormGgml(COp):
    """x float32 (..., n)[, w float32 (n,)] -> x · 1/sqrt(mean(x²) + eps) over the last axis [· w], as ggml computes
    it (module docstring). The weight is an input, not a separate Mul: one node per norm instead of three."""

    computes_ggml_kernel = True  # kernels.expansion: JAX and MLX call its C code where they can

    __props__ = ("eps", "weighted")

    def __init__(self, eps: float, weighted: bool = False):
        self.eps = float(np.float32(eps))
        self.weighted = bool(weighted)

    def make_node(self, x, w=None):
        x = pt.as_tensor_variable(x)
        if x.type.dtype != "float32" or x.type.ndim < 1:
            raise TypeError(f"RmsNormGgml: x must be a float32 tensor, got {x.type}")
        if (w is not None) != self.weighted:
            raise TypeError(
                f"RmsNormGgml(weighted={self.weighted}) called {'with' if w is not None else 'without'} a weight"
            )
        if w is None:
            return Apply(self, [x], [x.type()])
        w = pt.as_tensor_variable(w)
        if w.type.dtype != "float32" or w.type.ndim != 1:
            raise TypeError(f"RmsNormGgml: the weight must be a float32 vector, got {w.type}")
        return Apply(self, [x, w], [x.type()])

    def infer_shape(self, node, shapes):
        return [shapes[0]]

    def perform(self, node, inputs, output_storage):
        x = np.ascontiguousarray(inputs[0], dtype=np.float32)
        w = np.ascontiguousarray(inputs[1] if len(inputs) > 1 else np.empty(0), dtype=np.float32)
        if len(inputs) > 1 and w.shape != x.shape[-1:]:
            raise ValueError(f"RmsNormGgml: weight of shape {w.shape} for rows of {x.shape[-1]}")
        rows = x.reshape(-1, x.shape[-1]) if x.size else x.reshape(0, x.shape[-1])
        output_storage[0][0] = rms_rows_numba()(rows, w, np.float32(self.eps)).reshape(x.shape)

    def c_support_code(self, **kwargs):
        return RMS_NORM_C

    def c_compile_args(self, **kwargs):
        return ["-O3", "-ffp-contract=off"]

    def c_code(self, node, name, inputs, outputs, sub):
        x, w = inputs[0], (inputs[1] if len(inputs) > 1 else None)
        (y,) = outputs
        fail = sub["fail"]
        eps = repr(self.eps)
        weight = "NULL"
        check = ""
        if w is not None:
            weight = "(const float *)PyArray_DATA(wc_)"
            check = f"""
            PyArrayObject *wc_ = PyArray_GETCONTIGUOUS({w});
            if (!wc_) {{ Py_DECREF(xc_); {fail} }}
            if (PyArray_DIM(wc_, 0) != n_) {{
                PyErr_Format(PyExc_ValueError, "RmsNormGgml: weight of %ld for rows of %ld", (long)PyArray_DIM(wc_, 0), (long)n_);
                Py_DECREF(wc_); Py_DECREF(xc_); {fail}
            }}"""
        return same_shape_c_code(
            x,
            y,
            fail,
            f"""
            const long long n_ = (long long)PyArray_DIM(xc_, PyArray_NDIM(xc_) - 1);
            const long long rows_ = n_ ? (long long)PyArray_SIZE(xc_) / n_ : 0;{check}
            alchemist_rms_norm::apply((const float *)PyArray_DATA(xc_), {weight}, (float *)PyArray_DATA({y}), rows_, n_, (float){eps});
            {"Py_DECREF(wc_);" if w is not None else ""}
            """,
        )

    def c_code_cache_version(self):
        return (1, int(hashlib.sha256(RMS_NORM_C.encode()).hexdigest()[:12], 16))


def rms_norm_formula(x, eps: float, weight=None):
    """The same norm as float32 PyTensor ops (equal to ggml's up to the last bit)."""
    mean = pt.mean(pt.sqr(x), axis=-1, keepdims=True)
    y = x * pt.reciprocal(pt.sqrt(mean + np.float32(eps)))
    return y if weight is None else y * weight


def rms_norm_ggml(x, eps: float, weight=None):
    """ggml's rms_norm of x over its last axis, times `weight` if given (the Op; its formula on JAX and MLX
    without the C kernels)."""
    return RmsNormGgml(eps)(x) if weight is None else RmsNormGgml(eps, weighted=True)(x, weight)


@node_rewriter([RmsNormGgml])
def expand_rms_norm_ggml(fgraph, node):
    return [rms_norm_formula(node.inputs[0], node.op.eps, *node.inputs[1:])]


_numba_registered: list = []


def register_numba() -> None:
    """Numba runs the loops of `_rms_rows` (called from kernels.register_numba; idempotent)."""
    if _numba_registered:
        return
    from alchemist.pytensor_ext.pytensor_internals import numba_njit, register_funcify_default_op_cache_key

    # The wrappers are compiled without fastmath too: PyTensor's default (arcp, afn, ...) would let LLVM inline the
    # loops into a function where 1.0f / sqrtf(...) may become a reciprocal-square-root estimate (it does for
    # AVX-512 targets), which is not ggml's result.
    no_fastmath = numba_njit(fastmath=False)

    @register_funcify_default_op_cache_key(RmsNormGgml)
    def numba_funcify_RmsNormGgml(op, node=None, **kwargs):
        rows_fn, eps = rms_rows_numba(), np.float32(op.eps)

        if op.weighted:

            @no_fastmath
            def rms_norm_ggml(x, w):
                n = x.shape[-1]
                if w.shape[0] != n:
                    raise ValueError("RmsNormGgml: the weight does not match the rows")
                flat = np.ascontiguousarray(x).reshape((-1, n))
                return rows_fn(flat, np.ascontiguousarray(w), eps).reshape(x.shape)

        else:

            @no_fastmath
            def rms_norm_ggml(x):
                n = x.shape[-1]
                flat = np.ascontiguousarray(x).reshape((-1, n))
                return rows_fn(flat, np.empty(0, dtype=np.float32), eps).reshape(x.shape)

        version = hashlib.sha256((RMS_NORM_C + "wrapper without fastmath").encode()).hexdigest()[:12]
        return rms_norm_ggml, int(version, 16)

    _numba_registered.append(True)


register_expansion("alchemist_expand_rms_norm_ggml", expand_rms_norm_ggml, backends=("jax", "mlx"))  # Numba runs the loops
