"""JAX runs numerics="ggml" with the C backend's own kernels, as XLA FFI custom calls (CPU).

With numerics="ggml" a model's quantized matmuls (QuantizedMatmul), RMS norm (RmsNormGgml), RoPE (RopeCacheGgml,
RopeGgml), attention (CausalAttentionGgml), SiLU (SiluGgml) and GELU (GeluTable) compute as llama.cpp does, each a
loop in C with every float operation in ggml's order. On JAX each becomes one custom call (`jax.ffi.ffi_call`)
into that same C code: the handlers below take XLA's buffers in place (no copy, the weights stay GGUF blocks) and
call the kernel libraries Numba and MLX call (alchemist.kernels.native), so JAX's logits are the C backend's,
and llama.cpp's, bit for bit. Between the calls XLA runs the rest of the graph (residual adds, reshapes, the
KV cache writes: float32 operations that round the same anywhere).

The handler library is built once per machine with PyTensor's C++ compiler, against jaxlib's FFI headers, linked
to the kernel libraries, and kept in alchemist's cache (native.py's `_library`, keyed by the source, the
compiler and the command). Without a compiler, with ALCHEMIST_JAX_FFI=0, or when the build fails (with a
warning), JAX gets the Ops' float32 formulas instead (the rewrites tagged "jax", kernels.expansion): equal to
llama.cpp's values up to rounding, not bit for bit. numerics="exact" never uses this: its matmuls stay
dequantize-then-dot in XLA.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from functools import lru_cache

import numpy as np

from alchemist.kernels import expansion, sources
from alchemist.kernels.signatures import c_declaration
from alchemist.pytensor_ext.host import activating

# one XLA FFI target per kernel; the prefix keeps them apart from any other library's
_PREFIX = "alchemist_ggml_"
_TARGETS = ("matmul", "rms_norm", "rope_cache", "rope", "attention", "silu", "gelu")

_HANDLERS = "jax_ffi_handlers.cpp"  # csrc/: the handlers; _build defines and declares the entry points they call


def _wanted() -> bool:
    return os.environ.get("ALCHEMIST_JAX_FFI", "1") != "0"


def available() -> bool:
    """True when JAX runs the ggml Ops as custom calls (the library built and its targets registered)."""
    return _wanted() and _registered()


expansion.register_kernel_backend("jax", available)


@lru_cache(maxsize=1)
def _registered() -> bool:
    import pytensor

    cxx = pytensor.config.cxx
    if not cxx:
        return False
    try:
        library = _build(cxx)
        import jax

        for target in _TARGETS:
            handler = getattr(library, f"alchemist_ffi_{target}")
            jax.ffi.register_ffi_target(_PREFIX + target, jax.ffi.pycapsule(handler), platform="cpu")
    except Exception as exc:  # noqa: BLE001 - any failure to build, load or register: JAX has the formulas
        warnings.warn(f"JAX computes numerics='ggml' as float32 formulas: the FFI kernel library did not build ({exc})")
        return False
    return True


@activating  # the kernels' flags are PyTensor's (-march, BLAS) as alchemist sets them
def _build(cxx: str) -> ctypes.CDLL:
    import jax

    from alchemist.kernels import native
    from alchemist.kernels.op import _openmp_flags

    entries = native.entry_points(cxx)
    declarations = [f"#define ALCHEMIST_{name.upper()} {symbol}" for name, (_, symbol) in entries.items()]
    declarations += [f'extern "C" {c_declaration(name, symbol)};' for name, (_, symbol) in entries.items()]
    source = "#include <stdint.h>\n" + "\n".join(declarations) + "\n" + sources.source(_HANDLERS)
    dependencies = tuple(dict.fromkeys(path for path, _ in entries.values()))
    command = [
        cxx, "-shared", *native.ops_flags(), "-std=c++17", f"-I{jax.ffi.include_dir()}", "-o", "k.so", "k.cpp",
        *map(str, dependencies), *(["-lgomp"] if _openmp_flags() else []),
    ]  # fmt: skip
    path, _ = native._library(source, command, native._compiler_version(cxx))
    for dependency in dependencies:  # the handler library names them by path; load them first anyway
        ctypes.CDLL(str(dependency), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(path))


def _call(target: str, shape, *args, **attrs):
    import jax
    import jax.numpy as jnp

    return jax.ffi.ffi_call(_PREFIX + target, jax.ShapeDtypeStruct(tuple(shape), jnp.float32))(*args, **attrs)


def _empty():
    import jax.numpy as jnp

    return jnp.zeros((0,), dtype=jnp.float32)


def _matmul(ggml_type: str, n_out: int, n_in: int):
    """x (T, n_in) times the (n_out, bytes per row) blocks of w, by the C kernel."""
    from alchemist.kernels.native import TYPE_INDEX

    attrs = {"type_index": np.int32(TYPE_INDEX[ggml_type]), "n_out": np.int64(n_out), "n_in": np.int64(n_in)}
    return lambda x, w: _call("matmul", (*x.shape[:-1], n_out), x, w, **attrs)


def _attention(op, n_shards: int = 1):
    """The C attention kernel for op's heads, or for one device's 1/n_shards of its heads and KV heads; sinks
    is an array (empty without sinks)."""
    n_head, n_kv_head = op.n_head // n_shards, op.n_kv_head // n_shards
    attrs = {
        "n_head": np.int64(n_head), "n_kv_head": np.int64(n_kv_head), "head_dim": np.int64(op.head_dim),
        "window": np.int64(op.window), "scale": np.float32(op.scale), "softcap": np.float32(op.softcap),
        "has_sinks": np.int32(op.has_sinks),
    }  # fmt: skip

    def attention(q, keys, values, q_positions, key_positions, sinks):
        shape = (q.shape[0], n_head * op.head_dim)
        return _call("attention", shape, q, keys, values, q_positions, key_positions, sinks, **attrs)

    return attention


_done: list = []


def register() -> None:
    """Register the Ops' JAX implementations with PyTensor's JAX dispatch (idempotent). Called when a JAX mode
    is made (alchemist.runtime.backends.get_mode); a graph reaches them only where
    kernels.expansion.kernels_compute said so."""
    if _done:
        return
    from alchemist.kernels.attention import CausalAttentionGgml
    from alchemist.kernels.gelu import GeluTable
    from alchemist.kernels.op import QuantizedMatmul
    from alchemist.kernels.rms_norm import RmsNormGgml
    from alchemist.kernels.rope import RopeCacheGgml, RopeGgml
    from alchemist.kernels.sharded import ShardedAttention, ShardedQuantizedMatmul
    from alchemist.kernels.silu import SiluGgml
    from alchemist.runtime.sharding import AXIS
    from alchemist.pytensor_ext.pytensor_internals import jax_funcify

    i32, f32 = np.int32, np.float32

    @jax_funcify.register(QuantizedMatmul)
    def jax_funcify_QuantizedMatmul(op, node=None, **kwargs):
        if op.numerics != "ggml":
            raise NotImplementedError("QuantizedMatmul(numerics='exact') is expanded into XLA ops before JAX")
        matmul = _matmul(op.ggml_type, op.n_out, op.n_in)

        def quantized_matmul(x, w):
            op._check(x, w)  # static shapes: checked once, while tracing
            return matmul(x, w)

        return quantized_matmul

    @jax_funcify.register(RmsNormGgml)
    def jax_funcify_RmsNormGgml(op, node=None, **kwargs):
        attrs = {"eps": f32(op.eps), "weighted": i32(op.weighted)}

        def rms_norm_ggml(x, w=None):
            return _call("rms_norm", x.shape, x, _empty() if w is None else w, **attrs)

        return rms_norm_ggml

    @jax_funcify.register(RopeCacheGgml)
    def jax_funcify_RopeCacheGgml(op, node=None, **kwargs):
        floats = ("freq_base", "freq_scale", "ext_factor", "attn_factor", "beta_fast", "beta_slow")
        attrs = {name: f32(getattr(op, name)) for name in floats}
        attrs.update(n_dims=i32(op.n_dims), n_ctx_orig=i32(op.n_ctx_orig))

        def rope_cache_ggml(positions, freq_factors=None):
            has_ff = i32(freq_factors is not None)
            ff = _empty() if freq_factors is None else freq_factors
            return _call("rope_cache", (positions.shape[0], op.n_dims // 2, 2), positions, ff, has_ff=has_ff, **attrs)

        return rope_cache_ggml

    @jax_funcify.register(RopeGgml)
    def jax_funcify_RopeGgml(op, node=None, **kwargs):
        attrs = {"n_dims": i32(op.n_dims), "neox": i32(op.style == "neox")}

        def rope_ggml(x, cache):
            return _call("rope", x.shape, x, cache, **attrs)

        return rope_ggml

    @jax_funcify.register(CausalAttentionGgml)
    def jax_funcify_CausalAttentionGgml(op, node=None, **kwargs):
        attention = _attention(op)

        def causal_attention_ggml(q, keys, values, q_positions, key_positions, sinks=None):
            return attention(q, keys, values, q_positions, key_positions, _empty() if sinks is None else sinks)

        return causal_attention_ggml

    @jax_funcify.register(ShardedQuantizedMatmul)
    def jax_funcify_ShardedQuantizedMatmul(op, node=None, **kwargs):
        import jax
        from jax.sharding import PartitionSpec as P

        base, n, axis = op.base, op.n_shards, AXIS
        if op.split == "rows":  # each device: the whole x times its rows; the output split by columns
            local = _matmul(base.ggml_type, base.n_out // n, base.n_in)
            specs = dict(in_specs=(P(), P(axis, None)), out_specs=P(None, axis))
        else:  # each device: its columns of x times its blocks of every row; the partial products summed
            part = _matmul(base.ggml_type, base.n_out, base.n_in // n)

            def local(x, w):
                return jax.lax.psum(part(x, w), axis)

            specs = dict(in_specs=(P(None, axis), P(None, axis)), out_specs=P())
        # the mesh is the one the step runs under (jax.set_mesh); custom calls have no varying-axes rule
        sharded = jax.shard_map(local, check_vma=False, **specs)

        def sharded_quantized_matmul(x, w):
            base._check(x, w)
            return sharded(x, w)

        return sharded_quantized_matmul

    @jax_funcify.register(ShardedAttention)
    def jax_funcify_ShardedAttention(op, node=None, **kwargs):
        import jax
        from jax.sharding import PartitionSpec as P

        base, n, axis = op.base, op.n_shards, AXIS
        heads, kv_heads = P(None, axis, None), P(None, None, axis, None)
        sharded = jax.shard_map(
            _attention(base, n),  # each device: its heads and KV heads
            in_specs=(heads, kv_heads, kv_heads, P(), P(), P(axis) if base.has_sinks else P()),
            out_specs=P(None, axis),
            check_vma=False,
        )

        def sharded_attention(q, keys, values, q_positions, key_positions, sinks=None):
            return sharded(q, keys, values, q_positions, key_positions, _empty() if sinks is None else sinks)

        return sharded_attention

    @jax_funcify.register(SiluGgml)
    def jax_funcify_SiluGgml(op, node=None, **kwargs):
        def silu_ggml(x):
            return _call("silu", x.shape, x)

        return silu_ggml

    @jax_funcify.register(GeluTable)
    def jax_funcify_GeluTable(op, node=None, **kwargs):
        def gelu_table(x):
            return _call("gelu", x.shape, x)

        return gelu_table

    _done.append(True)
