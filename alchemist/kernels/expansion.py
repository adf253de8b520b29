"""The rewrite that expands a C-only Op into PyTensor ops on the backends that do not run its C code."""

from __future__ import annotations


def register_expansion(name: str, *rewriters, backends: tuple[str, ...] = ("numba", "jax", "mlx")) -> None:
    """Register `rewriters` (node rewriters) under `name` in PyTensor's optdb for `backends` (idempotent), at
    position 0.9: before canonicalize (1), so the expanded graph is rewritten like any other."""
    from pytensor.compile.mode import optdb
    from pytensor.graph.rewriting.basic import in2out

    if name not in optdb:
        optdb.register(name, in2out(*rewriters), *backends, position=0.9)
