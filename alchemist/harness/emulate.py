"""llama.cpp's CPU rounding, emulated in our graph, to tell its arithmetic apart from our bugs.

The roundings are the "ggml" numerics mode that load_llm computes with by default (alchemist.runtime.numerics,
on top of alchemist.kernels' graph_rounding and table GELU); they are re-exported here for the harness.
`emulating_llamacpp(module)` is `with_numerics(module, "ggml")`: a copy of a generated module whose matmuls
round their input as llama.cpp's CPU backend does and whose gelu() is ggml's fp16 table. (It used to round
project()'s input only; the numerics copy also rounds a mixture's expert inputs, which llama.cpp quantizes
too, uses the kernels' integer ggml path on C, and caches its step graphs on disk.)
"""

from __future__ import annotations

from types import ModuleType

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
    with_numerics,
)


def emulating_llamacpp(module: ModuleType) -> ModuleType:
    """A fresh copy of the generated `module` computing with llama.cpp's CPU roundings: with_numerics(module, "ggml")."""
    return with_numerics(module, "ggml")
