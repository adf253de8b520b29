"""Matmuls against weights kept in GGUF block format (no float32 copy of the weights).

    y = quantized_linear(x, w_blocks, "Q5_0", n_out, n_in)      # == x @ dequantize(w_blocks).T
    e = quantized_embedding(w_blocks, tokens, "Q8_0", n_rows, n_in)  # == dequantize(w_blocks)[tokens]
    m = quantized_expert_linear(x, w_blocks, ids, "Q4_K", n_expert, n_out, n_in)  # m[t, j] == x[t] @ W[ids[t, j]].T

x: symbolic (T, n_in) float32. w_blocks: (n_out, row_bytes) uint8, the tensor's GGUF bytes one row per
output (`raw.reshape(n_out, -1)`, see `as_blocks`); no repacking. Result: symbolic (T, n_out) float32.
Types: SUPPORTED_TYPES = Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K MXFP4 IQ4_NL IQ4_XS TQ2_0 TQ1_0 IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_S IQ1_M NVFP4 Q1_0. The Ops check at
run time that
the arrays have the (n_out, n_in) they were built for (on C these are run-time parameters, so one compiled
module serves every shape of a type).

Mixture of experts (`QuantizedExpertMatmul`): w_blocks (n_expert, n_out, row_bytes), ids (T, K); only the chosen
experts' blocks are read (C: each chosen expert through the matmul kernel once, its routed tokens as the batch;
Numba: each chosen expert's rows dequantized once and dotted with its tokens; JAX/MLX: their blocks taken and
dequantized in the graph).

Per backend (Ops `QuantizedMatmul`, `QuantizedEmbedding`):
  C (CVM)   C++ kernels (AVX-512 / AVX2 intrinsics, portable fallback), OpenMP over output rows;
            T >= 16: ~4 MB panels of rows dequantized exactly, then sgemm (alchemist/kernels/c_kernels.py)
  Numba     the C kernels above, built once per machine into a shared library and called from Numba's compiled
            code (alchemist/kernels/native.py); without a C++ compiler (or ALCHEMIST_NUMBA_NATIVE=0) its own
            njit(parallel=True) drivers per type, prange over output rows; T >= 16: panels + np.dot
            (alchemist/kernels/numba_kernels.py); registered with PyTensor's Numba dispatch on first use
  JAX, MLX  numerics="ggml": the C kernels above, JAX's as XLA custom calls (alchemist/kernels/jax_ffi.py), MLX's
            called from its graph run uncompiled (alchemist/kernels/mlx_host.py); numerics="exact" (and "ggml"
            without a C++ compiler): rewritten (rewrite tagged "jax"/"mlx" only) into plain PyTensor ops:
            dot(x, dequantize_rows(w).T) - correct, but dequantizes the whole weight on every call
  other     `perform`: gguf-py's numpy dequantizer, then a numpy dot

Two numerics (the `numerics=` keyword of quantized_linear / quantized_expert_linear):
  "exact"  float32 products with the exactly dequantized weights (differentiable; the reference for gradients)
  "ggml"   llama.cpp's CPU arithmetic: each activation row rounded to the weight type's vec_dot_type blocks
           (Q8_0 for Q4_0/Q5_0/Q8_0/MXFP4/IQ4_NL/NVFP4/Q1_0, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants, IQ4_XS, the ternary and the grid i-quants), then
           C            integer dot products (AVX2 maddubs) with ggml's own float operations in its order: per
                        block for the 32-blocks at every T (IQ4_NL: vec_dot's two accumulators for one row);
                        vec_dot_*_q8_K below 8 rows and ggml's tiled matmul from 8 rows on for Q4_K/Q5_K/Q6_K and
                        IQ4_XS, vec_dot at every T for TQ2_0, TQ1_0, NVFP4 and Q1_0: llama.cpp's products bit for bit (Q2_K/Q3_K
                        and MXFP4 float32 eps apart; Q2_K/Q3_K at T >= 16 through the exact path's float kernel)
           Numba, JAX, MLX  the C kernels (the same products); Numba with its own kernels, and JAX and MLX
                        without the C kernels:
           Numba, JAX, MLX  dequant(quant(x)) (alchemist.kernels.activations / graph_rounding), then the exact
                        product; Q4_1/Q5_1 differ from ggml in the offset term (~1e-3 relative), which ggml takes
                        from Q8_1's fp16 block sum
  GELU: `gelu_table` (alchemist.kernels.gelu) is ggml's fp16 lookup table, exact on C and Numba.

Exact numerics (all float32; results equal dequantize-then-matmul up to float32 summation order):
  C, T < 16    per sub-block of 16/32 weights: dl * sum(q * x) (+ mb * sum(x)), dl and mb computed as gguf-py
               does, vector lanes summed pairwise; row t of a T-token product == the 1-token product
  C, T >= 16   exact gguf-py dequantization (bit for bit, no FMA contraction) of a panel, then sgemm
  Numba        the C kernels; its own kernels: exact gguf-py dequantization of each row, then a float32 dot (the dot alone is compiled with
               fastmath={"reassoc"} so LLVM vectorizes it; no nnan/ninf, so nan/inf propagate); T >= 16: np.dot
  embedding    bit-exact gguf-py dequantization of the selected rows, on every backend
"""

from __future__ import annotations

import numpy as np

from alchemist.kernels.formats import BLOCK_SIZES, SUPPORTED_TYPES, block_size, dequantize_rows, row_bytes
from alchemist.kernels.gelu import gelu_table
from alchemist.kernels.mlx_affine import MlxAffineMatmul, mlx_affine_linear, mlx_affine_rows
from alchemist.kernels.primitives import Primitives
from alchemist.kernels.op import (
    QuantizedEmbedding,
    QuantizedExpertMatmul,
    QuantizedMatmul,
    dequantize_experts_then_matmul,
    dequantize_then_dot,
)

__all__ = [
    "BLOCK_SIZES",
    "MlxAffineMatmul",
    "Primitives",
    "SUPPORTED_TYPES",
    "QuantizedEmbedding",
    "QuantizedExpertMatmul",
    "QuantizedMatmul",
    "as_blocks",
    "block_size",
    "dequantize_experts_then_matmul",
    "dequantize_rows",
    "dequantize_then_dot",
    "gelu_table",
    "mlx_affine_linear",
    "mlx_affine_rows",
    "quantized_embedding",
    "quantized_expert_linear",
    "quantized_linear",
    "register_numba",
    "row_bytes",
]


def quantized_linear(x, w_blocks, ggml_type: str, n_out: int, n_in: int, numerics: str = "exact"):
    """x (T, n_in) float32 @ dequant(w_blocks).T -> (T, n_out) float32, w_blocks (n_out, row_bytes) uint8.
    numerics="ggml": each row of x rounded first to llama.cpp's activation blocks (integer kernels on C)."""
    return QuantizedMatmul(ggml_type, n_out, n_in, numerics)(x, w_blocks)


def quantized_embedding(w_blocks, indices, ggml_type: str, n_rows: int, n_in: int):
    """Rows `indices` (int vector (T,)) of w_blocks (n_rows, row_bytes) uint8, dequantized: (T, n_in) float32.

    For a quantized token_embd: `quantized_embedding(w["token_embd.weight"], tokens, "Q8_0", N_VOCAB, N_EMBD)`
    equals `dequantize(token_embd)[tokens]` exactly (same float32 operations as gguf-py). Negative indices
    count from the end; out-of-range ones raise IndexError. On JAX/MLX it needs a static T.
    """
    return QuantizedEmbedding(ggml_type, n_rows, n_in)(w_blocks, indices)


def quantized_expert_linear(
    x, w_blocks, ids, ggml_type: str, n_expert: int, n_out: int, n_in: int, numerics: str = "exact"
):
    """Mixture of experts: x (T, n_in) or (T, K, n_in) float32, w_blocks (n_expert, n_out, row_bytes) uint8, ids
    (T, K) int -> (T, K, n_out) float32 with y[t, j] = x[t] (or x[t, j]) @ dequant(w_blocks[ids[t, j]]).T.
    Only the experts in ids are read; on JAX/MLX (static T) their blocks are taken and dequantized in the graph."""
    return QuantizedExpertMatmul(ggml_type, n_expert, n_out, n_in, numerics)(x, w_blocks, ids)


def as_blocks(raw: np.ndarray, ggml_type: str, shape: tuple[int, ...], copy: bool = False) -> np.ndarray:
    """A tensor's raw GGUF bytes (flat uint8) -> the (n_out, row_bytes) uint8 matrix `quantized_linear` takes.

    shape is numpy order (n_out, n_in); a stack of matrices (n_experts, n_out, n_in) gives
    (n_experts, n_out, row_bytes). By default the result is a view of `raw` (zero-copy: for a generated
    module's load_weights, a read-only view into the GGUF file's memory map, which the view keeps open; its
    pages are the page cache's, shared with every process that maps the file, and count once in RSS).
    copy=True returns a private, writeable C-contiguous copy instead (~0.1 s and the tensor's size again).
    """
    *lead, n_in = shape  # (n_out, n_in), or (n_expert, n_out, n_in) for a mixture's experts
    n_rows = int(np.prod(lead, dtype=np.int64))
    rb = row_bytes(ggml_type, n_in)
    flat = np.asarray(raw).view(np.uint8).reshape(-1)
    if flat.size != n_rows * rb:
        raise ValueError(f"{ggml_type} {tuple(shape)}: {flat.size} bytes, expected {n_rows} rows of {rb}")
    blocks = flat.reshape(*lead, rb)
    return np.array(blocks) if copy else blocks


def register_numba() -> None:
    """Register the Numba kernels now (otherwise done on the first compile in a mode with the "numba" tag)."""
    from alchemist.kernels.numba_experts import register_numba as _register_experts
    from alchemist.kernels.numba_kernels import register_numba as _register
    from alchemist.kernels.mlx_affine import register_numba as _register_mlx_affine
    from alchemist.kernels.numba_ops import register_numba as _register_ops
    from alchemist.kernels.rms_norm import register_numba as _register_rms_norm

    _register()
    _register_experts()
    _register_rms_norm()
    _register_ops()
    _register_mlx_affine()


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
            from alchemist.kernels.attention import CausalAttentionGgml
            from alchemist.kernels.gelu import GeluTable
            from alchemist.kernels.rms_norm import RmsNormGgml
            from alchemist.kernels.rope import RopeCacheGgml, RopeGgml
            from alchemist.kernels.silu import SiluGgml

            kernel_ops = (QuantizedMatmul, QuantizedEmbedding, QuantizedExpertMatmul, RmsNormGgml, CausalAttentionGgml,
                          RopeCacheGgml, RopeGgml, SiluGgml, GeluTable, MlxAffineMatmul)  # fmt: skip
            if any(isinstance(node.op, kernel_ops) for node in fgraph.apply_nodes):
                register_numba()

    name = "alchemist_register_numba_kernels"
    if name not in optdb:
        optdb.register(name, _RegisterNumbaKernels(), "numba", position=0.05)


_install_lazy_numba_registration()
