"""IQ4_NL, IQ4_XS, TQ2_0, TQ1_0, NVFP4, Q1_0 and the grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
IQ1_M): the
block formats against llama.cpp's own quantizer and dequantizer, and fixtures
llama.cpp quantized run through the kernels with numerics="ggml" give llama.cpp's logits bit for bit, prompt and
decode.
(The kernels against gguf-py and ggml_vec_dot, type by type, are in tests/test_kernels.py; the fixtures of the
llama-like families at the bar, in tests/test_validation.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from alchemist.harness.quantize import TENSOR_BY_TENSOR_QTYPES as TENSOR_BY_TENSOR
from alchemist.kernels import SUPPORTED_TYPES, dequantize_rows
from alchemist.kernels.formats import KVALUES_IQ4NL

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]
CONTEXT = 64
GRID_QUANTS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
I_QUANTS = ("IQ4_NL", "IQ4_XS", "TQ2_0", "TQ1_0", "NVFP4", "Q1_0", *GRID_QUANTS)
# how much of a random matrix each keeps: ternary scaled by the block maximum about half, 2 bits a bit more
SIGNAL = {
    "TQ2_0": 0.4, "TQ1_0": 0.4, "IQ2_XXS": 0.8, "IQ2_XS": 0.85, "IQ2_S": 0.85, "IQ3_XXS": 0.9, "IQ3_S": 0.9,
    "IQ1_S": 0.6, "IQ1_M": 0.6, "Q1_0": 0.75,
}  # fmt: skip


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
    # and it is a quantization of the values (coarse ones below 4 bits)
    assert np.corrcoef(ours.ravel(), values.ravel())[0, 1] > SIGNAL.get(ggml_type, 0.99)


# Numba calls the C kernels (tests/test_kernels.py checks its products equal C's for every type): one type on Numba
@pytest.mark.parametrize(
    "ggml_type, backend", [(t, "c") for t in I_QUANTS if t not in TENSOR_BY_TENSOR] + [("IQ4_NL", "numba")], ids=str
)
def test_fixture_logits_are_llamacpps_to_the_bit(prompt_and_decode_are_llamacpps, fixture_files, ggml_type, backend):
    """qwen2 quantized by llama.cpp (its mixture: the type in the projections, Q6_K output), kernels and
    numerics="ggml": the 14-token prompt (IQ4_NL: tinyBLAS's order; IQ4_XS: ggml's tiled matmul; TQ2_0, TQ1_0, Q1_0: vec_dot,
    which llama.cpp takes at every batch size for it) and three decode steps (one row: ggml_vec_dot's order, which
    for IQ4_NL alternates two accumulators) are llama.cpp's logits bit for bit."""
    from alchemist.harness.validate import load_for_validation

    path = str(fixture_files("qwen2", ggml_type))
    loaded = load_for_validation(path, numerics="ggml")
    assert {loaded.module.TENSORS[n][0] for n in loaded.module.KERNEL_WEIGHTS} >= {ggml_type}
    prompt_and_decode_are_llamacpps(loaded.engine(backend, CONTEXT, True), path, PROMPT, CONTEXT)


def test_the_grid_header_is_gguf_pys_grids():
    """csrc/iq_grids.h (the tables the C kernels read) is what `python -m alchemist.kernels.iq_grids` writes from
    gguf-py's grids: regenerated, byte for byte."""
    from alchemist.kernels.iq_grids import HEADER, header_text

    assert HEADER.read_text(encoding="utf-8") == header_text()


@pytest.mark.parametrize("ggml_type", TENSOR_BY_TENSOR)
def test_tensor_by_tensor_fixture_logits_are_llamacpps_to_the_bit(prompt_and_decode_are_llamacpps, tmp_path, ggml_type):
    """qwen2 with its 2-D weights quantized by llama.cpp's quantizer tensor by tensor (llama_model_quantize wants an
    importance matrix llama-cpp-python cannot hand it, a uniform one here; or refuses the type, NVFP4), kernels and
    numerics="ggml": the prompt and three decode steps (vec_dot_<type>_q8_K, vec_dot_nvfp4_q8_0, at every batch size,
    as llama.cpp) are llama.cpp's logits bit for bit."""
    pytest.importorskip("llama_cpp")
    from alchemist.harness.quantize import write_quantized_fixture
    from alchemist.harness.validate import load_for_validation

    path = str(write_quantized_fixture(tmp_path / "m.gguf", "qwen2", ggml_type))
    loaded = load_for_validation(path, numerics="ggml")
    assert {loaded.module.TENSORS[n][0] for n in loaded.module.KERNEL_WEIGHTS} >= {ggml_type}
    prompt_and_decode_are_llamacpps(loaded.engine("c", CONTEXT, True), path, PROMPT, CONTEXT)


def test_a_type_without_kernel_or_dequantizer_is_refused_by_name(tmp_path):
    """Q8_1 (an activation type of ggml's, which gguf-py writes but nothing multiplies) in one weight: a clear
    refusal naming the file, the tensor and the type, before anything is loaded."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from alchemist.arch import build_model_ir
    from alchemist.errors import UnsupportedModelError
    from alchemist.fixtures import write_fixture
    from alchemist.gguf_io import read_gguf

    qk, bs = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]

    def encode(name, role, values):
        if name != "blk.0.attn_q.weight":
            return None
        return np.zeros((values.shape[0], values.shape[1] // qk * bs), np.uint8), GGMLQuantizationType.Q8_1

    path = write_fixture(tmp_path / "q8_1.gguf", "qwen2", encode=encode)
    with pytest.raises(UnsupportedModelError, match=r"q8_1\.gguf: tensor 'blk\.0\.attn_q\.weight' is Q8_1"):
        build_model_ir(read_gguf(path))
