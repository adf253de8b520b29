"""`QuantizedMatmul`: y = x @ dequant(W).T for W kept as GGUF block bytes.

- C backend: `c_code` runs the templated kernels of `c_kernels.C_SOURCE` (OpenMP over output rows).
- Numba backend: `numba_kernels` registers njit(parallel=True) kernels (lazily, see `register_numba`).
- JAX / MLX backends: a rewrite tagged "jax" and "mlx" (never "fast_run") replaces the Op by the plain
  PyTensor graph `dot(x, dequantize_rows(pt, W).T)`, so those backends compile it with their own ops.
- Anything else: `perform` (gguf-py's numpy dequantizer, then a float32 numpy dot).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.link.c.op import COp
from pytensor.link.c.params_type import ParamsType
from pytensor.scalar import int64
from pytensor.tensor.type import TensorType

from alchemist.kernels import formats
from alchemist.kernels.c_kernels import C_SOURCE
from alchemist.kernels.expansion import register_expansion

_C_API_VERSION = 2  # bump when the c_code glue changes (its source is hashed too, when inspect can read it)


@lru_cache(maxsize=1)
def _openmp_flags() -> tuple[str, ...]:
    """-fopenmp when the C++ compiler accepts it (PyTensor's own probe), else nothing (single thread)."""
    try:
        from alchemist.pytensor_ext import pytensor_internals

        if pytensor_internals.GCC_compiler.try_flags(["-fopenmp"]):
            return ("-fopenmp",)
    except Exception:  # noqa: BLE001 - no compiler, or an unusual one: run single-threaded
        pass
    return ()


def _have_blas() -> bool:
    import pytensor

    return bool(pytensor.config.blas__ldflags)


def _blas_flags(**which) -> list[str]:
    if not _have_blas():
        return []
    from alchemist.pytensor_ext.pytensor_internals import blas_ldflags

    if which:
        return blas_ldflags(libs=False, **which)
    return blas_ldflags()


# The kernels' C build settings, shared by the kernel Ops and the Numba backend's library (kernels/native.py).
# BLAS (PyTensor's blas__ldflags) serves the T >= 16 path; without one that path is compiled out.
def kernel_source() -> str:
    if not _have_blas():
        return C_SOURCE
    from alchemist.pytensor_ext.pytensor_internals import blas_header_text

    return blas_header_text() + "\n#define ALCHEMIST_HAVE_BLAS 1\n" + C_SOURCE


def kernel_compile_args() -> list[str]:
    return [*_openmp_flags(), "-O3", "-ffp-contract=off", *_blas_flags(flags=True)]


def kernel_libraries() -> list[str]:
    return [*_blas_flags(), *(["gomp"] if _openmp_flags() else [])]


class _KernelCOp(COp):
    """C build settings shared by the kernel Ops: the kernel source, OpenMP, BLAS, no FMA contraction."""

    def c_support_code(self, **kwargs):
        return kernel_source()

    def c_headers(self, **kwargs):
        return ["<stdint.h>", "<string.h>", "<stdlib.h>"]

    def c_compile_args(self, **kwargs):
        return kernel_compile_args()

    def c_libraries(self, **kwargs):
        return kernel_libraries()

    def c_lib_dirs(self, **kwargs):
        return _blas_flags(libs_dir=True)

    def c_header_dirs(self, **kwargs):
        return _blas_flags(include_dir=True)

    def c_code_cache_version(self):
        return _c_version()


NUMERICS = ("exact", "ggml")


def check_numerics(numerics: str) -> str:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}; got {numerics!r}")
    return numerics


class QuantizedMatmul(_KernelCOp):
    """x (T, n_in) float32, w (n_out, row_bytes) uint8 GGUF rows -> (T, n_out) float32 = x @ dequant(w).T.

    numerics="exact": float32 products with the exactly dequantized weights. numerics="ggml": llama.cpp's CPU
    arithmetic, x @ dequant(w).T with each row of x first rounded to its ggml activation blocks
    (alchemist.kernels.activations); on C integer dot products per block, as ggml-cpu takes them.
    """

    __props__ = ("ggml_type", "n_out", "n_in", "numerics")
    # n_out and n_in reach the C code as run-time parameters: every shape of one ggml type shares one module
    params_type = ParamsType(n_out=int64, n_in=int64)

    @property
    def computes_ggml_kernel(self) -> bool:  # kernels.expansion: JAX and MLX call its ggml kernel where they can
        return self.numerics == "ggml"

    def __init__(self, ggml_type: str, n_out: int, n_in: int, numerics: str = "exact"):
        formats.block_size(ggml_type)  # raises for unsupported types
        self.ggml_type = ggml_type
        self.n_out = int(n_out)
        self.n_in = int(n_in)
        self.numerics = check_numerics(numerics)
        self.row_bytes = formats.row_bytes(ggml_type, self.n_in)
        super().__init__()

    def make_node(self, x, w):
        x = pt.as_tensor_variable(x)
        w = pt.as_tensor_variable(w)
        if x.type.ndim != 2 or x.type.dtype != "float32":
            raise TypeError(f"QuantizedMatmul: x must be a float32 matrix (T, {self.n_in}), got {x.type}")
        if w.type.ndim != 2 or w.type.dtype != "uint8":
            raise TypeError(f"QuantizedMatmul: w must be a uint8 matrix ({self.n_out}, {self.row_bytes}), got {w.type}")
        for got, want, what in (
            (x.type.shape[1], self.n_in, "x.shape[1]"),
            (w.type.shape[0], self.n_out, "w.shape[0]"),
            (w.type.shape[1], self.row_bytes, "w.shape[1]"),
        ):
            if got is not None and got != want:
                raise ValueError(
                    f"QuantizedMatmul({self.ggml_type}, {self.n_out}, {self.n_in}): {what} is {got}, expected {want}"
                )
        out = TensorType("float32", shape=(x.type.shape[0], self.n_out))()
        return Apply(self, [x, w], [out])

    def get_params(self, node):
        return self.params_type.get_params(n_out=self.n_out, n_in=self.n_in)

    def infer_shape(self, node, shapes):
        return [(shapes[0][0], self.n_out)]

    def _check(self, x, w):
        if x.ndim != 2 or x.shape[1] != self.n_in or w.shape != (self.n_out, self.row_bytes):
            raise ValueError(
                f"QuantizedMatmul({self.ggml_type}, {self.n_out}, {self.n_in}): got x {x.shape}, w {w.shape}; "
                f"expected x (T, {self.n_in}), w ({self.n_out}, {self.row_bytes})"
            )

    def perform(self, node, inputs, output_storage):
        x, w = inputs
        self._check(x, w)
        weights = formats.reference_dequantize(w, self.ggml_type)
        if self.numerics == "ggml":
            from alchemist.kernels.activations import round_rows

            x = round_rows(x, self.ggml_type)
        output_storage[0][0] = np.asarray(x @ weights.T, dtype=np.float32)

    def pullback(self, inputs, outputs, output_grads):
        from pytensor.gradient import grad_undefined

        x, w = inputs
        (gy,) = output_grads
        # dL/dx = gy @ dequant(W): every row of W dequantized exactly by the embedding kernel (C, Numba; expanded
        # like the forward Op on JAX/MLX), so a gradient graph adds two nodes per weight, not a symbolic unpacking
        rows = pt.arange(self.n_out, dtype="int64")
        weights = QuantizedEmbedding(self.ggml_type, self.n_out, self.n_in)(w, rows)
        return [pt.dot(gy, weights), grad_undefined(self, 1, w, "quantized weights are not differentiable")]

    # ------------------------------------------------------------------------------------------- C
    def c_code(self, node, name, inputs, outputs, sub):
        x, w = inputs
        (z,) = outputs
        fail = sub["fail"]
        params = sub["params"]
        qk, bs = formats.block_size(self.ggml_type)
        runner = "run_ggml" if self.numerics == "ggml" else "run"
        kernel = f"alchemist_q::{runner}<alchemist_q::{self.ggml_type}>"
        return f"""
        {{
            PyArrayObject *xc_ = NULL, *wc_ = NULL;
            npy_intp T_, n_in_, n_out_, dims_[2];
            int status_ = 0;
            if (PyArray_NDIM({x}) != 2 || PyArray_NDIM({w}) != 2) {{
                PyErr_SetString(PyExc_ValueError, "QuantizedMatmul: x and w must be matrices");
                {fail}
            }}
            T_ = PyArray_DIMS({x})[0];
            n_in_ = PyArray_DIMS({x})[1];
            n_out_ = PyArray_DIMS({w})[0];
            if (n_in_ != {params}->n_in || n_out_ != {params}->n_out || PyArray_DIMS({w})[1] != (n_in_ / {qk}) * {bs}) {{
                PyErr_Format(PyExc_ValueError,
                    "QuantizedMatmul({self.ggml_type}, %lld, %lld): got x (%lld, %lld) and w (%lld, %lld); "
                    "expected x (T, n_in) and w (n_out, n_in / {qk} * {bs})",
                    (long long){params}->n_out, (long long){params}->n_in, (long long)T_, (long long)n_in_,
                    (long long)n_out_, (long long)PyArray_DIMS({w})[1]);
                {fail}
            }}
            xc_ = PyArray_GETCONTIGUOUS({x});
            wc_ = PyArray_GETCONTIGUOUS({w});
            if (!xc_ || !wc_) {{
                Py_XDECREF(xc_);
                Py_XDECREF(wc_);
                {fail}
            }}
            dims_[0] = T_;
            dims_[1] = n_out_;
            if (!{z} || PyArray_NDIM({z}) != 2 || PyArray_DIMS({z})[0] != T_ || PyArray_DIMS({z})[1] != n_out_
                || PyArray_TYPE({z}) != NPY_FLOAT32 || !PyArray_IS_C_CONTIGUOUS({z})) {{
                Py_XDECREF({z});
                {z} = (PyArrayObject *)PyArray_EMPTY(2, dims_, NPY_FLOAT32, 0);
                if (!{z}) {{
                    Py_DECREF(xc_);
                    Py_DECREF(wc_);
                    {fail}
                }}
            }}
            Py_BEGIN_ALLOW_THREADS
            status_ = {kernel}((const uint8_t *)PyArray_DATA(wc_), n_out_, n_in_, (const float *)PyArray_DATA(xc_), T_,
                               (float *)PyArray_DATA({z}));
            Py_END_ALLOW_THREADS
            Py_DECREF(xc_);
            Py_DECREF(wc_);
            if (status_ != 0) {{
                PyErr_NoMemory();
                {fail}
            }}
        }}
        """


class QuantizedEmbedding(_KernelCOp):
    """Rows of GGUF-quantized weights, dequantized: w (n_rows, row_bytes) uint8, idx (T,) int -> (T, n_in) float32.

    Exactly gguf-py's dequantization of those rows (the token embedding lookup of a quantized token_embd).
    """

    __props__ = ("ggml_type", "n_rows", "n_in")
    params_type = ParamsType(n_rows=int64, n_in=int64)

    def __init__(self, ggml_type: str, n_rows: int, n_in: int):
        formats.block_size(ggml_type)
        self.ggml_type = ggml_type
        self.n_rows = int(n_rows)
        self.n_in = int(n_in)
        self.row_bytes = formats.row_bytes(ggml_type, self.n_in)
        super().__init__()

    def get_params(self, node):
        return self.params_type.get_params(n_rows=self.n_rows, n_in=self.n_in)

    def make_node(self, w, idx):
        w = pt.as_tensor_variable(w)
        idx = pt.as_tensor_variable(idx)
        if w.type.ndim != 2 or w.type.dtype != "uint8":
            raise TypeError(
                f"QuantizedEmbedding: w must be a uint8 matrix ({self.n_rows}, {self.row_bytes}), got {w.type}"
            )
        if idx.type.ndim != 1 or not idx.type.dtype.startswith(("int", "uint")):
            raise TypeError(f"QuantizedEmbedding: idx must be an integer vector, got {idx.type}")
        for got, want, what in (
            (w.type.shape[0], self.n_rows, "w.shape[0]"),
            (w.type.shape[1], self.row_bytes, "w.shape[1]"),
        ):
            if got is not None and got != want:
                raise ValueError(
                    f"QuantizedEmbedding({self.ggml_type}, {self.n_rows}, {self.n_in}): {what} is {got}, expected {want}"
                )
        idx = pt.cast(idx, "int64")
        out = TensorType("float32", shape=(idx.type.shape[0], self.n_in))()
        return Apply(self, [w, idx], [out])

    def infer_shape(self, node, shapes):
        return [(shapes[1][0], self.n_in)]

    def perform(self, node, inputs, output_storage):
        w, idx = inputs
        if w.shape != (self.n_rows, self.row_bytes):
            raise ValueError(f"QuantizedEmbedding: w has shape {w.shape}, expected ({self.n_rows}, {self.row_bytes})")
        output_storage[0][0] = formats.reference_dequantize(w[idx], self.ggml_type).reshape(len(idx), self.n_in)

    def pullback(self, inputs, outputs, output_grads):
        from pytensor.gradient import grad_undefined

        w, idx = inputs
        return [grad_undefined(self, 0, w, "quantized weights are not differentiable"), idx.zeros_like(dtype="float32")]

    def c_code(self, node, name, inputs, outputs, sub):
        w, idx = inputs
        (z,) = outputs
        fail = sub["fail"]
        params = sub["params"]
        qk, bs = formats.block_size(self.ggml_type)
        kernel = f"alchemist_q::embed<alchemist_q::{self.ggml_type}>"
        return f"""
        {{
            PyArrayObject *wc_ = NULL, *ic_ = NULL;
            npy_intp dims_[2];
            long long bad_ = 0, bad_index_ = 0;
            if (PyArray_NDIM({w}) != 2 || PyArray_DIMS({w})[0] != {params}->n_rows
                || PyArray_DIMS({w})[1] != ({params}->n_in / {qk}) * {bs}) {{
                PyErr_SetString(PyExc_ValueError, "QuantizedEmbedding({self.ggml_type}): w does not have the shape the Op was built for");
                {fail}
            }}
            wc_ = PyArray_GETCONTIGUOUS({w});
            ic_ = PyArray_GETCONTIGUOUS({idx});
            if (!wc_ || !ic_) {{
                Py_XDECREF(wc_);
                Py_XDECREF(ic_);
                {fail}
            }}
            dims_[0] = PyArray_DIMS({idx})[0];
            dims_[1] = {params}->n_in;
            if (!{z} || PyArray_NDIM({z}) != 2 || PyArray_DIMS({z})[0] != dims_[0] || PyArray_DIMS({z})[1] != dims_[1]
                || PyArray_TYPE({z}) != NPY_FLOAT32 || !PyArray_IS_C_CONTIGUOUS({z})) {{
                Py_XDECREF({z});
                {z} = (PyArrayObject *)PyArray_EMPTY(2, dims_, NPY_FLOAT32, 0);
                if (!{z}) {{
                    Py_DECREF(wc_);
                    Py_DECREF(ic_);
                    {fail}
                }}
            }}
            bad_ = {kernel}((const uint8_t *)PyArray_DATA(wc_), {params}->n_rows, {params}->n_in,
                            (const int64_t *)PyArray_DATA(ic_), dims_[0], (float *)PyArray_DATA({z}));
            if (bad_ != 0) bad_index_ = (long long)((const npy_int64 *)PyArray_DATA(ic_))[-1 - bad_];
            Py_DECREF(wc_);
            Py_DECREF(ic_);
            if (bad_ != 0) {{
                PyErr_Format(PyExc_IndexError, "QuantizedEmbedding: index %lld is out of bounds for %lld rows",
                             bad_index_, (long long){params}->n_rows);
                {fail}
            }}
        }}
        """


class QuantizedExpertMatmul(_KernelCOp):
    """Mixture of experts: x (T, n_in) or (T, K, n_in) float32, w (n_expert, n_out, row_bytes) uint8 GGUF rows,
    ids (T, K) int -> (T, K, n_out) float32, y[t, j] = x[t] (or x[t, j]) @ dequant(w[ids[t, j]]).T.

    Only the experts in ids are read (a decode step costs K experts, whatever n_expert); on C each chosen
    expert runs QuantizedMatmul's kernel once over the tokens routed to it, so y[t, j] equals that kernel's
    one-token product."""

    __props__ = ("ggml_type", "n_expert", "n_out", "n_in", "numerics")
    params_type = ParamsType(n_expert=int64, n_out=int64, n_in=int64)

    def __init__(self, ggml_type: str, n_expert: int, n_out: int, n_in: int, numerics: str = "exact"):
        formats.block_size(ggml_type)
        self.ggml_type = ggml_type
        self.n_expert = int(n_expert)
        self.n_out = int(n_out)
        self.n_in = int(n_in)
        self.numerics = check_numerics(numerics)
        self.row_bytes = formats.row_bytes(ggml_type, self.n_in)
        super().__init__()

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        """The (n_expert, n_out, n_in) of the weight this Op was built for."""
        return (self.n_expert, self.n_out, self.n_in)

    def get_params(self, node):
        return self.params_type.get_params(n_expert=self.n_expert, n_out=self.n_out, n_in=self.n_in)

    def make_node(self, x, w, ids):
        x, w, ids = pt.as_tensor_variable(x), pt.as_tensor_variable(w), pt.as_tensor_variable(ids)
        name = f"QuantizedExpertMatmul({self.ggml_type}, {self.n_expert}, {self.n_out}, {self.n_in})"
        if x.type.ndim not in (2, 3) or x.type.dtype != "float32" or x.type.shape[-1] not in (None, self.n_in):
            raise TypeError(f"{name}: x must be float32 (T, {self.n_in}) or (T, K, {self.n_in}), got {x.type}")
        if w.type.ndim != 3 or w.type.dtype != "uint8":
            raise TypeError(f"{name}: w must be uint8 ({self.n_expert}, {self.n_out}, {self.row_bytes}), got {w.type}")
        for got, want, what in zip(w.type.shape, (self.n_expert, self.n_out, self.row_bytes), ("0", "1", "2")):
            if got is not None and got != want:
                raise ValueError(f"{name}: w.shape[{what}] is {got}, expected {want}")
        if ids.type.ndim != 2 or not ids.type.dtype.startswith(("int", "uint")):
            raise TypeError(f"{name}: ids must be an integer matrix (T, K), got {ids.type}")
        ids = pt.cast(ids, "int64")
        out = TensorType("float32", shape=(ids.type.shape[0], ids.type.shape[1], self.n_out))()
        return Apply(self, [x, w, ids], [out])

    def infer_shape(self, node, shapes):
        return [(shapes[2][0], shapes[2][1], self.n_out)]

    def _check(self, x, w, ids):
        T, K = ids.shape
        if (
            w.shape != (self.n_expert, self.n_out, self.row_bytes)
            or x.shape[0] != T
            or x.shape[-1] != self.n_in
            or (x.ndim == 3 and x.shape[1] != K)
        ):
            raise ValueError(
                f"QuantizedExpertMatmul({self.ggml_type}, {self.n_expert}, {self.n_out}, {self.n_in}): got x {x.shape}, "
                f"w {w.shape}, ids {ids.shape}"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_expert):
            raise IndexError(f"QuantizedExpertMatmul: expert ids must be in [0, {self.n_expert})")

    def perform(self, node, inputs, output_storage):
        x, w, ids = inputs
        self._check(x, w, ids)
        T, K = ids.shape
        y = np.empty((T, K, self.n_out), dtype=np.float32)
        if self.numerics == "ggml":
            from alchemist.kernels.activations import round_rows

            x = round_rows(x.reshape(-1, self.n_in), self.ggml_type).reshape(x.shape)
        for e in np.unique(ids):
            weights = formats.reference_dequantize(w[e], self.ggml_type)
            for t, j in zip(*np.nonzero(ids == e)):
                y[t, j] = np.asarray((x[t, j] if x.ndim == 3 else x[t]) @ weights.T, dtype=np.float32)
        output_storage[0][0] = y

    def c_code(self, node, name, inputs, outputs, sub):
        x, w, ids = inputs
        (z,) = outputs
        fail = sub["fail"]
        params = sub["params"]
        qk, bs = formats.block_size(self.ggml_type)
        kernel = f"alchemist_q::run_experts<alchemist_q::{self.ggml_type}, {int(self.numerics == 'ggml')}>"
        per_rank = int(node.inputs[0].type.ndim == 3)
        return f"""
        {{
            PyArrayObject *xc_ = NULL, *wc_ = NULL, *ic_ = NULL;
            npy_intp dims_[3];
            long long status_ = 0, bad_ = 0;
            npy_intp T_ = PyArray_DIMS({ids})[0], K_ = PyArray_DIMS({ids})[1];
            if (PyArray_NDIM({w}) != 3 || PyArray_DIMS({w})[0] != {params}->n_expert
                || PyArray_DIMS({w})[1] != {params}->n_out || PyArray_DIMS({w})[2] != ({params}->n_in / {qk}) * {bs}
                || PyArray_DIMS({x})[0] != T_ || PyArray_DIMS({x})[{per_rank + 1}] != {params}->n_in
                || ({per_rank} && PyArray_DIMS({x})[1] != K_)) {{
                PyErr_SetString(PyExc_ValueError,
                    "QuantizedExpertMatmul({self.ggml_type}): x, w or ids does not have the shape the Op was built for");
                {fail}
            }}
            xc_ = PyArray_GETCONTIGUOUS({x});
            wc_ = PyArray_GETCONTIGUOUS({w});
            ic_ = PyArray_GETCONTIGUOUS({ids});
            if (!xc_ || !wc_ || !ic_) {{
                Py_XDECREF(xc_);
                Py_XDECREF(wc_);
                Py_XDECREF(ic_);
                {fail}
            }}
            dims_[0] = T_;
            dims_[1] = K_;
            dims_[2] = {params}->n_out;
            if (!{z} || PyArray_NDIM({z}) != 3 || PyArray_DIMS({z})[0] != T_ || PyArray_DIMS({z})[1] != K_
                || PyArray_DIMS({z})[2] != dims_[2] || PyArray_TYPE({z}) != NPY_FLOAT32 || !PyArray_IS_C_CONTIGUOUS({z})) {{
                Py_XDECREF({z});
                {z} = (PyArrayObject *)PyArray_EMPTY(3, dims_, NPY_FLOAT32, 0);
                if (!{z}) {{
                    Py_DECREF(xc_);
                    Py_DECREF(wc_);
                    Py_DECREF(ic_);
                    {fail}
                }}
            }}
            Py_BEGIN_ALLOW_THREADS
            status_ = {kernel}((const uint8_t *)PyArray_DATA(wc_), {params}->n_expert, {params}->n_out, {params}->n_in,
                               (const float *)PyArray_DATA(xc_), {per_rank}, (const int64_t *)PyArray_DATA(ic_), T_, K_,
                               (float *)PyArray_DATA({z}));
            Py_END_ALLOW_THREADS
            if (status_ < 0) bad_ = (long long)((const npy_int64 *)PyArray_DATA(ic_))[-1 - status_];
            Py_DECREF(xc_);
            Py_DECREF(wc_);
            Py_DECREF(ic_);
            if (status_ == 1) {{
                PyErr_NoMemory();
                {fail}
            }}
            if (status_ < 0) {{
                PyErr_Format(PyExc_IndexError, "QuantizedExpertMatmul: expert id %lld is not in [0, %lld)", bad_,
                             (long long){params}->n_expert);
                {fail}
            }}
        }}
        """


@lru_cache(maxsize=1)
def _c_version() -> tuple[int, ...]:
    """PyTensor reuses compiled modules by this version: hash the kernel source and the c_code glue."""
    import inspect

    try:
        glue = inspect.getsource(QuantizedMatmul.c_code) + inspect.getsource(QuantizedEmbedding.c_code)
        glue += inspect.getsource(QuantizedExpertMatmul.c_code)
    except (OSError, TypeError):
        glue = ""
    blas = ""
    if _have_blas():
        from alchemist.pytensor_ext.pytensor_internals import blas_header_version

        blas = f"blas{blas_header_version()}"
    digest = hashlib.sha256((C_SOURCE + glue + blas).encode()).hexdigest()
    return (_C_API_VERSION, int(digest[:12], 16))


def dequantize_then_dot(x, w, ggml_type: str, n_out: int, n_in: int):
    """The same product in plain PyTensor ops (every backend compiles it): x @ dequantize_rows(w).T."""
    weights = formats.dequantize_rows(pt, w, ggml_type, n_out, n_in)
    return pt.dot(x, weights.T)


def round_for(op, x):
    """x as the Op multiplies it: rounded in the graph to its ggml activation blocks when op.numerics == "ggml"."""
    if op.numerics != "ggml":
        return x
    from alchemist.kernels.activations import activation_kind, ACT_Q8_K
    from alchemist.kernels.graph_rounding import round_like_q8_0, round_like_q8_k

    flat = x.reshape((-1, op.n_in))
    rounded = round_like_q8_k(flat) if activation_kind(op.ggml_type) == ACT_Q8_K else round_like_q8_0(flat)
    return rounded.reshape(x.shape)


@node_rewriter([QuantizedMatmul])
def expand_quantized_matmul(fgraph, node):
    """For backends without a kernel (JAX, MLX; with numerics="ggml" only without the C kernels, see
    kernels.expansion): QuantizedMatmul -> dequantize_then_dot."""
    op = node.op
    x, w = node.inputs
    new = dequantize_then_dot(round_for(op, x), w, op.ggml_type, op.n_out, op.n_in)
    old = node.outputs[0]
    return [new if new.type == old.type else old.type.filter_variable(new, allow_convert=True)]


@node_rewriter([QuantizedEmbedding])
def expand_quantized_embedding(fgraph, node):
    """For backends without a kernel (JAX, MLX): QuantizedEmbedding -> dequantize_rows(w[idx])."""
    op = node.op
    w, idx = node.inputs
    n_tokens = idx.type.shape[0]
    if n_tokens is None:
        return None  # the symbolic dequantizer needs static shapes; perform() will run instead
    rows = pt.specify_shape(w, (op.n_rows, op.row_bytes))[idx]
    new = formats.dequantize_rows(pt, rows, op.ggml_type, n_tokens, op.n_in)
    old = node.outputs[0]
    return [new if new.type == old.type else old.type.filter_variable(new, allow_convert=True)]


def dequantize_experts_then_matmul(x, w, ids, ggml_type: str, n_expert: int, n_out: int, n_in: int):
    """QuantizedExpertMatmul in plain PyTensor ops: the chosen experts' blocks taken, dequantized, multiplied.
    Needs static (T, K)."""
    n_tokens, k = ids.type.shape
    rows = pt.specify_shape(w, (n_expert, n_out, formats.row_bytes(ggml_type, n_in)))[ids]  # (T, K, n_out, bytes)
    rows = rows.reshape((n_tokens * k * n_out, -1))
    weights = formats.dequantize_rows(pt, rows, ggml_type, n_tokens * k * n_out, n_in).reshape(
        (n_tokens, k, n_out, n_in)
    )
    xs = x[:, None, :] if x.type.ndim == 2 else x
    return pt.matmul(weights, xs[:, :, :, None])[:, :, :, 0]


@node_rewriter([QuantizedExpertMatmul])
def expand_quantized_expert_matmul(fgraph, node):
    """For backends without a kernel (JAX, MLX): QuantizedExpertMatmul -> dequantize_experts_then_matmul."""
    op = node.op
    x, w, ids = node.inputs
    if None in ids.type.shape:
        return None  # the symbolic dequantizer needs static shapes; perform() will run instead
    new = dequantize_experts_then_matmul(round_for(op, x), w, ids, op.ggml_type, op.n_expert, op.n_out, op.n_in)
    old = node.outputs[0]
    return [new if new.type == old.type else old.type.filter_variable(new, allow_convert=True)]


register_expansion(
    "alchemist_expand_quantized_matmul",
    expand_quantized_matmul,
    expand_quantized_embedding,
    expand_quantized_expert_matmul,
    backends=("jax", "mlx"),  # Numba has the kernels' own loops
)
