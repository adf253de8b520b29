"""llama.cpp's CPU rounding, emulated in our graph, to tell its arithmetic apart from our bugs.

ggml-cpu multiplies a weight of type T by first converting each activation row to T's `vec_dot_type`
(ggml-cpu.c, type_traits_cpu), then summing integer products block by block, which equals
dequant(W) · dequant(quant(x)) up to float32 summation order:
- Q8_0 (blocks of 32, scale max|x|/127 stored as fp16, x·127/max rounded to nearest even: the AVX2
  quantize_row_q8_0) for Q4_0, Q5_0, Q8_0 and MXFP4; Q8_1 (the same values plus block sums) for Q4_1, Q5_1;
- Q8_K (blocks of 256, float32 scale: quantize_row_q8_K_ref, iscale = -127/max where max is the element of
  largest magnitude) for the K-quants;
- fp16 for F16 weights.
Its GELU reads an fp16 lookup table (GGML_GELU_FP16, ggml-cpu/vec.h): gelu(x) = table[fp16(x)] for
-10 < x < 10.

`emulating_llamacpp(module)` returns a copy of a generated module whose project() rounds its input that way
and whose gelu() is the table's. Validating that copy shows how much of a disagreement with llama.cpp is
llama.cpp's own rounding. A diagnostic only: the generated modules compute the exact products.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytensor.tensor as pt

from alchemist.kernels.graph_rounding import (  # noqa: F401 - re-exported
    Q8_0_SOURCES,
    Q8_K_SOURCES,
    _fp16,
    round_like_q8_0,
    round_like_q8_k,
)


def round_activations(x, weight_type: str):
    """The activation a llama.cpp CPU matmul with a `weight_type` weight actually multiplies."""
    if weight_type in Q8_0_SOURCES:
        return round_like_q8_0(x)
    if weight_type in Q8_K_SOURCES:
        return round_like_q8_k(x)
    if weight_type == "F16":
        return _fp16(x)
    return x


def gelu_fp16_table(x):
    """ggml's table GELU: gelu of the fp16-rounded input, rounded to fp16; exact outside (-10, 10)."""
    x16 = _fp16(x)
    g = (
        np.float32(0.5)
        * x16
        * (1 + pt.tanh(np.float32(0.7978845608028654) * x16 * (1 + np.float32(0.044715) * x16 * x16)))
    )
    return pt.switch(x <= -10, np.float32(0), pt.switch(x >= 10, x, _fp16(g)))


def emulating_llamacpp(module: ModuleType) -> ModuleType:
    """A fresh copy of the generated `module` computing with llama.cpp's CPU roundings (see above)."""
    from alchemist.runtime.engine import import_generated

    copy = import_generated(module.__file__, name_suffix="_llamacpp_rounding")
    exact_project = copy.project

    def project(x, w, name, bias=None):
        return exact_project(round_activations(x, copy.TENSORS[name][0]), w, name, bias)

    copy.project = project
    if hasattr(copy, "gelu"):
        copy.gelu = gelu_fp16_table
    return copy
