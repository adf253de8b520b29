"""mistral3: Llama 4's attention temperature and mistral3.cpp's own YaRN factor, against llama.cpp's formulas and
its logits (the fixtures' validation at the bar is in tests/test_validation.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from alchemist.arch import build_model_ir
from alchemist.arch.family import logf
from alchemist.fixtures import write_fixture
from alchemist.gguf_io import read_gguf
from alchemist.ir import AttentionTemperature

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]
CONTEXT = 64


def llama_cpp_temperature(pos: int, t: AttentionTemperature) -> np.float32:
    """llm_graph_input_attn_temp::set_input: float position and division, std::floor, the rest in double."""
    f = np.float32
    steps = float(np.floor(f(f(pos) + f(t.offset)) / f(t.length)))
    return f((math.log(steps + 1.0) * float(f(t.scale))) + 1.0)


@pytest.fixture(scope="module")
def yarn_module(tmp_path_factory):
    from alchemist.harness.validate import load_for_validation

    path = write_fixture(tmp_path_factory.mktemp("mistral3") / "m.gguf", "mistral3:yarn")
    loaded = load_for_validation(str(path))
    return loaded.ir, loaded.module


def test_temperature_is_llamacpps_formula(yarn_module):
    import pytensor
    import pytensor.tensor as pt

    ir, module = yarn_module
    temperature = ir.layers[0].attention.temperature
    assert temperature == AttentionTemperature(scale=0.5, length=4, offset=0.0)
    positions = pt.vector("p", dtype="int64")
    factor = pytensor.function([positions], module.attention_temperature(positions))
    p = np.arange(0, 5000, dtype=np.int64)
    np.testing.assert_array_equal(factor(p), [llama_cpp_temperature(int(i), temperature) for i in p])
    assert factor(p)[:9].tolist() == [1.0] * 4 + [float(np.float32(1 + 0.5 * math.log(2)))] * 4 + [factor(p)[8]]


def test_yarn_factor_is_mistral3_cpps(yarn_module):
    """mistral3.cpp hands ggml_rope_ext 1 / (1 + 0.1 ln factor); ggml multiplies it by its own magnitude, so the
    exact formula's ROPE_ATTN_FACTOR is their float32 product, and the ggml rope gets mistral3.cpp's factor."""
    ir, module = yarn_module
    rope = ir.layers[0].attention.rope
    f = np.float32
    handed = f(1) / f(f(f(0.1) * f(logf(5.0))) + f(1))
    assert rope.ggml_attn_factor == float(handed) and module.ROPE_GGML_ATTN_FACTOR == float(handed)
    ggml_magnitude = f(float(f(0.1)) * logf(5.0) + 1.0)  # fmaf(0.1f, logf(1 / freq_scale), 1.0f)
    assert rope.attn_factor == float(ggml_magnitude * handed)
    assert abs(rope.attn_factor - 1.0) < 1e-7
    assert (rope.beta_fast, rope.beta_slow) == (32.0, 1.0)


def test_plain_llama_files_have_no_temperature(tmp_path):
    path = write_fixture(tmp_path / "l.gguf", "llama")
    ir = build_model_ir(read_gguf(path))
    assert all(lay.attention.temperature is None and lay.attention.rope.ggml_attn_factor is None for lay in ir.layers)


@pytest.mark.parametrize("backend", ["c"])  # Numba's RoPE is the same C code with the same parameters
def test_ggml_numerics_give_llamacpps_logits(prompt_and_decode_are_llamacpps, fixture_files, backend):
    """The YaRN variant, Q8_0 weights in their blocks, numerics="ggml": the rotated and temperature-tuned queries
    and keys, the prompt's logits and the decode steps after it are llama.cpp's bit for bit (the temperature
    steps at positions 4, 8 and 12 of the prompt). The rotated values need mistral3.cpp's own YaRN factor: with
    llama_context's, about half of them are an ulp off (the logits hide it behind the Q8_0 rounding)."""
    from alchemist.harness import LlamaCppOracle
    from alchemist.harness.validate import load_for_validation, tap_values

    path = str(fixture_files("mistral3:yarn", "Q8_0"))
    engine = load_for_validation(path, numerics="ggml").engine(backend, CONTEXT, True)
    ours = tap_values(engine, PROMPT)
    names = ["Qcur-0", "Kcur-0", "Qcur_attn_temp_scaled-0", "Qcur_attn_temp_scaled-1"]
    with LlamaCppOracle(path, n_ctx=CONTEXT, n_threads=1) as oracle:
        theirs = oracle.intermediates(PROMPT, names)
    for name in names:
        assert np.array_equal(ours[name].reshape(theirs[name].shape), theirs[name]), name
    engine.reset()
    prompt_and_decode_are_llamacpps(engine, path, PROMPT, CONTEXT)
