"""`CausalAttentionGgml`: a generated module's causal_attention() as llama.cpp's CPU backend computes it, bit for bit.

llama.cpp without flash attention and with an F32 KV cache (build_attn_mha) computes, per query head h of
KV head h // GROUP_SIZE, with its cache cells 0.. in position order (one fresh sequence):

    kq   = ggml_mul_mat(k, q)           every score by ggml_vec_dot_f32 (llamafile_sgemm refuses: q is a
                                        permuted view when T > 1, and sgemm only takes T >= 2)
    kq   = softcap · tanhf(kq · (1/softcap))     gemma2's logit softcap, three ops (ggml_scale, ggml_tanh)
    p    = ggml_soft_max_ext(kq, mask, kq_scale)  ops.cpp soft_max_f32: kq · scale + mask; max; in chunks of
                                        8 cells exp by ggml_v_expf (vec.h, AVX2 polynomial) and a float32
                                        8-lane sum added to a double; then every p times (float)(1.0 / sum);
                                        attention sinks add expf(sink - max) to the sum
    kqv  = ggml_mul_mat(v^T, p)         T >= 2: llamafile_sgemm (tinyBLAS<8, __m256>): one 8-lane fma
                                        accumulator per output over the cells, lane = cell % 8;
                                        T == 1: ggml_vec_dot_f32 over the cells

ggml_vec_dot_f32 (AVX2, GGML_F32_STEP 32): four 8-lane fma accumulators, element i in accumulator (i / 8) % 4,
reduced (a0 + a2) + (a1 + a3), then the two 128-bit halves added and two hadds; elements past the last multiple
of 32 as libggml-cpu.so's compiled tail takes them (blocks of 8 and 4: products, then added one by one; the
last 1..3 by fma). The 8-lane sums of tinyBLAS and of the softmax: halves added, then (t0 + t2) + (t1 + t3).

Cells beyond the sequence (llama.cpp pads its KV view to 256 cells) and masked cells have probability exactly 0
and add exactly nothing, so the lanes of cell s = cache row s are all that matter: the Op computes visible
keys only. The library was compiled for AVX2 + FMA (this machine; `objdump -d libggml-cpu.so`); a build for
AVX-512 would take other lanes. The C code writes every fma as fmaf() and is compiled with -ffp-contract=off.

C runs the loops (OpenMP over query rows), and Numba calls the same C code (kernels.numba_ops); `perform` and
the tests use the numpy transcription `attention_ggml_reference`; JAX and MLX call the C code too (kernels.jax_ffi,
mlx_host). Without it they get the generated module's float32 formula as PyTensor ops
(`expand_causal_attention_ggml`, tagged "jax" and "mlx"; on Numba when the ops library cannot be built), which
equals this up to rounding.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.link.c.op import COp

from alchemist.kernels.expansion import register_expansion
from alchemist.kernels.native import register_numba_expansion
from alchemist.kernels.sources import source

ATTENTION_C = source("attention.cpp")  # with csrc/v_expf.h, ggml's vectorized expf, shared with SiLU


# -- numpy transcription (perform, and the tests' reference) -------------------------------------------------
def _fma32(a, b, c):
    """float32 fma(a, b, c), correctly rounded: a·b is exact in float64; the float64 sum is rounded to odd
    (Boldo & Melquiond), so the final rounding to float32 is the single rounding of the exact result."""
    a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
    p = a * b
    with np.errstate(invalid="ignore"):  # infinities: s is already the answer, err NaN changes nothing
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _libm_f32(name: str):
    """libm's float function `name` (tanhf, expf: the very function the C code and ggml call), else numpy's."""
    from alchemist import libm

    try:
        fn = libm.f32(name)
    except (OSError, AttributeError):
        return {"tanhf": np.tanh, "expf": np.exp}[name]
    return lambda x: np.float32(fn(float(np.float32(x))))


def _h(hex_literal: str):
    """A C hexadecimal float literal as float32 (exact: each has at most 24 significant bits)."""
    return np.float32(float.fromhex(hex_literal))


def v_expf_reference(x):
    """ggml_v_expf lane by lane (numpy float32 arrays)."""
    x = np.asarray(x, np.float32)
    r = _h("0x1.8p23")
    z = _fma32(x, _h("0x1.715476p0"), r)
    n = (z - r).astype(np.float32)
    b = _fma32(-n, _h("0x1.7f7d1cp-20"), _fma32(-n, _h("0x1.62e4p-1"), x))
    e = (z.view(np.uint32) << np.uint32(23)).astype(np.uint32)
    k = (e + np.float32(1).view(np.uint32)).astype(np.uint32).view(np.float32)
    u = (b * b).astype(np.float32)
    inner = _fma32(
        _fma32(_h("0x1.0e4020p-7"), b, _h("0x1.573e2ep-5")), u, _fma32(_h("0x1.555e66p-3"), b, _h("0x1.fffdb6p-2"))
    )
    j = _fma32(inner, u, (_h("0x1.ffffecp-1") * b).astype(np.float32))
    g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0)).astype(np.uint32)
    s1 = (g + np.uint32(0x7F000000)).astype(np.uint32).view(np.float32)
    s2 = (e - g).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        big = (s1 * s1).astype(np.float32)
        mid = (_fma32(s2, j, s2) * s1).astype(np.float32)
    out = np.where(np.abs(n) > 192, big, mid)
    return np.where(np.abs(n) > 126, out, _fma32(j, k, k)).astype(np.float32)


def _hsum8(v):
    v = np.asarray(v, np.float32)
    t = [np.float32(v[4 + i] + v[i]) for i in range(4)]
    return np.float32(np.float32(t[0] + t[2]) + np.float32(t[1] + t[3]))


def _reduce32(a):
    a = np.asarray(a, np.float32)
    r = ((a[0:8] + a[16:24]).astype(np.float32) + (a[8:16] + a[24:32]).astype(np.float32)).astype(np.float32)
    t = (r[0:4] + r[4:8]).astype(np.float32)
    return np.float32(np.float32(t[0] + t[1]) + np.float32(t[2] + t[3]))


def vec_dot_reference(x, y):
    """ggml_vec_dot_f32 as libggml-cpu.so (AVX2 + FMA) computes it."""
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    n = x.size
    np_ = n & ~31
    acc = np.zeros(32, np.float32)
    for i in range(0, np_, 32):
        acc = _fma32(x[i : i + 32], y[i : i + 32], acc)
    s = _reduce32(acc)
    i = np_
    while n - i >= 8:
        for p in (x[i : i + 8] * y[i : i + 8]).astype(np.float32):
            s = np.float32(s + p)
        i += 8
    if n - i >= 4:
        for p in (x[i : i + 4] * y[i : i + 4]).astype(np.float32):
            s = np.float32(s + p)
        i += 4
    for j in range(i, n):
        s = _fma32(x[j], y[j], s)
    return np.float32(s)


def attention_ggml_reference(q, keys, values, q_positions, key_positions, window=0, scale=1.0, softcap=0.0, sinks=None):
    """CausalAttentionGgml in numpy (slow; small shapes): q (B*T, H, D), keys/values (B, S, KVH, D), positions
    (B, T) and (B, S) -> (B*T, H*D)."""
    q, keys, values = (np.asarray(a, np.float32) for a in (q, keys, values))
    qpos, kpos = np.asarray(q_positions, np.int64), np.asarray(key_positions, np.int64)
    n_seq, n_keys, n_kv_head, dim = keys.shape
    n_tok, n_head = q.shape[0] // n_seq, q.shape[1]
    group = n_head // n_kv_head
    sgemm = n_tok >= 2 and dim % 4 == 0
    lanes = 8 if sgemm else 32
    s8 = -(-n_keys // 8) * 8
    scale, softcap = np.float32(scale), np.float32(softcap)
    tanhf, expf = _libm_f32("tanhf"), _libm_f32("expf")
    out = np.zeros((n_seq * n_tok, n_head, dim), np.float32)
    for b in range(n_seq):
        for t in range(n_tok):
            qp = qpos[b, t]
            vis = (kpos[b] >= 0) & (kpos[b] <= qp)
            if window:
                vis &= qp - kpos[b] < window
            for h in range(n_head):
                kh = h // group
                w = np.full(s8, -np.inf, np.float32)
                for s in np.flatnonzero(vis):
                    x = np.float32(vec_dot_reference(keys[b, s, kh], q[b * n_tok + t, h]) * scale)
                    if softcap > 0:
                        x = np.float32(tanhf(np.float32(x * np.float32(np.float32(1) / softcap))) * softcap)
                    w[s] = x
                mx = w.max()
                if sinks is not None:
                    mx = max(mx, np.float32(sinks[h]))
                if mx == -np.inf:
                    continue
                with np.errstate(invalid="ignore"):
                    e = np.where(w == -np.inf, np.float32(0), v_expf_reference((w - mx).astype(np.float32)))
                total = 0.0
                for c in range(0, s8, 8):
                    total += float(_hsum8(e[c : c + 8]))
                if sinks is not None:
                    total += float(expf(np.float32(np.float32(sinks[h]) - mx)))
                p = (e * np.float32(1.0 / total)).astype(np.float32)
                acc = np.zeros((lanes, dim), np.float32)
                for s in np.flatnonzero(vis):
                    acc[s % lanes] = _fma32(values[b, s, kh], p[s], acc[s % lanes])
                red = _hsum8 if sgemm else _reduce32
                out[b * n_tok + t, h] = [red(acc[:, d]) for d in range(dim)]
    return out.reshape(n_seq * n_tok, n_head * dim)


_GLUE_VERSION = 3  # bump when c_code (the Python-side glue) changes; the kernel source is hashed


# -- the Ops ------------------------------------------------------------------------------------------------
class _AttentionGgml(COp):
    """What the two ggml attention Ops share: their parameters, the input checks of make_node, the C source and
    its build flags, the C glue (_glue). Each Op below is its own class (not one a subclass of the other), so a
    backend's per-Op registry (Numba's, JAX's and MLX's funcify) never takes one for the other."""

    __props__ = ("n_head", "n_kv_head", "head_dim", "window", "scale", "softcap", "has_sinks")

    def __init__(self, n_head, n_kv_head, head_dim, window=0, scale=1.0, softcap=0.0, has_sinks=False):
        self.n_head, self.n_kv_head, self.head_dim = int(n_head), int(n_kv_head), int(head_dim)
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{type(self).__name__}: {n_head} query heads do not share {n_kv_head} KV heads evenly")
        self.window = int(window or 0)
        self.scale = float(np.float32(scale))
        self.softcap = float(np.float32(softcap or 0.0))
        self.has_sinks = bool(has_sinks)

    def _checked_inputs(self, q, keys, values, q_positions, key_positions, *sinks) -> list:
        """[q, keys, values, q_positions, key_positions(, sinks)] as the C code takes them, or a TypeError."""
        q, keys, values = (pt.as_tensor_variable(x) for x in (q, keys, values))
        q_positions, key_positions = pt.as_tensor_variable(q_positions), pt.as_tensor_variable(key_positions)
        for name, x, nd in (("q", q, 3), ("keys", keys, 4), ("values", values, 4)):
            if x.type.dtype != "float32" or x.type.ndim != nd:
                raise TypeError(f"{type(self).__name__}: {name} must be a {nd}-d float32 tensor, got {x.type}")
        q_positions, key_positions = pt.cast(q_positions, "int64"), pt.cast(key_positions, "int64")
        inputs = [q, keys, values, q_positions, key_positions]
        if self.has_sinks != bool(sinks):
            raise TypeError(f"{type(self).__name__}(has_sinks={self.has_sinks}) called with {len(sinks)} sinks inputs")
        if sinks:
            inputs.append(pt.cast(pt.as_tensor_variable(sinks[0]), "float32"))
        return inputs

    def _output(self, q):
        return pt.tensor(dtype="float32", shape=(q.type.shape[0], self.n_head * self.head_dim))

    def infer_shape(self, node, shapes):
        return [(shapes[0][0], self.n_head * self.head_dim)]

    def _reference(self, q, keys, values, qpos, kpos, sinks):
        return attention_ggml_reference(
            q, keys, values, qpos, kpos, self.window, self.scale, self.softcap, sinks[0] if sinks else None
        )

    def c_support_code(self, **kwargs):
        return ATTENTION_C

    def c_compile_args(self, **kwargs):
        from alchemist.kernels.op import _openmp_flags

        return [*_openmp_flags(), "-O3", "-ffp-contract=off"]

    def c_libraries(self, **kwargs):
        from alchemist.kernels.op import _openmp_flags

        return ["gomp"] if _openmp_flags() else []

    def _glue(self, name, q, k, v, qp, kp, slots, sk, out, fail):
        """The C that checks the inputs' shapes and calls attend() (attend_slots() with a slots vector: k and v
        are then the slot caches)."""
        held = ("qc", "kc", "vc", "qpc", "kpc", "slc", "skc")
        conts = ", ".join(f"*{n}_ = NULL" for n in held)
        sinks = f"skc_ = PyArray_GETCONTIGUOUS({sk[0]}); if (!skc_) goto {name}_done;" if sk else ""
        sinks_ptr = "(const float *)PyArray_DATA(skc_)" if sk else "NULL"
        if slots is None:  # k, v (B, S, KVH, D)
            get_slots, kv_dims, call = "", "B_ = PyArray_DIM(kc_, 0), S_ = PyArray_DIM(kc_, 1)", "attend"
            kv_shapes = "PyArray_DIM(vc_, 0) != B_ || PyArray_DIM(vc_, 1) != S_ || PyArray_SIZE(kpc_) != B_ * S_"
            slot_args, bad_slot = "", ""
        else:  # the caches (SLOTS, ROWS, KVH, D); sequence b's S keys in the first S rows of slot slots[b]
            get_slots = f"slc_ = PyArray_GETCONTIGUOUS({slots}); if (!slc_) goto {name}_done;"
            kv_dims = (
                "B_ = PyArray_SIZE(slc_), SLOTS_ = PyArray_DIM(kc_, 0), ROWS_ = PyArray_DIM(kc_, 1),\n"
                "                    S_ = PyArray_NDIM(kpc_) == 2 ? PyArray_DIM(kpc_, 1) : -1"
            )
            kv_shapes = (
                "PyArray_DIM(vc_, 0) != SLOTS_ || PyArray_DIM(vc_, 1) != ROWS_ || S_ < 0 || S_ > ROWS_\n"
                "                    || PyArray_DIM(kpc_, 0) != B_"
            )
            call, slot_args = "attend_slots", ", (const int64_t *)PyArray_DATA(slc_), ROWS_"
            bad_slot = (
                "const int64_t *slot_ = (const int64_t *)PyArray_DATA(slc_);\n"
                "                for (long long b_ = 0; !bad_ && b_ < B_; ++b_) bad_ = slot_[b_] < 0 || slot_[b_] >= SLOTS_;"
            )
        what = type(self).__name__ + (
            ": inconsistent shapes" if slots is None else ": inconsistent shapes, or a slot outside the cache"
        )
        return f"""
        {{
            PyArrayObject {conts};
            int ok_ = 0;
            qc_ = PyArray_GETCONTIGUOUS({q}); kc_ = PyArray_GETCONTIGUOUS({k}); vc_ = PyArray_GETCONTIGUOUS({v});
            qpc_ = PyArray_GETCONTIGUOUS({qp}); kpc_ = PyArray_GETCONTIGUOUS({kp});
            if (!qc_ || !kc_ || !vc_ || !qpc_ || !kpc_) goto {name}_done;
            {get_slots}
            {sinks}
            {{
                const long long {kv_dims};
                const long long KVH_ = PyArray_DIM(kc_, 2), D_ = PyArray_DIM(kc_, 3), H_ = PyArray_DIM(qc_, 1);
                const long long T_ = B_ ? PyArray_DIM(qc_, 0) / B_ : 0;
                int bad_ = H_ != {self.n_head} || KVH_ != {self.n_kv_head} || D_ != {self.head_dim} || PyArray_DIM(qc_, 2) != D_
                    || B_ * T_ != PyArray_DIM(qc_, 0) || PyArray_NDIM(vc_) != 4 || PyArray_DIM(vc_, 2) != KVH_
                    || PyArray_DIM(vc_, 3) != D_ || PyArray_SIZE(qpc_) != B_ * T_ || {kv_shapes};
                {bad_slot}
                if (bad_) {{
                    PyErr_SetString(PyExc_ValueError, "{what}");
                    goto {name}_done;
                }}
                npy_intp dims_[2] = {{(npy_intp)(B_ * T_), (npy_intp)(H_ * D_)}};
                if (!{out} || PyArray_NDIM({out}) != 2 || PyArray_DIM({out}, 0) != dims_[0] || PyArray_DIM({out}, 1) != dims_[1]
                    || !PyArray_IS_C_CONTIGUOUS({out}) || PyArray_TYPE({out}) != NPY_FLOAT32) {{
                    Py_XDECREF({out});
                    {out} = (PyArrayObject *)PyArray_EMPTY(2, dims_, NPY_FLOAT32, 0);
                    if (!{out}) goto {name}_done;
                }}
                if (alchemist_attn::{call}((const float *)PyArray_DATA(qc_), (const float *)PyArray_DATA(kc_),
                    (const float *)PyArray_DATA(vc_), (const int64_t *)PyArray_DATA(qpc_), (const int64_t *)PyArray_DATA(kpc_),
                    {sinks_ptr}, (float *)PyArray_DATA({out}), B_, T_, S_, H_, KVH_, D_, {self.window}LL,
                    (float){self.scale!r}, (float){self.softcap!r}{slot_args}) != 0) {{
                    PyErr_NoMemory();
                    goto {name}_done;
                }}
                ok_ = 1;
            }}
            {name}_done:
            {" ".join(f"Py_XDECREF({n}_);" for n in held)}
            if (!ok_) {{ {fail} }}
        }}
        """

    def c_code_cache_version(self):
        return (_GLUE_VERSION, int(hashlib.sha256(ATTENTION_C.encode()).hexdigest()[:12], 16))


class CausalAttentionGgml(_AttentionGgml):
    """causal_attention(q, keys, values, q_positions, key_positions[, sinks]) as ggml computes it (module
    docstring). q (B*T, N_HEAD, HEAD_DIM), keys/values (B, S, N_KV_HEAD, HEAD_DIM) float32, positions int64
    (B, T) and (B, S), sinks (N_HEAD,) float32 when has_sinks -> (B*T, N_HEAD*HEAD_DIM) float32.
    scale multiplies q·k (1.0 where the queries are pre-scaled), then the softcap (0: none) applies."""

    computes_ggml_kernel = True  # kernels.expansion: JAX and MLX call its C code where they can

    def make_node(self, q, keys, values, q_positions, key_positions, *sinks):
        inputs = self._checked_inputs(q, keys, values, q_positions, key_positions, *sinks)
        return Apply(self, inputs, [self._output(inputs[0])])

    def perform(self, node, inputs, output_storage):
        q, keys, values, qpos, kpos, *sinks = inputs
        output_storage[0][0] = self._reference(q, keys, values, qpos, kpos, sinks)

    def c_code(self, node, name, inputs, outputs, sub):
        q, k, v, qp, kp, *sk = inputs
        return self._glue(name, q, k, v, qp, kp, None, sk, outputs[0], sub["fail"])


class SlotAttentionGgml(_AttentionGgml):
    """CausalAttentionGgml reading each sequence's keys and values in place in a slot cache: (q, k_cache, v_cache,
    q_positions, key_positions, slots[, sinks]), caches (SLOTS, ROWS, N_KV_HEAD, HEAD_DIM), sequence b's S keys
    (S = key_positions' width) in the first S rows of slot slots[b]. The same arithmetic on the same values as
    CausalAttentionGgml(q, k_cache[:, :S][slots], ...), without gathering the rows (alchemist.runtime.slot_engine
    lowers that gather to this on C, the only backend it is made for: no other backend converts it)."""

    def make_node(self, q, k_cache, v_cache, q_positions, key_positions, slots, *sinks):
        inputs = self._checked_inputs(q, k_cache, v_cache, q_positions, key_positions, *sinks)
        slots = pt.as_tensor_variable(slots)
        if slots.type.ndim != 1 or not slots.type.dtype.startswith(("int", "uint")):
            raise TypeError(f"SlotAttentionGgml: slots must be a vector of integers, got {slots.type}")
        inputs = inputs[:5] + [pt.cast(slots, "int64")] + inputs[5:]
        return Apply(self, inputs, [self._output(inputs[0])])

    def perform(self, node, inputs, output_storage):
        q, k_cache, v_cache, qpos, kpos, slots, *sinks = inputs
        n_keys = kpos.shape[1]
        if n_keys > k_cache.shape[1] or np.any((slots < 0) | (slots >= k_cache.shape[0])):
            raise ValueError("SlotAttentionGgml: a slot or key row outside the cache")
        keys, values = k_cache[slots, :n_keys], v_cache[slots, :n_keys]
        output_storage[0][0] = self._reference(q, keys, values, qpos, kpos, sinks)

    def c_code(self, node, name, inputs, outputs, sub):
        q, k, v, qp, kp, slots, *sk = inputs
        return self._glue(name, q, k, v, qp, kp, slots, sk, outputs[0], sub["fail"])


# -- the formula (other backends) and the module hook ---------------------------------------------------------
def causal_attention_formula(
    q,
    keys,
    values,
    q_positions,
    key_positions,
    n_head,
    n_kv_head,
    head_dim,
    window=0,
    scale=1.0,
    softcap=0.0,
    sinks=None,
):
    """The generated causal_attention() (templates/components/causal_attention.j2) as float32 PyTensor ops."""
    group = n_head // n_kv_head
    n_seq = keys.type.shape[0] if keys.type.shape[0] is not None else keys.shape[0]
    n_tokens = q.shape[0] // n_seq
    q = q.reshape((n_seq, n_tokens, n_kv_head, group, head_dim)).dimshuffle(0, 2, 3, 1, 4)
    q = q.reshape((n_seq * n_kv_head, group * n_tokens, head_dim))
    keys = keys.dimshuffle(0, 2, 3, 1).reshape((n_seq * n_kv_head, head_dim, -1))
    scores = pt.matmul(q, keys)
    if scale != 1.0:
        scores = scores * np.float32(scale)
    if softcap:
        scores = np.float32(softcap) * pt.tanh(scores / np.float32(softcap))
    key_pos = key_positions[:, None, :]
    query_pos = pt.tile(q_positions, (1, group))[:, :, None]
    visible = (key_pos >= 0) & (key_pos <= query_pos)
    if window:
        visible = visible & (query_pos - key_pos < window)
    scores = scores.reshape((n_seq, n_kv_head, group * n_tokens, -1))
    scores = pt.where(visible[:, None, :, :], scores, np.float32(-np.inf))
    if sinks is not None:
        sink = pt.repeat(sinks.reshape((n_kv_head, group)), n_tokens, axis=1)
        sink = pt.broadcast_to(sink[None, :, :, None], (n_seq, n_kv_head, group * n_tokens, 1))
        probs = pt.special.softmax(pt.concatenate([scores, sink], axis=-1), axis=-1)[:, :, :, :-1]
    else:
        probs = pt.special.softmax(scores, axis=-1)
    probs = probs.reshape((n_seq * n_kv_head, group * n_tokens, -1))
    values = values.dimshuffle(0, 2, 1, 3).reshape((n_seq * n_kv_head, -1, head_dim))
    out = pt.matmul(probs, values)
    out = out.reshape((n_seq, n_kv_head, group, n_tokens, head_dim)).dimshuffle(0, 3, 1, 2, 4)
    return out.reshape((n_seq * n_tokens, n_head * head_dim))


def attention_variant(module) -> dict | None:
    """How a generated module's causal_attention scales and caps its scores: {"scale", "softcap", "has_sinks"},
    read from the constants the function reads (the template's variants), or None when it is not one the Op knows."""
    import inspect

    fn = getattr(module, "causal_attention", None)
    if fn is None:
        return None
    signature = inspect.signature(fn).parameters
    params = list(signature)
    if params[:6] != ["q", "keys", "values", "q_positions", "key_positions", "window"] or params[6:] not in (
        [],
        ["sinks"],
    ):
        return None
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in signature.values()):
        return None  # not the template's function (e.g. this module's own replacement)
    names = fn.__code__.co_names  # the globals it reads: no source file needed (the auditor's isolated import)
    scaled = "SCORE_SCALE" in names
    capped = "ATTN_LOGIT_SOFTCAP" in names
    return {
        "scale": float(module.SCORE_SCALE) if scaled else 1.0,
        "softcap": float(module.ATTN_LOGIT_SOFTCAP) if capped else 0.0,
        "has_sinks": params[6:] == ["sinks"],
    }


def ggml_causal_attention(module):
    """A replacement for `module`'s causal_attention computing as ggml does (the Op), or None when the module's
    attention is not one of the template's variants the Op reproduces."""
    variant = attention_variant(module)
    if variant is None:
        return None
    per_layer = isinstance(module.HEAD_DIM, tuple)  # sizes that differ by layer: the layer's, from q and keys
    sizes = None if per_layer else (int(module.N_HEAD), int(module.N_KV_HEAD), int(module.HEAD_DIM))

    def causal_attention(q, keys, values, q_positions, key_positions, window, *sinks):
        n_head, n_kv_head, head_dim = sizes or (q.type.shape[1], keys.type.shape[2], q.type.shape[2])
        op = CausalAttentionGgml(n_head, n_kv_head, head_dim, window, **variant)
        return op(q, keys, values, q_positions, key_positions, *sinks)

    return causal_attention


@node_rewriter([CausalAttentionGgml])
def expand_causal_attention_ggml(fgraph, node):
    op = node.op
    q, keys, values, qpos, kpos, *sinks = node.inputs
    out = causal_attention_formula(
        q,
        keys,
        values,
        qpos,
        kpos,
        op.n_head,
        op.n_kv_head,
        op.head_dim,
        op.window,
        op.scale,
        op.softcap,
        sinks[0] if sinks else None,
    )
    return [pt.specify_shape(out, node.outputs[0].type.shape) if None not in node.outputs[0].type.shape else out]


register_expansion("alchemist_expand_causal_attention_ggml", expand_causal_attention_ggml, backends=("jax", "mlx"))
# on Numba only without the ops library (otherwise Numba calls the C code: kernels.numba_ops)
register_numba_expansion("alchemist_expand_causal_attention_ggml_numba", expand_causal_attention_ggml)
