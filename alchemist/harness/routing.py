"""Routing as data: which experts a mixture-of-experts model sends each token to, per layer.

`expert_routing(engine, token_ids)` evaluates the prompt once through the engine's taps (the same named
intermediates `alchemist diff` compares with llama.cpp's ffn_moe_topk / ffn_moe_weights*) and returns, per
layer, the chosen experts (T, K), their final routing weights (T, K) and the expert load (tokens per expert).
"""

from __future__ import annotations

import re

import numpy as np


def expert_routing(engine, token_ids) -> dict:
    """{"layers": [il, ...], "experts": (n_layer, T, K) int, "weights": (n_layer, T, K) float32,
    "load": (n_layer, n_expert) int}; raises ValueError for a model without a mixture of experts."""
    n_expert = getattr(engine.module, "N_EXPERT", None)
    if n_expert is None:
        raise ValueError(f"{engine.module.ARCHITECTURE} model has no mixture of experts (no N_EXPERT)")
    ids = [int(t) for t in token_ids]
    names, fn = engine.taps_function(len(ids))
    values = dict(zip(names, fn(np.array(ids, np.int64), np.int64(0), np.int64(len(ids)))))
    layers = sorted(int(m.group(1)) for n in values if (m := re.fullmatch(r"ffn_moe_topk-(\d+)", n)))
    experts = np.stack([np.asarray(values[f"ffn_moe_topk-{il}"]) for il in layers])
    weights = []
    for il in layers:  # the last weighting step the router applies is the weight its experts get
        for step in ("ffn_moe_weights_scaled", "ffn_moe_weights_norm", "ffn_moe_weights_softmax", "ffn_moe_weights"):
            if f"{step}-{il}" in values:
                weights.append(np.asarray(values[f"{step}-{il}"], np.float32))
                break
    load = np.stack([np.bincount(e.reshape(-1), minlength=n_expert) for e in experts])
    return {"layers": layers, "experts": experts, "weights": np.stack(weights), "load": load}
