"""The operations a generated module's equations call through `ops`, as one named bundle.

A generated module defines each primitive as a formula and bundles them as `EXACT = Primitives(...)`; its
forward() takes `ops=EXACT` and every layer calls `ops.project(...)`, `ops.rms_norm(...)`, ... so the arithmetic
a model computes with is an argument the reader can see, not a rebinding of the module's names.
alchemist.runtime.numerics.primitives(module, "ggml") is the other bundle: llama.cpp's CPU loops for the same
operations. A field a family does not use is None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Primitives:
    project: Callable  # (x, w, name, bias=None): x @ W.T (+ bias) for the weight `name`
    project_experts: Callable | None = None  # (x, w, name, experts, bias=None): the routed experts' products
    rms_norm: Callable | None = None  # (x, weight=None)
    layer_norm: Callable | None = None  # (x, weight=None, bias=None)
    silu: Callable | None = None  # (x)
    gelu: Callable | None = None  # (x)
    swiglu_oai: Callable | None = None  # (gate, up)
    relu_sqr: Callable | None = None  # (x)
    rope_angles: Callable | None = None  # (w, il, positions[, n_ctx]) -> (tokens, ROPE_DIM/2) angles
    rope: Callable | None = None  # (x, angles)
    causal_attention: Callable | None = None  # (q, keys, values, q_positions, key_positions, window[, sinks])
    project_heads: Callable | None = None  # (x, w, name): each head's row x[t, h] @ W[h].T (latent attention)
