// The XLA FFI handlers JAX calls (alchemist.kernels.jax_ffi): each reads XLA's buffers in place and calls one of the
// kernel libraries' entry points, ALCHEMIST_<ENTRY POINT>, which the build defines and declares (extern "C") from
// alchemist.kernels.signatures.
#include <stdint.h>
#include <string>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;


namespace {
typedef ffi::Buffer<ffi::F32> F32;
typedef ffi::ResultBuffer<ffi::F32> F32Out;

uintptr_t addr(const void *p) { return reinterpret_cast<uintptr_t>(p); }

ffi::Error bad(const char *what) { return ffi::Error::InvalidArgument(std::string("alchemist: ") + what); }

/* positions arrive as int32 when JAX runs without x64 (PyTensor's floatX=float32), else int64 */
const int64_t *positions(ffi::AnyBuffer b, std::vector<int64_t> &tmp) {
    if (b.element_type() == ffi::DataType::S64) return reinterpret_cast<const int64_t *>(b.untyped_data());
    const int32_t *p = reinterpret_cast<const int32_t *>(b.untyped_data());
    tmp.assign(p, p + b.element_count());
    return tmp.data();
}

bool integers(ffi::AnyBuffer b) { return b.element_type() == ffi::DataType::S64 || b.element_type() == ffi::DataType::S32; }

ffi::Error Matmul(F32 x, ffi::Buffer<ffi::U8> w, F32Out y, int32_t type_index, int64_t n_out, int64_t n_in) {
    const auto wd = w.dimensions();
    if (wd.size() != 2 || wd[0] != n_out || x.element_count() % n_in != 0) return bad("QuantizedMatmul: shapes");
    const long long T = (long long)(x.element_count() / n_in);
    if (y->element_count() != (size_t)(T * n_out)) return bad("QuantizedMatmul: output shape");
    const int rc = ALCHEMIST_MATMUL(type_index, 1, addr(w.typed_data()), n_out, n_in, addr(x.typed_data()), T,
                            addr(y->typed_data()));
    return rc == 0 ? ffi::Error::Success() : ffi::Error::Internal("alchemist: QuantizedMatmul kernel failed");
}

ffi::Error RmsNorm(F32 x, F32 w, F32Out y, float eps, int32_t weighted) {
    const auto d = x.dimensions();
    if (d.size() < 1) return bad("RmsNormGgml: x has no axis");
    const long long n = d[d.size() - 1];
    if (weighted && (long long)w.element_count() != n) return bad("RmsNormGgml: the weight does not match the rows");
    const long long rows = n ? (long long)(x.element_count() / n) : 0;
    ALCHEMIST_RMS_NORM(addr(x.typed_data()), weighted ? addr(w.typed_data()) : 0, addr(y->typed_data()), rows, n, eps);
    return ffi::Error::Success();
}

ffi::Error RopeCache(ffi::AnyBuffer pos, F32 ff, F32Out out, int32_t n_dims, float freq_base, float freq_scale,
                     float ext_factor, float attn_factor, float beta_fast, float beta_slow, int32_t n_ctx_orig,
                     int32_t has_ff) {
    if (!integers(pos)) return bad("RopeCacheGgml: positions must be integers");
    if (has_ff && (long long)ff.element_count() < n_dims / 2)
        return bad("RopeCacheGgml: fewer frequency factors than rotated pairs");
    std::vector<int64_t> tmp;
    const int64_t *p = positions(pos, tmp);
    ALCHEMIST_ROPE_CACHE(addr(p), (long long)pos.element_count(), has_ff ? addr(ff.typed_data()) : 0, 1, n_dims,
                     freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig,
                     addr(out->typed_data()));
    return ffi::Error::Success();
}

ffi::Error Rope(F32 x, F32 cache, F32Out y, int32_t n_dims, int32_t neox) {
    const auto xd = x.dimensions(), cd = cache.dimensions();
    if (xd.size() != 3 || cd.size() != 3 || cd[0] != xd[0] || cd[1] != n_dims / 2 || cd[2] != 2 || xd[2] < n_dims)
        return bad("RopeGgml: x and the cache do not match");
    ALCHEMIST_ROPE(addr(x.typed_data()), addr(cache.typed_data()), addr(y->typed_data()), xd[0], xd[1], xd[2], n_dims,
               neox);
    return ffi::Error::Success();
}

ffi::Error Attention(F32 q, F32 k, F32 v, ffi::AnyBuffer qpos, ffi::AnyBuffer kpos, F32 sinks, F32Out out,
                     int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window, float scale, float softcap,
                     int32_t has_sinks) {
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
    const int rc = ALCHEMIST_ATTENTION(addr(q.typed_data()), addr(k.typed_data()), addr(v.typed_data()), addr(qp),
                                   addr(kp), has_sinks ? addr(sinks.typed_data()) : 0, addr(out->typed_data()), B, T,
                                   S, n_head, n_kv_head, head_dim, window, scale, softcap);
    return rc == 0 ? ffi::Error::Success() : ffi::Error::Internal("alchemist: CausalAttentionGgml out of memory");
}

ffi::Error Silu(F32 x, F32Out y) {
    const auto d = x.dimensions();
    const long long n = d.size() ? d[d.size() - 1] : 1;
    ALCHEMIST_SILU(addr(x.typed_data()), addr(y->typed_data()), n ? (long long)(x.element_count() / n) : 0, n);
    return ffi::Error::Success();
}

ffi::Error Gelu(F32 x, F32Out y) {
    ALCHEMIST_GELU(addr(x.typed_data()), addr(y->typed_data()), (long long)x.element_count());
    return ffi::Error::Success();
}
}  // namespace

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
