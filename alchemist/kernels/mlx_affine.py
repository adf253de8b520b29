"""`MlxAffineMatmul`: y = x @ W.T for W in MLX's affine quantization (mlx-lm's default), kept packed.

    y = mlx_affine_linear(x, w, scales, biases, bits=4, group=64, n_out=..., n_in=...)
    e = mlx_affine_rows(w, scales, biases, tokens, bits=4, group=64, n_in=...)  # rows of a quantized table

w (n_out, n_in · bits / 32) uint32: each row's values end to end, `bits` each, least significant bit first (3- and
6-bit values may straddle two words); scales and biases (n_out, n_in / group) float32; a weight is
scale · q + bias over each group of `group` values of a row (mx.dequantize's formula). Bits 2, 3, 4, 5, 6, 8;
groups of 32, 64, 128.

Per backend:
  C       csrc/mlx_affine.cpp: each row dequantized once per call (float32, no contraction), then dotted with every
          token; OpenMP over output rows
  Numba   the same loops, njit(parallel=True) over output rows
  JAX     rewritten into PyTensor ops (tag "jax"): the weight dequantized in the graph, then a dot
  MLX     mx.quantized_matmul, MLX's own kernel (alchemist.kernels.mlx_host)
  other   `perform`: numpy's dequantization, then a float32 dot
All of them are dequantize-then-matmul in float32, up to summation order (MLX's kernel sums in its own order).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.link.c.op import COp
from pytensor.link.c.params_type import ParamsType
from pytensor.scalar import int64
from pytensor.tensor.type import TensorType

from alchemist.kernels.expansion import register_expansion
from alchemist.kernels.sources import source

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
C_SOURCE = source("mlx_affine.cpp")


def check_layout(bits: int, group: int, n_in: int) -> None:
    if bits not in BITS or group not in GROUPS:
        raise ValueError(f"MLX affine quantization: bits {bits} and group size {group} (supported: {BITS}, {GROUPS})")
    if n_in % group or n_in * bits % 32:
        raise ValueError(f"MLX affine quantization: rows of {n_in} values do not split into groups of {group} "
                         f"and whole words of {bits}-bit values")  # fmt: skip


def dequantize_reference(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int) -> np.ndarray:
    """The float32 weights (rows, n_in) of packed rows w (rows, words) uint32, as mx.dequantize computes them."""
    rows, n_in = w.shape[0], w.shape[1] * 32 // bits
    stream = np.unpackbits(np.ascontiguousarray(w, "<u4").view(np.uint8), axis=-1, bitorder="little")
    q = (stream.reshape(rows, n_in, bits).astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(-1, np.uint32)
    groups = q.reshape(rows, -1, group).astype(np.float32)
    return (groups * scales[:, :, None].astype(np.float32) + biases[:, :, None].astype(np.float32)).reshape(rows, n_in)


def dequantize_graph(w, scales, biases, bits: int, group: int, n_in: int):
    """dequantize_reference as PyTensor ops (what JAX compiles, and the gradient's weights)."""
    # shifts as divisions by powers of two (PyTensor has no bit shift), unsigned throughout (JAX has no 64-bit ints)
    rows, w, u32 = w.shape[0], w[:, :, None], np.uint32
    if 32 % bits == 0:  # whole values per word: each word's values in turn
        q = ((w // pt.constant(u32(2) ** np.arange(0, 32, bits, dtype=u32))) % u32(1 << bits)).reshape((rows, n_in))
    else:  # values straddle words: the bit stream, then `bits` bits per value
        stream = (w // pt.constant(u32(2) ** np.arange(32, dtype=u32))) % u32(2)
        q = (stream.reshape((rows, n_in, bits)) * pt.constant(u32(2) ** np.arange(bits, dtype=u32))).sum(
            axis=-1, dtype="uint32", acc_dtype="uint32"
        )
    # each value's group by a constant column index (no reshape of a row into its groups: the auditor's head
    # analysis reads a reshape of a row as a split into heads)
    column_group = pt.constant(np.arange(n_in, dtype=np.int64) // group)
    return pt.cast(q, "float32") * scales[:, column_group] + biases[:, column_group]


class MlxAffineMatmul(COp):
    """x (T, n_in) float32, w (n_out, n_in·bits/32) uint32, scales and biases (n_out, n_in/group) float32 ->
    (T, n_out) float32 = x @ dequant(w).T (see the module docstring)."""

    __props__ = ("bits", "group", "n_out", "n_in")
    # the C code reads them at run time: one compiled module serves every layout and shape
    params_type = ParamsType(bits=int64, group=int64, n_out=int64, n_in=int64)

    def __init__(self, bits: int, group: int, n_out: int, n_in: int):
        check_layout(int(bits), int(group), int(n_in))
        self.bits, self.group, self.n_out, self.n_in = int(bits), int(group), int(n_out), int(n_in)
        self.words, self.groups = self.n_in * self.bits // 32, self.n_in // self.group
        super().__init__()

    def make_node(self, x, w, scales, biases):
        x, w, scales, biases = map(pt.as_tensor_variable, (x, w, scales, biases))
        wanted = ((x, "float32", (None, self.n_in), "x"), (w, "uint32", (self.n_out, self.words), "w"),
                  (scales, "float32", (self.n_out, self.groups), "scales"),
                  (biases, "float32", (self.n_out, self.groups), "biases"))  # fmt: skip
        for var, dtype, shape, what in wanted:
            if (
                var.type.dtype != dtype
                or var.type.ndim != 2
                or any(got is not None and want is not None and got != want for got, want in zip(var.type.shape, shape))
            ):
                raise TypeError(f"{self}: {what} must be a {dtype} matrix {shape}, got {var.type}")
        out = TensorType("float32", shape=(x.type.shape[0], self.n_out))()
        return Apply(self, [x, w, scales, biases], [out])

    def get_params(self, node):
        return self.params_type.get_params(bits=self.bits, group=self.group, n_out=self.n_out, n_in=self.n_in)

    def __str__(self):
        return f"MlxAffineMatmul({self.bits} bits, groups of {self.group}, {self.n_out}x{self.n_in})"

    def infer_shape(self, node, shapes):
        return [(shapes[0][0], self.n_out)]

    def check(self, x, w, scales, biases):
        if (x.ndim != 2 or x.shape[1] != self.n_in or w.shape != (self.n_out, self.words)
                or scales.shape != (self.n_out, self.groups) or biases.shape != scales.shape):  # fmt: skip
            raise ValueError(f"{self}: got x {x.shape}, w {w.shape}, scales {scales.shape}, biases {biases.shape}; "
                             f"expected x (T, {self.n_in}), w {(self.n_out, self.words)}, scales and biases "
                             f"{(self.n_out, self.groups)}")  # fmt: skip

    def perform(self, node, inputs, output_storage):
        x, w, scales, biases = inputs
        self.check(x, w, scales, biases)
        weights = dequantize_reference(w, scales, biases, self.bits, self.group)
        output_storage[0][0] = np.asarray(x @ weights.T, dtype=np.float32)

    def pullback(self, inputs, outputs, output_grads):
        from pytensor.gradient import grad_undefined

        x, w, scales, biases = inputs
        weights = dequantize_graph(w, scales, biases, self.bits, self.group, self.n_in)
        return [pt.dot(output_grads[0], weights)] + [
            grad_undefined(self, i, v, "quantized weights are not differentiable")
            for i, v in ((1, w), (2, scales), (3, biases))
        ]

    # ------------------------------------------------------------------------------------------- C
    def c_support_code(self, **kwargs):
        return C_SOURCE

    def c_headers(self, **kwargs):
        return ["<stdint.h>", "<vector>"]

    def c_compile_args(self, **kwargs):
        from alchemist.kernels.op import _openmp_flags

        return [*_openmp_flags(), "-O3", "-ffp-contract=off"]

    def c_libraries(self, **kwargs):
        from alchemist.kernels.op import _openmp_flags

        return ["gomp"] if _openmp_flags() else []

    def c_code_cache_version(self):
        return (2, int(hashlib.sha256(C_SOURCE.encode()).hexdigest()[:12], 16))

    def c_code(self, node, name, inputs, outputs, sub):
        x, w, s, b = inputs
        (z,) = outputs
        fail, p = sub["fail"], sub["params"]
        return f"""
        {{
            PyArrayObject *in_[4] = {{{x}, {w}, {s}, {b}}}, *c_[4] = {{NULL, NULL, NULL, NULL}};
            const npy_intp words_ = {p}->n_in * {p}->bits / 32, groups_ = {p}->n_in / {p}->group;
            npy_intp dims_[2];
            int ok_ = 1;
            if (PyArray_DIMS({x})[1] != {p}->n_in || PyArray_DIMS({w})[0] != {p}->n_out || PyArray_DIMS({w})[1] != words_
                || PyArray_DIMS({s})[0] != {p}->n_out || PyArray_DIMS({s})[1] != groups_
                || PyArray_DIMS({b})[0] != {p}->n_out || PyArray_DIMS({b})[1] != groups_) {{
                PyErr_SetString(PyExc_ValueError, "MlxAffineMatmul: an input does not have the shape the Op was built for");
                {fail}
            }}
            for (int i_ = 0; i_ < 4; i_++) {{
                c_[i_] = PyArray_GETCONTIGUOUS(in_[i_]);
                if (!c_[i_]) ok_ = 0;
            }}
            dims_[0] = PyArray_DIMS({x})[0];
            dims_[1] = {p}->n_out;
            if (ok_ && (!{z} || PyArray_DIMS({z})[0] != dims_[0] || PyArray_DIMS({z})[1] != dims_[1]
                        || !PyArray_IS_C_CONTIGUOUS({z}))) {{
                Py_XDECREF({z});
                {z} = (PyArrayObject *)PyArray_EMPTY(2, dims_, NPY_FLOAT32, 0);
                if (!{z}) ok_ = 0;
            }}
            if (ok_) {{
                Py_BEGIN_ALLOW_THREADS
                alchemist_mlx_affine::matmul((const float *)PyArray_DATA(c_[0]), (const uint32_t *)PyArray_DATA(c_[1]),
                    (const float *)PyArray_DATA(c_[2]), (const float *)PyArray_DATA(c_[3]), (float *)PyArray_DATA({z}),
                    dims_[0], {p}->n_out, {p}->n_in, (int){p}->bits, {p}->group);
                Py_END_ALLOW_THREADS
            }}
            for (int i_ = 0; i_ < 4; i_++) Py_XDECREF(c_[i_]);
            if (!ok_) {{
                {fail}
            }}
        }}
        """


def mlx_affine_linear(x, w, scales, biases, bits: int, group: int, n_out: int, n_in: int):
    """x (T, n_in) float32 @ dequant(w).T -> (T, n_out) float32 for an MLX affine-quantized weight (see above)."""
    return MlxAffineMatmul(bits, group, n_out, n_in)(x, w, scales, biases)


def mlx_affine_rows(w, scales, biases, rows, bits: int, group: int, n_in: int):
    """Rows `rows` (an integer vector) of an MLX affine-quantized table, dequantized: (T, n_in) float32. The rows are
    read packed and dequantized in the graph (the table's other rows are never decoded), on every backend."""
    return dequantize_graph(w[rows], scales[rows], biases[rows], bits, group, n_in)


@node_rewriter([MlxAffineMatmul])
def expand_mlx_affine(fgraph, node):
    op = node.op
    x, w, scales, biases = node.inputs
    return [pt.dot(x, dequantize_graph(w, scales, biases, op.bits, op.group, op.n_in).T)]


register_expansion("alchemist_expand_mlx_affine", expand_mlx_affine, backends=("jax",))


def register_numba() -> None:
    """The Numba kernel (idempotent): the C loops, as njit(parallel=True) over output rows."""
    if _registered:
        return
    from alchemist.pytensor_ext.pytensor_internals import (
        numba_launch_threads,
        numba_njit,
        register_funcify_default_op_cache_key,
    )

    @register_funcify_default_op_cache_key(MlxAffineMatmul)
    def numba_funcify_MlxAffineMatmul(op, node=None, **kwargs):
        numba_launch_threads()
        bits, group, n_out, n_in, words, n_groups = op.bits, op.group, op.n_out, op.n_in, op.words, op.groups
        kernel = _numba_kernel()

        @numba_njit(fastmath=False)
        def mlx_affine_matmul(x, w, scales, biases):
            if (
                x.shape[1] != n_in
                or w.shape[0] != n_out
                or w.shape[1] != words
                or scales.shape[0] != n_out
                or scales.shape[1] != n_groups
                or biases.shape[0] != n_out
                or biases.shape[1] != n_groups
            ):
                raise ValueError("MlxAffineMatmul: an input does not have the shape the Op was built for")
            return kernel(np.ascontiguousarray(x), np.ascontiguousarray(w), np.ascontiguousarray(scales),
                          np.ascontiguousarray(biases), np.int64(bits), np.int64(group))  # fmt: skip

        return mlx_affine_matmul, _SOURCE_VERSION

    _registered.append(True)


def _numba_kernel():
    import numba

    @numba.njit(parallel=True, fastmath=False, cache=True)
    def kernel(x, w, scales, biases, bits, group):
        T, n_in, n_out = x.shape[0], x.shape[1], w.shape[0]
        mask = np.uint32((1 << bits) - 1)
        y = np.empty((T, n_out), dtype=np.float32)
        for r in numba.prange(n_out):
            row = np.empty(n_in, dtype=np.float32)
            for j in range(n_in):
                bit = j * bits
                word, shift = bit >> 5, bit & 31
                v = w[r, word] >> np.uint32(shift)
                if shift + bits > 32:
                    v |= w[r, word + 1] << np.uint32(32 - shift)
                g = j // group
                row[j] = scales[r, g] * np.float32(v & mask) + biases[r, g]
            for t in range(T):
                acc = np.float32(0.0)
                for j in range(n_in):
                    acc += row[j] * x[t, j]
                y[t, r] = acc
        return y

    return kernel


_registered: list = []
_SOURCE_VERSION = int(hashlib.sha256(C_SOURCE.encode() + Path(__file__).read_bytes()).hexdigest()[:12], 16)
