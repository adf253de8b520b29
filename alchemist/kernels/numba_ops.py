"""Numba calls the C code of ggml's RoPE, causal attention, SiLU and GELU (the ops library, kernels.native).

With numerics="ggml" a generated module computes RoPE (RopeCacheGgml, RopeGgml), attention (CausalAttentionGgml),
SiLU (SiluGgml) and GELU (GeluTable, a lookup in ggml's fp16 table) as llama.cpp does; on C each is a loop in C
with every fma written out. Numba gets the same C code from the ops library, so its logits are the C backend's bit
for bit. Each wrapper checks the shapes the C code relies on, makes its inputs contiguous, allocates the output
and passes pointers.

Without the library (no C++ compiler, ALCHEMIST_NUMBA_NATIVE=0) the rewrite registered with
`native.register_numba_expansion` has already replaced these Ops by their float32 formulas, so a wrapper is only
asked for when the library is there (the graph cache keys Numba graphs by whether it is).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

_registered: list = []
# PyTensor caches each compiled wrapper under the Op's props and an integer: this file's source and the library's
_SOURCE_VERSION = int(hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12], 16)


def _library():
    """(entry points, cache version) of the ops library."""
    from alchemist.kernels.native import ops_kernels

    built = ops_kernels()
    if built is None:  # the expansion rewrite runs first without the library: a graph built some other way
        raise NotImplementedError("Numba has no implementation of this op without alchemist's ops library")
    kernels, digest = built
    return kernels, _SOURCE_VERSION ^ digest


def register_numba() -> None:
    """Register the Ops' Numba implementations (called from kernels.register_numba; idempotent)."""
    if _registered:
        return
    from alchemist.kernels.attention import CausalAttentionGgml
    from alchemist.kernels.gelu import GeluTable
    from alchemist.kernels.rope import RopeCacheGgml, RopeGgml
    from alchemist.kernels.silu import SiluGgml
    from alchemist.pytensor_ext.pytensor_internals import numba_njit, register_funcify_default_op_cache_key

    @register_funcify_default_op_cache_key(RopeCacheGgml)
    def numba_funcify_RopeCacheGgml(op, node=None, **kwargs):
        kernels, version = _library()
        cache_fn, n_dims, n_pairs, n_ctx_orig = kernels["rope_cache"], op.n_dims, op.n_dims // 2, op.n_ctx_orig
        base, scale, ext, attn = (np.float32(v) for v in (op.freq_base, op.freq_scale, op.ext_factor, op.attn_factor))
        beta_fast, beta_slow = np.float32(op.beta_fast), np.float32(op.beta_slow)

        @numba_njit
        def rope_cache(positions, ff, ff_address, ff_stride):
            pc = np.ascontiguousarray(positions)
            out = np.empty((pc.shape[0], n_pairs, 2), dtype=np.float32)
            cache_fn(pc.ctypes.data, pc.shape[0], ff_address, ff_stride, n_dims, base, scale, ext, attn, beta_fast,
                     beta_slow, n_ctx_orig, out.ctypes.data)  # fmt: skip
            return out

        if len(node.inputs) == 1:

            @numba_njit
            def rope_cache_ggml(positions):
                return rope_cache(positions, None, 0, 1)

        else:

            @numba_njit
            def rope_cache_ggml(positions, freq_factors):
                if freq_factors.shape[0] < n_pairs:
                    raise ValueError("RopeCacheGgml: fewer frequency factors than rotated pairs")
                ff = np.ascontiguousarray(freq_factors)
                return rope_cache(positions, ff, ff.ctypes.data, 1)

        return rope_cache_ggml, version

    @register_funcify_default_op_cache_key(RopeGgml)
    def numba_funcify_RopeGgml(op, node=None, **kwargs):
        kernels, version = _library()
        rotate, n_dims, n_pairs, neox = kernels["rope"], op.n_dims, op.n_dims // 2, int(op.style == "neox")

        @numba_njit
        def rope_ggml(x, cache):
            xc, cc = np.ascontiguousarray(x), np.ascontiguousarray(cache)
            if cc.shape[0] != xc.shape[0] or cc.shape[1] != n_pairs or cc.shape[2] != 2 or xc.shape[2] < n_dims:
                raise ValueError("RopeGgml: x and the cache do not match")
            y = np.empty(xc.shape, dtype=np.float32)
            rotate(xc.ctypes.data, cc.ctypes.data, y.ctypes.data, xc.shape[0], xc.shape[1], xc.shape[2], n_dims, neox)
            return y

        return rope_ggml, version

    @register_funcify_default_op_cache_key(CausalAttentionGgml)
    def numba_funcify_CausalAttentionGgml(op, node=None, **kwargs):
        kernels, version = _library()
        attend, n_head, n_kv_head, head_dim = kernels["attention"], op.n_head, op.n_kv_head, op.head_dim
        window, scale, softcap = op.window, np.float32(op.scale), np.float32(op.softcap)

        @numba_njit
        def attention(q, keys, values, q_positions, key_positions, sinks, sinks_address):
            qc, kc, vc = np.ascontiguousarray(q), np.ascontiguousarray(keys), np.ascontiguousarray(values)
            qp, kp = np.ascontiguousarray(q_positions), np.ascontiguousarray(key_positions)
            B, S = kc.shape[0], kc.shape[1]
            T = qc.shape[0] // B if B else 0
            if (
                qc.shape[1] != n_head
                or qc.shape[2] != head_dim
                or kc.shape[2] != n_kv_head
                or kc.shape[3] != head_dim
                or vc.shape != kc.shape
                or B * T != qc.shape[0]
                or qp.size != B * T
                or kp.size != B * S
            ):
                raise ValueError("CausalAttentionGgml: inconsistent shapes")  # fmt: skip
            out = np.empty((B * T, n_head * head_dim), dtype=np.float32)
            status = attend(qc.ctypes.data, kc.ctypes.data, vc.ctypes.data, qp.ctypes.data, kp.ctypes.data,
                            sinks_address, out.ctypes.data, B, T, S, n_head, n_kv_head, head_dim, window, scale,
                            softcap)  # fmt: skip
            if status != 0:
                raise MemoryError("CausalAttentionGgml: the C code could not allocate its work buffers")
            return out

        if len(node.inputs) == 5:

            @numba_njit
            def causal_attention_ggml(q, keys, values, q_positions, key_positions):
                return attention(q, keys, values, q_positions, key_positions, None, 0)

        else:

            @numba_njit
            def causal_attention_ggml(q, keys, values, q_positions, key_positions, sinks):
                if sinks.shape[0] != n_head:
                    raise ValueError("CausalAttentionGgml: one sink per query head expected")
                sc = np.ascontiguousarray(sinks)
                return attention(q, keys, values, q_positions, key_positions, sc, sc.ctypes.data)

        return causal_attention_ggml, version

    @register_funcify_default_op_cache_key(SiluGgml)
    def numba_funcify_SiluGgml(op, node=None, **kwargs):
        kernels, version = _library()
        silu = kernels["silu"]

        @numba_njit
        def silu_ggml(x):
            xc = np.ascontiguousarray(x)
            y = np.empty(xc.shape, dtype=np.float32)
            n = xc.shape[-1]
            silu(xc.ctypes.data, y.ctypes.data, xc.size // n if n else 0, n)
            return y

        return silu_ggml, version

    @register_funcify_default_op_cache_key(GeluTable)
    def numba_funcify_GeluTable(op, node=None, **kwargs):
        kernels, version = _library()
        gelu = kernels["gelu"]

        @numba_njit
        def gelu_table(x):
            xc = np.ascontiguousarray(x)
            y = np.empty(xc.shape, dtype=np.float32)
            gelu(xc.ctypes.data, y.ctypes.data, xc.size)
            return y

        return gelu_table, version

    _registered.append(True)
