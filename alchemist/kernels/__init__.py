"""Matmuls against weights kept in GGUF block format (no float32 copy of the weights).

    y = quantized_linear(x, w_blocks, "Q5_0", n_out, n_in)     # == x @ dequantize(w_blocks).T

x: symbolic (T, n_in) float32. w_blocks: (n_out, row_bytes) uint8, the tensor's GGUF bytes one row per
output (`raw.reshape(n_out, -1)`), no repacking: load is a reshape of the mmap (`as_blocks`). Result:
symbolic (T, n_out) float32.

Per backend (one Op, `QuantizedMatmul`):
  C (CVM)   C++ kernels, OpenMP over output rows, vectorized per block (alchemist/kernels/c_kernels.py)
  Numba     njit(parallel=True) kernels, prange over output rows (alchemist/kernels/numba_kernels.py)
  JAX, MLX  rewritten into plain PyTensor ops: dot(x, dequantize_rows(w).T) - correct, but dequantizes
            the whole weight on every call (keep float32 weights on these backends for speed)
  other     `perform`: gguf-py's numpy dequantizer, then a numpy dot

Numerics: each weight is dequantized exactly as gguf-py does (float32 d*q, d*q+m or d*q-m); products are
accumulated in float32 (16 independent lanes per row, summed pairwise), so results equal
dequantize-then-matmul up to float32 summation order.
"""

from __future__ import annotations

import numpy as np

from alchemist.kernels.formats import BLOCK_SIZES, SUPPORTED_TYPES, block_size, dequantize_rows, row_bytes
from alchemist.kernels.op import QuantizedEmbedding, QuantizedMatmul, dequantize_then_dot

__all__ = [
    "BLOCK_SIZES",
    "SUPPORTED_TYPES",
    "QuantizedEmbedding",
    "QuantizedMatmul",
    "as_blocks",
    "block_size",
    "dequantize_rows",
    "dequantize_then_dot",
    "quantized_embedding",
    "quantized_linear",
    "register_numba",
    "row_bytes",
]


def quantized_linear(x, w_blocks, ggml_type: str, n_out: int, n_in: int):
    """x (T, n_in) float32 @ dequant(w_blocks).T -> (T, n_out) float32, w_blocks (n_out, row_bytes) uint8."""
    return QuantizedMatmul(ggml_type, n_out, n_in)(x, w_blocks)


def quantized_embedding(w_blocks, indices, ggml_type: str, n_rows: int, n_in: int):
    """Rows `indices` (int vector (T,)) of w_blocks (n_rows, row_bytes) uint8, dequantized: (T, n_in) float32.

    For a quantized token_embd: `quantized_embedding(w["token_embd.weight"], tokens, "Q8_0", N_VOCAB, N_EMBD)`
    equals `dequantize(token_embd)[tokens]` exactly (same float32 operations as gguf-py). Negative indices
    count from the end; out-of-range ones raise IndexError. On JAX/MLX it needs a static T.
    """
    return QuantizedEmbedding(ggml_type, n_rows, n_in)(w_blocks, indices)


def as_blocks(raw: np.ndarray, ggml_type: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's raw GGUF bytes (flat uint8) -> the (n_out, row_bytes) uint8 matrix `quantized_linear` takes.

    shape is numpy order (n_out, n_in); no copy is made (the result is a view of `raw`).
    """
    n_out, n_in = shape
    rb = row_bytes(ggml_type, n_in)
    raw = np.asarray(raw).view(np.uint8).reshape(-1)
    if raw.size != n_out * rb:
        raise ValueError(f"{ggml_type} {shape}: {raw.size} bytes, expected {n_out} rows of {rb}")
    return raw.reshape(n_out, rb)


def register_numba() -> None:
    """Register the Numba kernels now (otherwise done on the first compile in a mode with the "numba" tag)."""
    from alchemist.kernels.numba_kernels import register_numba as _register

    _register()


def _install_lazy_numba_registration() -> None:
    """Registering needs numba's dispatch module (0.5 s to import): do it when a Numba-mode graph is compiled.

    A no-op graph rewriter tagged "numba" (in NUMBA mode's rewrite query, not in fast_run) registers the
    kernels before the linker looks for them; if the dispatch module is already imported, register now.
    """
    import importlib.util
    import sys

    if importlib.util.find_spec("numba") is None:
        return
    if "pytensor.link.numba.dispatch" in sys.modules:
        register_numba()
        return
    from pytensor.compile.mode import optdb
    from pytensor.graph.rewriting.basic import GraphRewriter

    class _RegisterNumbaKernels(GraphRewriter):
        def apply(self, fgraph):
            if any(isinstance(node.op, (QuantizedMatmul, QuantizedEmbedding)) for node in fgraph.apply_nodes):
                register_numba()

    name = "alchemist_register_numba_kernels"
    if name not in optdb:
        optdb.register(name, _RegisterNumbaKernels(), "numba", position=0.05)


_install_lazy_numba_registration()
