"""llama4: interleaved expert layers (sigmoid, one expert weighting its input, a shared expert), RoPE-less layers
with the attention temperature, chunked layers with q/k normed after RoPE (the fixture's validation against
llama.cpp, layer by layer, is in tests/test_validation.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from alchemist.arch import build_model_ir
from alchemist.fixtures import FixtureConfig, write_fixture
from alchemist.gguf_io import read_gguf


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from alchemist.harness.validate import load_for_validation

    return load_for_validation(str(write_fixture(tmp_path_factory.mktemp("llama4") / "m.gguf", "llama4")))


def test_layers_interleave_as_llamacpp_builds_them(loaded):
    ir, module = loaded.ir, loaded.module
    assert module.ROPE_LAYERS == (True, True, True, False)  # (il + 1) % 4 != 0
    assert module.ATTENTION_CHUNK == (8192, 8192, 8192, 0) and module.SLIDING_WINDOW == (0, 0, 0, 0)
    assert module.MOE_LAYERS == (False, True, False, True)  # (il + 1) % interleave_moe_layer_step == 0
    att = ir.layers[0].attention
    assert att.rotated_qk_norm and att.temperature.unrotated_only and att.temperature.offset == 1.0
    router = ir.layers[1].mlp.router
    assert router.weight_inputs and router.n_expert_used == 1 and not router.normalize
    assert ir.layers[1].mlp.shared.n_ff == ir.layers[1].mlp.n_ff == 128


def test_temperature_steps_every_8192_positions_from_position_8191(loaded):
    """llama.cpp: log(floor((p + 1) / 8192) + 1) · 0.1 + 1, the step in float32, the rest in double."""
    import pytensor
    import pytensor.tensor as pt

    positions = pt.vector("p", dtype="int64")
    factor = pytensor.function([positions], loaded.module.attention_temperature(positions))
    p = np.array([0, 1, 8190, 8191, 8192, 16382, 16383, 100_000], dtype=np.int64)
    f32 = np.float32
    want = [f32(math.log(float(np.floor(f32(f32(i) + f32(1.0)) / f32(8192))) + 1.0) * float(f32(0.1)) + 1.0) for i in p]
    np.testing.assert_array_equal(factor(p), want)
    assert factor(p)[2] == 1.0 and factor(p)[3] > 1.0


def test_a_cache_longer_than_the_chunk_is_refused(loaded):
    engine = loaded.engine("c", 8193)
    with pytest.raises(ValueError, match="chunked attention over a cache longer than its chunk"):
        engine.run([1, 2], 0)


def test_without_a_window_there_are_no_chunks_and_no_temperature(tmp_path):
    config = FixtureConfig(arch="llama4", metadata=(("attention.sliding_window", 0),))
    ir = build_model_ir(read_gguf(write_fixture(tmp_path / "m.gguf", "llama4", config=config)))
    assert all(lay.attention.chunk == 0 and lay.attention.temperature is None for lay in ir.layers)
    # n_no_rope_layer_step = n_layer: the last layer still skips RoPE, as llama4.cpp computes it
    assert [lay.attention.rope.style.value for lay in ir.layers] == ["norm", "norm", "norm", "none"]
