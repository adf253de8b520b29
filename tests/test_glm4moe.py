"""glm4moe (GLM-4.5): dense then expert layers with a selection bias, a scale and a shared expert, and a
multi-token-prediction layer that is loaded and never applied (the fixture's validation against llama.cpp,
layer by layer, is in tests/test_validation.py)."""

from __future__ import annotations

import numpy as np
import pytest

from alchemist.ir import Gating

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from alchemist.fixtures import write_fixture
    from alchemist.harness.validate import load_for_validation

    return load_for_validation(str(write_fixture(tmp_path_factory.mktemp("glm4moe") / "m.gguf", "glm4moe")))


def test_the_nextn_layer_is_bound_and_never_applied(loaded):
    """block_count 4 with nextn_predict_layers 1: three layers run; the fourth block's tensors (a whole block plus
    the NextN projections) are in TENSORS, marked unread, and the forward graph reads none of them."""
    ir, module = loaded.ir, loaded.module
    assert ir.n_layer == module.N_LAYER == 3 and module.METADATA["glm4moe.block_count"] == 4
    unread = {t.name for t in ir.tensors if not t.read}
    assert unread == {name for name in module.TENSORS if name.startswith("blk.3.")}
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.ffn_up_shexp.weight", "blk.3.attn_q.weight"} <= unread


def test_router_shared_expert_and_scale(loaded):
    ir, module = loaded.ir, loaded.module
    moe = ir.layers[1].mlp
    assert ir.layers[0].mlp.router is None and moe.router.gating is Gating.SIGMOID
    assert moe.router.normalize and moe.router.weight_scale == 2.5 and moe.router.selection_bias
    assert moe.shared.n_ff == module.N_FF_SHARED == 128 and module.EXPERT_WEIGHT_SCALE == 2.5
    assert module.MOE_LAYERS == (False, True, True)


def test_the_layer_output_is_routed_plus_shared(loaded):
    """Per expert layer: the scaled, renormalized weights of the experts picked by the biased scores, and the
    FFN output the routed sum plus the shared expert (taps named as llama.cpp names them)."""
    from alchemist.harness.validate import tap_values

    taps = tap_values(loaded.engine("c", 64), PROMPT)
    changed = 0
    for il in (1, 2):
        scores = taps[f"ffn_moe_probs-{il}"].reshape(len(PROMPT), -1)
        chosen = taps[f"ffn_moe_topk-{il}"].reshape(len(PROMPT), -1)
        changed += int(np.any(chosen != np.argsort(-scores, axis=-1, kind="stable")[:, :2]))
        picked = np.take_along_axis(scores, chosen, axis=-1)
        np.testing.assert_allclose(
            taps[f"ffn_moe_weights_scaled-{il}"].reshape(len(PROMPT), -1),
            2.5 * picked / picked.sum(-1, keepdims=True),
            rtol=1e-6,
        )
        np.testing.assert_allclose(
            taps[f"ffn_out-{il}"], taps[f"ffn_moe_out-{il}"] + taps[f"ffn_shexp_out-{il}"], rtol=1e-6, atol=1e-7
        )
    assert changed >= 1  # the selection bias changes some token's experts


@pytest.mark.parametrize(
    "weight, first",
    [("blk.2.ffn_down_shexp.weight", "ffn_shexp_out-2"), ("blk.1.exp_probs_b.bias", "ffn_moe_probs_biased-1")],
)
def test_diff_names_the_shared_expert_or_the_biased_choice(tmp_path, perturbed_weight, weight, first):
    """A perturbed shared expert or selection bias: `alchemist diff` names that op, under llama.cpp's name."""
    import alchemist.harness.validate as validate_mod
    from alchemist.fixtures import write_fixture

    pytest.importorskip("llama_cpp")
    path = str(write_fixture(tmp_path / "m.gguf", "glm4moe"))
    perturbed_weight(weight, 1.05)
    diff = validate_mod.diff_model(path, "c", PROMPT[:6])
    assert diff["first_divergence"] == first


def test_inspect_describes_each_ffn_kind_and_the_kernels(loaded):
    import dataclasses

    from alchemist.cli import _kernel_line, describe_components

    text = "\n".join(describe_components(loaded.ir))
    assert "gated, silu, ffn 512 (layers [0])" in text
    assert "4 experts, top-2 by sigmoid, selection bias, weights renormalized x2.5, shared expert ffn 128" in text
    assert "multi-token-prediction layers [3]: loaded, not applied" in text
    tensors = list(loaded.ir.tensors)
    tensors[1] = dataclasses.replace(tensors[1], ggml_type="IQ4_XS")
    tensors[2] = dataclasses.replace(tensors[2], ggml_type="NVFP4")
    line = _kernel_line(dataclasses.replace(loaded.ir, tensors=tuple(tensors)))
    assert line == ["kernels       IQ4_XS, NVFP4 multiplied in their GGUF blocks"]


def test_more_prediction_layers_than_blocks_is_refused_by_name(tmp_path):
    from alchemist.arch import build_model_ir
    from alchemist.errors import GGUFError
    from alchemist.fixtures import FixtureConfig, write_fixture
    from alchemist.gguf_io import read_gguf

    config = FixtureConfig(arch="glm4moe", metadata=(("nextn_predict_layers", 4),))
    path = write_fixture(tmp_path / "m.gguf", "glm4moe", config=config)
    with pytest.raises(GGUFError, match="glm4moe.nextn_predict_layers.*must be below block_count 4, got 4"):
        build_model_ir(read_gguf(path))
