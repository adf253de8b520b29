"""IQ4_NL, IQ4_XS, TQ2_0 and TQ1_0: the block formats against llama.cpp's own quantizer and dequantizer, and fixtures
llama.cpp quantized run through the kernels with numerics="ggml" give llama.cpp's logits bit for bit, prompt and
decode.
(The kernels against gguf-py and ggml_vec_dot, type by type, are in tests/test_kernels.py; the fixtures of the
llama-like families at the bar, in tests/test_validation.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from alchemist.kernels import SUPPORTED_TYPES, dequantize_rows
from alchemist.kernels.formats import KVALUES_IQ4NL

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]
CONTEXT = 64
I_QUANTS = ("IQ4_NL", "IQ4_XS", "TQ2_0", "TQ1_0")


def test_the_grid_is_ggmls():
    from gguf.quants import IQ4_NL

    assert KVALUES_IQ4NL.tolist() == list(IQ4_NL.kvalues)
    assert set(I_QUANTS) <= set(SUPPORTED_TYPES)


@pytest.mark.parametrize("ggml_type", I_QUANTS)
def test_dequantization_is_llamacpps(ggml_type):
    """Rows quantized by llama.cpp (ggml_quantize_chunk) decode to llama.cpp's dequantize_row_<type> bit for bit."""
    pytest.importorskip("llama_cpp")
    from alchemist.harness.quantize import dequantize_array, quantize_array

    rng = np.random.default_rng(7)
    values = (rng.standard_normal((24, 512)) * np.exp(rng.standard_normal((24, 1)))).astype(np.float32)
    raw = quantize_array(values, ggml_type).reshape(24, -1)
    ours = dequantize_rows(np, raw, ggml_type, 24, 512)
    np.testing.assert_array_equal(ours, dequantize_array(raw, ggml_type).reshape(24, 512))
    # and it is a quantization of the values (a coarse one: ternary TQ2_0 / TQ1_0 scaled by the block maximum)
    assert np.corrcoef(ours.ravel(), values.ravel())[0, 1] > (0.4 if ggml_type.startswith("TQ") else 0.99)


# Numba calls the C kernels (tests/test_kernels.py checks its products equal C's for every type): one type on Numba
@pytest.mark.parametrize(
    "ggml_type, backend", [(t, "c") for t in I_QUANTS] + [("IQ4_NL", "numba")], ids=lambda v: str(v)
)
def test_fixture_logits_are_llamacpps_to_the_bit(prompt_and_decode_are_llamacpps, fixture_files, ggml_type, backend):
    """qwen2 quantized by llama.cpp (its mixture: the type in the projections, Q6_K output), kernels and
    numerics="ggml": the 14-token prompt (IQ4_NL: tinyBLAS's order; IQ4_XS: ggml's tiled matmul; TQ2_0, TQ1_0: vec_dot,
    which llama.cpp takes at every batch size for it) and three decode steps (one row: ggml_vec_dot's order, which
    for IQ4_NL alternates two accumulators) are llama.cpp's logits bit for bit."""
    from alchemist.harness.validate import load_for_validation

    path = str(fixture_files("qwen2", ggml_type))
    loaded = load_for_validation(path, numerics="ggml")
    assert {loaded.module.TENSORS[n][0] for n in loaded.module.KERNEL_WEIGHTS} >= {ggml_type}
    prompt_and_decode_are_llamacpps(loaded.engine(backend, CONTEXT, True), path, PROMPT, CONTEXT)
