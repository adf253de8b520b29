"""Numba kernel for `QuantizedExpertMatmul` (mixture of experts) and its registration with PyTensor's Numba
backend. Kept apart from numba_kernels.py so that its compiled, cached drivers stay valid when this changes.

The (token, rank) pairs are grouped by expert; each chosen expert's rows are dequantized once, exactly as
gguf-py does (numba_kernels' decoders), and dotted with every token routed to it: unchosen experts are never
read, so a decode step costs K experts whatever the expert count.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numba
import numpy as np
from numba import prange

from alchemist.kernels import activations
from alchemist.kernels.numba_kernels import (
    KINDS,
    dq_row,
    _chunks,
    _dot,
)


@numba.njit(cache=True, parallel=True, fastmath=False)
def expert_matmul(kind, x, w, ids, n_in):
    """y (T, K, n_out), y[t, j] = x[t, j or 0] @ dequant(w[ids[t, j]]).T for x (T, 1 or K, n_in), w (n_expert,
    n_out, row_bytes) uint8, ids (T, K) int64."""
    n_tokens, k = ids.shape
    n_expert, n_out = w.shape[0], w.shape[1]
    per_rank = x.shape[1] > 1
    n16 = 16 + (n_in >> 62)
    y = np.empty((n_tokens, k, n_out), dtype=np.float32)
    start = np.zeros(n_expert + 1, dtype=np.int64)
    for t in range(n_tokens):
        for j in range(k):
            e = ids[t, j]
            if e < 0 or e >= n_expert:
                raise IndexError("QuantizedExpertMatmul: expert id out of range")
            start[e + 1] += 1
    for e in range(n_expert):
        start[e + 1] += start[e]
    fill = start.copy()
    order = np.empty(n_tokens * k, dtype=np.int64)
    for i in range(n_tokens * k):
        e = ids[i // k, i % k]
        order[fill[e]] = i
        fill[e] += 1
    n_chunks = _chunks(n_out)
    for e in range(n_expert):
        a, b = start[e], start[e + 1]
        if a == b:
            continue
        for ch in prange(n_chunks):
            row = np.empty(n_in, dtype=np.float32)
            for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
                dq_row(kind, w[e, o], n_in, row, n16)
                for i in range(a, b):
                    t, j = order[i] // k, order[i] % k
                    y[t, j, o] = _dot(row, x[t, j if per_rank else 0])
    return y


def expert_qmatmul(ggml_type: str, x: np.ndarray, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """From Python: x (T, n_in) or (T, K, n_in), w (n_expert, n_out, row_bytes) uint8, ids (T, K) -> (T, K, n_out)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    x3 = x.reshape(x.shape[0], -1, x.shape[-1])
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    return expert_matmul(KINDS[ggml_type], x3, np.ascontiguousarray(w, dtype=np.uint8), ids, x.shape[-1])


def register_numba():
    """Register the expert kernel with PyTensor's Numba backend (idempotent)."""
    global _registered
    if _registered:
        return
    from alchemist.kernels.op import QuantizedExpertMatmul
    from alchemist.pytensor_ext.pytensor_internals import (
        numba_launch_threads,
        numba_njit,
        register_funcify_default_op_cache_key,
    )

    @register_funcify_default_op_cache_key(QuantizedExpertMatmul)
    def numba_funcify_QuantizedExpertMatmul(op, node=None, **kwargs):
        numba_launch_threads()  # see numba_kernels.register_numba
        kind, n_expert, n_out, n_in, row_bytes = KINDS[op.ggml_type], op.n_expert, op.n_out, op.n_in, op.row_bytes
        round_rows, act, ggml = (
            activations.round_rows_numba(),
            activations.activation_kind(op.ggml_type),
            op.numerics == "ggml",
        )

        @numba_njit(fastmath=False)  # exact rounding: see kernels.rms_norm.register_numba
        def quantized_expert_matmul(x, w, ids):
            if w.shape[0] != n_expert or w.shape[1] != n_out or w.shape[2] != row_bytes or x.shape[-1] != n_in:
                raise ValueError("QuantizedExpertMatmul: x or w does not have the shape the Op was built for")
            x2 = np.ascontiguousarray(x).reshape((-1, n_in))
            if ggml:
                x2 = round_rows(x2, act)  # llama.cpp's activation blocks, then the exact product
            x3 = x2.reshape((x.shape[0], -1, n_in))  # (T, 1 or K, n_in)
            # np.int64: plain integers, not literals, so one compiled expert_matmul serves every type and width
            wc, idc = np.ascontiguousarray(w), np.ascontiguousarray(ids)
            return expert_matmul(np.int64(kind), x3, wc, idc, np.int64(n_in))

        return quantized_expert_matmul, _SOURCE_VERSION

    _registered = True


_registered = False
_SOURCE_VERSION = int(hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12], 16)
