"""llama.cpp's CPU rounding, emulated in our graph, to tell its arithmetic apart from our bugs.

The roundings are the "ggml" numerics mode that load_llm computes with by default (alchemist.runtime.numerics,
on top of alchemist.kernels' graph_rounding and table GELU); they are re-exported here for the harness.
"""

from __future__ import annotations

from alchemist.runtime.numerics import (  # noqa: F401  (re-exported)
    Q8_0_SOURCES,
    Q8_K_SOURCES,
    _div_f32,
    _fp16,
    _mul_f32,
    gelu_fp16_table,
    round_activations,
    round_like_q8_0,
    round_like_q8_k,
)
