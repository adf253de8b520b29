"""MLX runs numerics="ggml" with the C backend's own kernels, called from an eager MLX graph.

With numerics="ggml" a model's quantized matmuls, RMS norm, RoPE, attention, SiLU and GELU compute as llama.cpp
does, each a loop in C with ggml's float operations in ggml's order (alchemist.kernels). JAX calls that C code as
XLA custom calls (alchemist.kernels.jax_ffi); MLX has no such hook on the CPU (its custom primitives need a C++
extension built against MLX's own nanobind, and `mx.compile` admits no call back to the host). So a graph holding
these Ops runs on MLX uncompiled (`MLXLinkerForKernels`: PyTensor's MLX linker without `mx.compile`): MLX
evaluates what comes before an Op, the Op's C code reads those arrays in place (NumPy views of MLX's buffers, the
weights' GGUF blocks too) and its result becomes an MLX array again. MLX computes everything else (residual
adds, reshapes, the KV cache, the embedding lookup), float32 operations that round the same anywhere, so MLX's
logits are the C backend's, and llama.cpp's, bit for bit.

The kernels are the libraries Numba calls (alchemist.kernels.native: the matmuls, RoPE, attention, SiLU and GELU)
plus ggml's RMS norm loops built alone. Without a C++ compiler, with ALCHEMIST_MLX_KERNELS=0, or when a build
fails (with a warning), MLX gets the Ops' float32 formulas instead, compiled (equal to llama.cpp's values up to
rounding). Graphs without these Ops (numerics="exact") are compiled with `mx.compile` as before.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from functools import lru_cache
from types import SimpleNamespace

import numpy as np

from alchemist.kernels import expansion
from alchemist.kernels.signatures import ctypes_signature
from alchemist.pytensor_ext.host import activating


def _wanted() -> bool:
    return os.environ.get("ALCHEMIST_MLX_KERNELS", "1") != "0"


def available() -> bool:
    """True when MLX runs the ggml Ops by their C code (the libraries built and loaded)."""
    return _wanted() and _kernels() is not None


expansion.register_kernel_backend("mlx", available)


@lru_cache(maxsize=1)
@activating  # the kernels' flags are PyTensor's (-march, BLAS) as alchemist sets them
def _kernels():
    """The entry points (a namespace of ctypes functions), or None (no compiler, or a failed build: warned)."""
    import pytensor

    from alchemist.kernels import native

    cxx = pytensor.config.cxx
    if not cxx:
        return None
    try:
        entries = native.entry_points(cxx)
        libraries = {path: ctypes.CDLL(str(path)) for path, _ in entries.values()}
        functions = {}
        for name, (path, symbol) in entries.items():
            fn = getattr(libraries[path], symbol)
            fn.restype, fn.argtypes = ctypes_signature(name)
            functions[name] = fn
    except Exception as exc:  # noqa: BLE001 - any failure to build or load: MLX has the formulas
        warnings.warn(f"MLX computes numerics='ggml' as float32 formulas: the C kernel libraries did not load ({exc})")
        return None
    return SimpleNamespace(**functions)


def _host(a, dtype) -> np.ndarray:
    """An MLX array as a C-contiguous NumPy array (a view of MLX's buffer when it already is one)."""
    return np.ascontiguousarray(np.asarray(a), dtype=dtype)


def _address(a: np.ndarray) -> int:
    return a.ctypes.data


def _uses_kernels(fgraph) -> bool:
    from alchemist.kernels.expansion import is_ggml_kernel_node

    return any(is_ggml_kernel_node(node) for node in fgraph.apply_nodes)


_done: list = []


def register() -> None:
    """Register the Ops' MLX implementations with PyTensor's MLX dispatch (idempotent). Called when an MLX mode is
    made (alchemist.runtime.backends.get_mode); a graph reaches them only where
    kernels.expansion.kernels_compute said so."""
    if _done:
        return
    import mlx.core as mx

    from alchemist.kernels.attention import CausalAttentionGgml
    from alchemist.kernels.gelu import GeluTable
    from alchemist.kernels.mlx_affine import MlxAffineMatmul
    from alchemist.kernels.native import TYPE_INDEX
    from alchemist.kernels.op import QuantizedMatmul
    from alchemist.kernels.rms_norm import RmsNormGgml
    from alchemist.kernels.rope import RopeCacheGgml, RopeGgml
    from alchemist.kernels.silu import SiluGgml
    from alchemist.pytensor_ext.pytensor_internals import mlx_funcify

    f32, i64 = np.float32, np.int64

    @mlx_funcify.register(QuantizedMatmul)
    def mlx_funcify_QuantizedMatmul(op, node=None, **kwargs):
        if op.numerics != "ggml":
            raise NotImplementedError("QuantizedMatmul(numerics='exact') is expanded into MLX ops")
        kernels, type_index = _kernels(), TYPE_INDEX[op.ggml_type]

        def quantized_matmul(x, w):
            xh, wh = _host(x, f32), _host(w, np.uint8)
            op._check(xh, wh)
            y = np.empty((xh.shape[0], op.n_out), dtype=f32)
            if kernels.matmul(type_index, 1, _address(wh), op.n_out, op.n_in, _address(xh), xh.shape[0], _address(y)):
                raise RuntimeError("QuantizedMatmul: the C kernel failed")
            return mx.array(y)

        return quantized_matmul

    @mlx_funcify.register(RmsNormGgml)
    def mlx_funcify_RmsNormGgml(op, node=None, **kwargs):
        kernels, eps = _kernels(), f32(op.eps)

        def rms_norm_ggml(x, w=None):
            xh = _host(x, f32)
            n = xh.shape[-1]
            wh = None if w is None else _host(w, f32)
            if wh is not None and wh.shape != (n,):
                raise ValueError("RmsNormGgml: the weight does not match the rows")
            y = np.empty_like(xh)
            kernels.rms_norm(_address(xh), None if wh is None else _address(wh), _address(y), xh.size // n if n else 0,
                             n, eps)  # fmt: skip
            return mx.array(y)

        return rms_norm_ggml

    @mlx_funcify.register(RopeCacheGgml)
    def mlx_funcify_RopeCacheGgml(op, node=None, **kwargs):
        kernels, n_pairs = _kernels(), op.n_dims // 2
        floats = [f32(getattr(op, k)) for k in ("freq_base", "freq_scale", "ext_factor", "attn_factor", "beta_fast",
                                                 "beta_slow")]  # fmt: skip

        def rope_cache_ggml(positions, freq_factors=None):
            ph = _host(positions, i64)
            ff = None if freq_factors is None else _host(freq_factors, f32)
            if ff is not None and ff.shape[0] < n_pairs:
                raise ValueError("RopeCacheGgml: fewer frequency factors than rotated pairs")
            out = np.empty((ph.shape[0], n_pairs, 2), dtype=f32)
            kernels.rope_cache(_address(ph), ph.shape[0], None if ff is None else _address(ff), 1, op.n_dims, *floats,
                               op.n_ctx_orig, _address(out))  # fmt: skip
            return mx.array(out)

        return rope_cache_ggml

    @mlx_funcify.register(RopeGgml)
    def mlx_funcify_RopeGgml(op, node=None, **kwargs):
        kernels, n_pairs, neox = _kernels(), op.n_dims // 2, int(op.style == "neox")

        def rope_ggml(x, cache):
            xh, ch = _host(x, f32), _host(cache, f32)
            if ch.shape != (xh.shape[0], n_pairs, 2) or xh.ndim != 3 or xh.shape[2] < op.n_dims:
                raise ValueError("RopeGgml: x and the cache do not match")
            y = np.empty_like(xh)
            kernels.rope(_address(xh), _address(ch), _address(y), *xh.shape, op.n_dims, neox)
            return mx.array(y)

        return rope_ggml

    @mlx_funcify.register(CausalAttentionGgml)
    def mlx_funcify_CausalAttentionGgml(op, node=None, **kwargs):
        kernels = _kernels()
        H, KVH, D = op.n_head, op.n_kv_head, op.head_dim

        def causal_attention_ggml(q, keys, values, q_positions, key_positions, sinks=None):
            qh, kh, vh = _host(q, f32), _host(keys, f32), _host(values, f32)
            qp, kp = _host(q_positions, i64), _host(key_positions, i64)
            sh = None if sinks is None else _host(sinks, f32)
            B, S = kh.shape[0], kh.shape[1]
            T = qh.shape[0] // B if B else 0
            if (
                qh.shape[1:] != (H, D)
                or kh.shape[2:] != (KVH, D)
                or vh.shape != kh.shape
                or B * T != qh.shape[0]
                or qp.size != B * T
                or kp.size != B * S
                or (sh is not None and sh.shape != (H,))
            ):
                raise ValueError("CausalAttentionGgml: inconsistent shapes")  # fmt: skip
            out = np.empty((B * T, H * D), dtype=f32)
            status = kernels.attention(_address(qh), _address(kh), _address(vh), _address(qp), _address(kp),
                                       None if sh is None else _address(sh), _address(out), B, T, S, H, KVH, D,
                                       op.window, f32(op.scale), f32(op.softcap))  # fmt: skip
            if status != 0:
                raise MemoryError("CausalAttentionGgml: the C code could not allocate its work buffers")
            return mx.array(out)

        return causal_attention_ggml

    @mlx_funcify.register(SiluGgml)
    def mlx_funcify_SiluGgml(op, node=None, **kwargs):
        kernels = _kernels()

        def silu_ggml(x):
            xh = _host(x, f32)
            y, n = np.empty_like(xh), (xh.shape[-1] if xh.ndim else 1)
            kernels.silu(_address(xh), _address(y), xh.size // n if n else 0, n)
            return mx.array(y)

        return silu_ggml

    @mlx_funcify.register(GeluTable)
    def mlx_funcify_GeluTable(op, node=None, **kwargs):
        kernels = _kernels()

        def gelu_table(x):
            xh = _host(x, f32)
            y = np.empty_like(xh)
            kernels.gelu(_address(xh), _address(y), xh.size)
            return mx.array(y)

        return gelu_table

    @mlx_funcify.register(MlxAffineMatmul)
    def mlx_funcify_MlxAffineMatmul(op, node=None, **kwargs):
        def mlx_affine_matmul(x, w, scales, biases):  # MLX's own kernel for its own format
            return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=op.group, bits=op.bits)

        return mlx_affine_matmul

    _done.append(True)


def linker_class():
    """PyTensor's MLX linker, compiling with `mx.compile` only a graph without the Ops above (see the module
    docstring): with them it runs the graph eagerly."""
    return _linker_class()


@lru_cache(maxsize=1)
def _linker_class():
    from alchemist.pytensor_ext.pytensor_internals import MLXLinker

    class MLXLinkerForKernels(MLXLinker):
        def jit_compile(self, fn):
            if _uses_kernels(self.fgraph):
                self.use_compile = False  # mx.compile cannot trace a call into C
            return super().jit_compile(fn)

    return MLXLinkerForKernels
