"""lfm2moe: LFM2's hybrid with leading dense layers, then experts chosen by sigmoid scores plus a selection bias
(the fixture's validation against llama.cpp, layer by layer, is in tests/test_validation.py)."""

from __future__ import annotations

import numpy as np
import pytest

from alchemist.arch import build_model_ir
from alchemist.errors import GGUFError
from alchemist.fixtures import FixtureConfig, write_fixture
from alchemist.gguf_io import read_gguf
from alchemist.ir import Gating

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from alchemist.harness.validate import load_for_validation

    return load_for_validation(str(write_fixture(tmp_path_factory.mktemp("lfm2moe") / "m.gguf", "lfm2moe")))


def test_leading_dense_layers_then_experts(loaded):
    ir, module = loaded.ir, loaded.module
    assert [lay.mlp.router is not None for lay in ir.layers] == [False, True, True, True]
    router = ir.layers[1].mlp.router
    assert router.gating is Gating.SIGMOID and router.normalize and router.selection_bias == "exp_probs_b.bias"
    assert ir.layers[0].mlp.n_ff == module.N_FF and ir.layers[1].mlp.n_ff == module.N_FF_EXP == 128
    assert module.MOE_LAYERS == (False, True, True, True) and module.CONV_LAYERS == (True, False, False, True)
    assert "blk.0.ffn_gate.weight" in module.TENSORS and "blk.0.ffn_gate_inp.weight" not in module.TENSORS
    assert "blk.1.exp_probs_b.bias" in module.TENSORS and "blk.1.ffn_gate.weight" not in module.TENSORS


def test_the_selection_bias_chooses_and_the_unbiased_scores_weigh(loaded):
    """The experts are the top 2 of score + bias (the fixture's bias changes the choice of some tokens), and their
    weights the unbiased scores of those experts, renormalized."""
    from alchemist.harness.validate import tap_values

    taps = tap_values(loaded.engine("c", 64), PROMPT)
    changed = 0
    for il in (1, 2, 3):
        scores, biased = taps[f"ffn_moe_probs-{il}"].reshape(len(PROMPT), -1), taps[f"ffn_moe_probs_biased-{il}"]
        chosen = taps[f"ffn_moe_topk-{il}"].reshape(len(PROMPT), -1)
        np.testing.assert_array_equal(
            chosen, np.argsort(-biased.reshape(len(PROMPT), -1), axis=-1, kind="stable")[:, :2]
        )
        changed += int(np.any(chosen != np.argsort(-scores, axis=-1, kind="stable")[:, :2]))
        picked = np.take_along_axis(scores, chosen, axis=-1)
        np.testing.assert_allclose(
            taps[f"ffn_moe_weights_norm-{il}"].reshape(len(PROMPT), -1),
            picked / picked.sum(-1, keepdims=True),
            rtol=1e-6,
        )
    assert changed >= 1


def test_an_unknown_gating_function_is_refused_by_name(tmp_path):
    path = write_fixture(
        tmp_path / "m.gguf", "lfm2moe", config=FixtureConfig(arch="lfm2moe", metadata=(("expert_gating_func", 9),))
    )
    with pytest.raises(GGUFError, match="lfm2moe.expert_gating_func.*unknown gating function 9"):
        build_model_ir(read_gguf(path))
