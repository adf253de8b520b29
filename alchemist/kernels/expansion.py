"""The rewrite that expands a C-only Op into PyTensor ops on the backends that do not run its C code.

A leaf module: the Op modules register their expansions here, and the backends that call the C code (JAX's custom
calls, MLX's host calls) register whether they can; nothing here imports an Op."""

from __future__ import annotations

from collections.abc import Callable


def register_expansion(name: str, *rewriters, backends: tuple[str, ...] = ("numba", "jax", "mlx")) -> None:
    """Register `rewriters` (node rewriters) under `name` in PyTensor's optdb for `backends` (idempotent), at
    position 0.9: before canonicalize (1), so the expanded graph is rewritten like any other. On JAX and MLX a
    node their kernels compute (`kernels_compute`: alchemist.kernels.jax_ffi, mlx_host) is left as it is."""
    from pytensor.compile.mode import optdb
    from pytensor.graph.rewriting.basic import in2out

    if name in optdb or any(f"{name}_{b}" in optdb for b in backends):
        return
    for backend in backends:
        if backend in ("jax", "mlx"):
            expanders = [_unless_kernels(backend, r) for r in rewriters]
            optdb.register(f"{name}_{backend}", in2out(*expanders), backend, position=0.9)
    others = tuple(b for b in backends if b not in ("jax", "mlx"))
    if others:
        optdb.register(name, in2out(*rewriters), *others, position=0.9)


def is_ggml_kernel_node(node) -> bool:
    """True for the Ops numerics="ggml" computes in C (their C code, which JAX and MLX call too): those whose
    `computes_ggml_kernel` says so (a QuantizedMatmul with numerics="ggml", RmsNormGgml, RopeCacheGgml, RopeGgml,
    CausalAttentionGgml, SiluGgml, GeluTable)."""
    return bool(getattr(node.op, "computes_ggml_kernel", False))


# backend -> available(): whether it computes those Ops by their C code (registered by kernels.jax_ffi, mlx_host)
_KERNEL_BACKENDS: dict[str, Callable[[], bool]] = {}


def register_kernel_backend(backend: str, available: Callable[[], bool]) -> None:
    _KERNEL_BACKENDS[backend] = available


def kernels_compute(backend: str, node) -> bool:
    """True when `backend` (jax, mlx) computes `node` by alchemist's C code rather than by its formula: one of the
    Ops above, and the backend's kernels are there (alchemist.kernels.jax_ffi, mlx_host)."""
    available = _KERNEL_BACKENDS.get(backend)
    return is_ggml_kernel_node(node) and available is not None and available()


def _unless_kernels(backend: str, rewriter):
    from pytensor.graph.rewriting.basic import node_rewriter

    @node_rewriter(rewriter.tracks())
    def expand_unless_kernels(fgraph, node):
        return None if kernels_compute(backend, node) else rewriter.transform(fgraph, node)

    return expand_unless_kernels
