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

# one XLA FFI target per kernel; the prefix keeps them apart from any other library's
_PREFIX = "alchemist_ggml_"
_TARGETS = ("matmul", "rms_norm", "rope_cache", "rope", "attention", "silu", "gelu")

_HANDLERS = r"""
#include <stdint.h>
#include <string>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" int {matmul}(int type_index, int ggml, uintptr_t W, long long n_out, long long n_in, uintptr_t X,
                        long long T, uintptr_t Y);
extern "C" void {ops}_rope_cache(uintptr_t pos, long long n_pos, uintptr_t ff, long long ff_stride, int n_dims,
                                 float freq_base, float freq_scale, float ext_factor, float attn_factor,
                                 float beta_fast, float beta_slow, int n_ctx_orig, uintptr_t out);
extern "C" void {ops}_rope(uintptr_t x, uintptr_t cache, uintptr_t y, long long n_pos, long long n_head,
                           long long head_dim, int n_dims, int neox);
extern "C" int {ops}_attention(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t qpos, uintptr_t kpos,
                               uintptr_t sinks, uintptr_t out, long long B, long long T, long long S, long long H,
                               long long KVH, long long D, long long window, float scale, float softcap);
extern "C" void {ops}_silu(uintptr_t x, uintptr_t y, long long rows, long long n);
extern "C" void {ops}_gelu(uintptr_t x, uintptr_t y, long long n);
extern "C" void {rms}(uintptr_t x, uintptr_t w, uintptr_t y, long long rows, long long n, float eps);

namespace {{
typedef ffi::Buffer<ffi::F32> F32;
typedef ffi::ResultBuffer<ffi::F32> F32Out;

uintptr_t addr(const void *p) {{ return reinterpret_cast<uintptr_t>(p); }}

ffi::Error bad(const char *what) {{ return ffi::Error::InvalidArgument(std::string("alchemist: ") + what); }}

/* positions arrive as int32 when JAX runs without x64 (PyTensor's floatX=float32), else int64 */
const int64_t *positions(ffi::AnyBuffer b, std::vector<int64_t> &tmp) {{
    if (b.element_type() == ffi::DataType::S64) return reinterpret_cast<const int64_t *>(b.untyped_data());
    const int32_t *p = reinterpret_cast<const int32_t *>(b.untyped_data());
    tmp.assign(p, p + b.element_count());
    return tmp.data();
}}

bool integers(ffi::AnyBuffer b) {{ return b.element_type() == ffi::DataType::S64 || b.element_type() == ffi::DataType::S32; }}

ffi::Error Matmul(F32 x, ffi::Buffer<ffi::U8> w, F32Out y, int32_t type_index, int64_t n_out, int64_t n_in) {{
    const auto wd = w.dimensions();
    if (wd.size() != 2 || wd[0] != n_out || x.element_count() % n_in != 0) return bad("QuantizedMatmul: shapes");
    const long long T = (long long)(x.element_count() / n_in);
    if (y->element_count() != (size_t)(T * n_out)) return bad("QuantizedMatmul: output shape");
    const int rc = {matmul}(type_index, 1, addr(w.typed_data()), n_out, n_in, addr(x.typed_data()), T,
                            addr(y->typed_data()));
    return rc == 0 ? ffi::Error::Success() : ffi::Error::Internal("alchemist: QuantizedMatmul kernel failed");
}}

ffi::Error RmsNorm(F32 x, F32 w, F32Out y, float eps, int32_t weighted) {{
    const auto d = x.dimensions();
    if (d.size() < 1) return bad("RmsNormGgml: x has no axis");
    const long long n = d[d.size() - 1];
    if (weighted && (long long)w.element_count() != n) return bad("RmsNormGgml: the weight does not match the rows");
    const long long rows = n ? (long long)(x.element_count() / n) : 0;
    {rms}(addr(x.typed_data()), weighted ? addr(w.typed_data()) : 0, addr(y->typed_data()), rows, n, eps);
    return ffi::Error::Success();
}}

ffi::Error RopeCache(ffi::AnyBuffer pos, F32 ff, F32Out out, int32_t n_dims, float freq_base, float freq_scale,
                     float ext_factor, float attn_factor, float beta_fast, float beta_slow, int32_t n_ctx_orig,
                     int32_t has_ff) {{
    if (!integers(pos)) return bad("RopeCacheGgml: positions must be integers");
    if (has_ff && (long long)ff.element_count() < n_dims / 2)
        return bad("RopeCacheGgml: fewer frequency factors than rotated pairs");
    std::vector<int64_t> tmp;
    const int64_t *p = positions(pos, tmp);
    {ops}_rope_cache(addr(p), (long long)pos.element_count(), has_ff ? addr(ff.typed_data()) : 0, 1, n_dims,
                     freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig,
                     addr(out->typed_data()));
    return ffi::Error::Success();
}}

ffi::Error Rope(F32 x, F32 cache, F32Out y, int32_t n_dims, int32_t neox) {{
    const auto xd = x.dimensions(), cd = cache.dimensions();
    if (xd.size() != 3 || cd.size() != 3 || cd[0] != xd[0] || cd[1] != n_dims / 2 || cd[2] != 2 || xd[2] < n_dims)
        return bad("RopeGgml: x and the cache do not match");
    {ops}_rope(addr(x.typed_data()), addr(cache.typed_data()), addr(y->typed_data()), xd[0], xd[1], xd[2], n_dims,
               neox);
    return ffi::Error::Success();
}}

ffi::Error Attention(F32 q, F32 k, F32 v, ffi::AnyBuffer qpos, ffi::AnyBuffer kpos, F32 sinks, F32Out out,
                     int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window, float scale, float softcap,
                     int32_t has_sinks) {{
    const auto qd = q.dimensions(), kd = k.dimensions();
    if (qd.size() != 3 || kd.size() != 4 || !integers(qpos) || !integers(kpos)) return bad("CausalAttentionGgml: shapes");
    const long long B = kd[0], S = kd[1];
    const long long T = B ? qd[0] / B : 0;
    if (qd[1] != n_head || qd[2] != head_dim || kd[2] != n_kv_head || kd[3] != head_dim ||
        v.element_count() != k.element_count() || B * T != qd[0] || (long long)qpos.element_count() != B * T ||
        (long long)kpos.element_count() != B * S || (has_sinks && (long long)sinks.element_count() != n_head))
        return bad("CausalAttentionGgml: inconsistent shapes");
    std::vector<int64_t> qtmp, ktmp;
    const int64_t *qp = positions(qpos, qtmp), *kp = positions(kpos, ktmp);
    const int rc = {ops}_attention(addr(q.typed_data()), addr(k.typed_data()), addr(v.typed_data()), addr(qp),
                                   addr(kp), has_sinks ? addr(sinks.typed_data()) : 0, addr(out->typed_data()), B, T,
                                   S, n_head, n_kv_head, head_dim, window, scale, softcap);
    return rc == 0 ? ffi::Error::Success() : ffi::Error::Internal("alchemist: CausalAttentionGgml out of memory");
}}

ffi::Error Silu(F32 x, F32Out y) {{
    const auto d = x.dimensions();
    const long long n = d.size() ? d[d.size() - 1] : 1;
    {ops}_silu(addr(x.typed_data()), addr(y->typed_data()), n ? (long long)(x.element_count() / n) : 0, n);
    return ffi::Error::Success();
}}

ffi::Error Gelu(F32 x, F32Out y) {{
    {ops}_gelu(addr(x.typed_data()), addr(y->typed_data()), (long long)x.element_count());
    return ffi::Error::Success();
}}
}}  // namespace

#define ALCHEMIST_FFI(name, fn, binding) XLA_FFI_DEFINE_HANDLER_SYMBOL(name, fn, binding)
ALCHEMIST_FFI(alchemist_ffi_matmul, Matmul, ffi::Ffi::Bind().Arg<F32>().Arg<ffi::Buffer<ffi::U8>>().Ret<F32>()
              .Attr<int32_t>("type_index").Attr<int64_t>("n_out").Attr<int64_t>("n_in"));
ALCHEMIST_FFI(alchemist_ffi_rms_norm, RmsNorm, ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>()
              .Attr<float>("eps").Attr<int32_t>("weighted"));
ALCHEMIST_FFI(alchemist_ffi_rope_cache, RopeCache, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<F32>().Ret<F32>()
              .Attr<int32_t>("n_dims").Attr<float>("freq_base").Attr<float>("freq_scale").Attr<float>("ext_factor")
              .Attr<float>("attn_factor").Attr<float>("beta_fast").Attr<float>("beta_slow")
              .Attr<int32_t>("n_ctx_orig").Attr<int32_t>("has_ff"));
ALCHEMIST_FFI(alchemist_ffi_rope, Rope, ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>()
              .Attr<int32_t>("n_dims").Attr<int32_t>("neox"));
ALCHEMIST_FFI(alchemist_ffi_attention, Attention, ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>()
              .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<F32>().Ret<F32>()
              .Attr<int64_t>("n_head").Attr<int64_t>("n_kv_head").Attr<int64_t>("head_dim").Attr<int64_t>("window")
              .Attr<float>("scale").Attr<float>("softcap").Attr<int32_t>("has_sinks"));
ALCHEMIST_FFI(alchemist_ffi_silu, Silu, ffi::Ffi::Bind().Arg<F32>().Ret<F32>());
ALCHEMIST_FFI(alchemist_ffi_gelu, Gelu, ffi::Ffi::Bind().Arg<F32>().Ret<F32>());
"""


def _wanted() -> bool:
    return os.environ.get("ALCHEMIST_JAX_FFI", "1") != "0"


def available() -> bool:
    """True when JAX runs the ggml Ops as custom calls (the library built and its targets registered)."""
    return _wanted() and _registered()


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


def _build(cxx: str) -> ctypes.CDLL:
    import jax

    from alchemist.kernels import native
    from alchemist.kernels.op import _openmp_flags

    matmul_path, matmul_name, _ = native.matmul_library(cxx)
    ops_path, ops_prefix, _ = native.ops_library(cxx)
    rms_path, rms_name, _ = native.rms_norm_library(cxx)
    source = _HANDLERS.format(matmul=matmul_name, ops=ops_prefix, rms=rms_name)
    dependencies = (matmul_path, ops_path, rms_path)
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


_done: list = []


def register() -> None:
    """Register the Ops' JAX implementations with PyTensor's JAX dispatch (idempotent). Called when a JAX mode
    is made (alchemist.runtime.backends.get_mode); a graph reaches them only where
    kernels.expansion.kernels_compute said so."""
    if _done:
        return
    from alchemist.kernels.attention import CausalAttentionGgml
    from alchemist.kernels.gelu import GeluTable
    from alchemist.kernels.native import TYPE_INDEX
    from alchemist.kernels.op import QuantizedMatmul
    from alchemist.kernels.rms_norm import RmsNormGgml
    from alchemist.kernels.rope import RopeCacheGgml, RopeGgml
    from alchemist.kernels.silu import SiluGgml
    from alchemist.runtime.pytensor_internals import jax_funcify

    i32, i64, f32 = np.int32, np.int64, np.float32

    @jax_funcify.register(QuantizedMatmul)
    def jax_funcify_QuantizedMatmul(op, node=None, **kwargs):
        if op.numerics != "ggml":
            raise NotImplementedError("QuantizedMatmul(numerics='exact') is expanded into XLA ops before JAX")
        attrs = {"type_index": i32(TYPE_INDEX[op.ggml_type]), "n_out": i64(op.n_out), "n_in": i64(op.n_in)}

        def quantized_matmul(x, w):
            op._check(x, w)  # static shapes: checked once, while tracing
            return _call("matmul", (*x.shape[:-1], op.n_out), x, w, **attrs)

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
        attrs = {
            "n_head": i64(op.n_head), "n_kv_head": i64(op.n_kv_head), "head_dim": i64(op.head_dim),
            "window": i64(op.window), "scale": f32(op.scale), "softcap": f32(op.softcap),
        }  # fmt: skip

        def causal_attention_ggml(q, keys, values, q_positions, key_positions, sinks=None):
            shape = (q.shape[0], op.n_head * op.head_dim)
            s = _empty() if sinks is None else sinks
            return _call(
                "attention", shape, q, keys, values, q_positions, key_positions, s,
                has_sinks=i32(sinks is not None), **attrs,
            )  # fmt: skip

        return causal_attention_ggml

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
