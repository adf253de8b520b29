"""deepseek2 (DeepSeek-V2/V3): multi-head latent attention in llama.cpp's absorbed form, and group-limited
expert routing (the fixtures' validation against llama.cpp, layer by layer, is in tests/test_validation.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from alchemist.fixtures import write_fixture
    from alchemist.harness.validate import load_for_validation

    return load_for_validation(str(write_fixture(tmp_path_factory.mktemp("deepseek2") / "m.gguf", "deepseek2")))


@pytest.fixture(scope="module")
def taps(loaded):
    from alchemist.harness.validate import tap_values

    return tap_values(loaded.engine("c", 64), PROMPT)


def test_the_cache_is_one_latent_row_per_position(loaded):
    """Keys and values of all four heads come from one cached row of [latent 256 | RoPE 32] per position: the
    engine allocates that and nothing else (multi-head attention of the same heads would cache 2·4·96)."""
    from alchemist.runtime.engine import Engine

    module = loaded.module
    assert module.LAYER_CACHES == ((("kv_latent", (1, 288)),),) * 3
    assert (module.N_KV_HEAD, module.HEAD_DIM, module.KV_LORA_RANK) == (1, 288, 256)
    engine = Engine(module, loaded.weights_for("c"), backend="c", capacity=32)
    shapes = [tuple(c.get_value(borrow=True).shape) for layer in engine.cache for c in layer]
    assert shapes == [(32, 1, 288)] * 3
    assert module.SCORE_SCALE == pytest.approx(1 / np.sqrt(96), rel=1e-7)  # the head size before absorption


def test_queries_reach_the_latent_through_each_heads_matrix(loaded, taps):
    """Kcur is [normed latent | rotated k_pe]; each head's q_nope times its attn_k_b gives its latent query."""
    w = loaded.weights_for("c")
    n = len(PROMPT)
    for il in range(3):
        k = taps[f"Kcur-{il}"].reshape(n, 288)
        np.testing.assert_array_equal(k[:, :256], taps[f"kv_cmpr-{il}"].reshape(n, 256))
        np.testing.assert_array_equal(k[:, 256:], taps[f"k_pe-{il}"].reshape(n, 32))
        q_nope = taps[f"q_nope-{il}"].reshape(n, 4, 64)
        k_b = np.asarray(w[f"blk.{il}.attn_k_b.weight"])  # (heads, latent, nope)
        expected = np.einsum("thd,hld->thl", q_nope.astype(np.float64), k_b.astype(np.float64))
        got = taps[f"q_nope_absorbed_perm-{il}"].reshape(n, 4, 256)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _best_groups(selection: np.ndarray, n_group: int, n_used: int) -> np.ndarray:
    """DeepSeek-V3's group choice: per token, the n_used groups whose two best scores sum highest."""
    grouped = selection.reshape(len(selection), n_group, -1)
    score = np.sort(grouped, axis=-1)[:, :, -2:].sum(-1)
    return np.argsort(-score, axis=-1, kind="stable")[:, :n_used]


def test_experts_are_chosen_within_the_best_groups(loaded, taps):
    """8 experts in 4 groups, 2 groups per token: every chosen expert is in one of the token's two best groups,
    the choice is the top 2 of those groups' biased scores, and the groups change some token's choice."""
    module = loaded.module
    assert (module.N_EXPERT_GROUP, module.N_EXPERT_GROUP_USED) == (4, 2)
    limited = 0
    for il in (1, 2):
        selection = taps[f"ffn_moe_probs_biased-{il}"].reshape(len(PROMPT), 8)
        chosen = taps[f"ffn_moe_topk-{il}"].reshape(len(PROMPT), 2)
        groups = _best_groups(selection, 4, 2)
        allowed = np.zeros_like(selection, dtype=bool)
        for t, g in enumerate(groups):
            for group in g:
                allowed[t, group * 2 : group * 2 + 2] = True
        masked = np.where(allowed, selection, -np.inf)
        np.testing.assert_array_equal(chosen, np.argsort(-masked, axis=-1, kind="stable")[:, :2])
        np.testing.assert_array_equal(taps[f"ffn_moe_probs_masked-{il}"].reshape(len(PROMPT), 8), masked)
        limited += int(np.any(chosen != np.argsort(-selection, axis=-1, kind="stable")[:, :2]))
    assert limited >= 1


@pytest.mark.parametrize(
    "weight, first",
    [
        ("blk.1.attn_k_b.weight", "q_nope_absorbed_perm-1"),  # the latent projection of the queries
        ("blk.1.attn_kv_a_norm.weight", "kv_cmpr-1"),  # the cached latent
        ("blk.1.attn_v_b.weight", "kqv_out-1"),  # the heads' values out of the latent
        ("blk.2.ffn_gate_inp.weight", "ffn_moe_logits-2"),  # the router
    ],
)
def test_diff_names_the_latent_projection_or_the_router(tmp_path, perturbed_weight, weight, first):
    import alchemist.harness.validate as validate_mod
    from alchemist.fixtures import write_fixture

    pytest.importorskip("llama_cpp")
    path = str(write_fixture(tmp_path / "m.gguf", "deepseek2"))
    perturbed_weight(weight, 1.05)
    diff = validate_mod.diff_model(path, "c", PROMPT[:6])
    assert diff["first_divergence"] == first


def test_inspect_describes_the_latent_row_and_the_groups(loaded):
    from alchemist.cli import describe_components

    text = "\n".join(describe_components(loaded.ir))
    assert "queries by low rank 256 (attn_q_a, norm, attn_q_b), per head 64 + 32 RoPE dims" in text
    assert "one row of 256 latent + 32 RoPE dims per position (3.4 KiB per position, all layers)" in text
    assert "8 experts, top-2 by sigmoid, selection bias, within the best 2 of 4 groups" in text


def _facts(tmp_path, metadata=(), drop=()):
    from alchemist.fixtures import FixtureConfig, write_fixture
    from alchemist.gguf_io import read_gguf

    config = FixtureConfig(arch="deepseek2", metadata=tuple(metadata))
    facts = read_gguf(write_fixture(tmp_path / "m.gguf", "deepseek2", config=config))
    return dataclasses.replace(facts, metadata={k: v for k, v in facts.metadata.items() if k not in drop})


def test_a_file_from_before_the_absorbed_form_is_refused_by_name(tmp_path):
    from alchemist.arch import build_model_ir
    from alchemist.errors import UnsupportedModelError

    facts = _facts(tmp_path, drop=("deepseek2.attention.key_length_mla",))
    with pytest.raises(UnsupportedModelError, match="deepseek2.attention.key_length_mla is missing.*attn_kv_b"):
        build_model_ir(facts)


@pytest.mark.parametrize(
    "metadata, match",
    [
        ((("attention.key_length", 300),), "deepseek2.attention.key_length.*300, not kv_lora_rank 256"),
        ((("expert_group_count", 3),), "deepseek2.expert_group_count.*3 groups do not split 8 experts"),
        ((("expert_group_used_count", 5),), "deepseek2.expert_group_used_count.*5 of 4 groups"),
    ],
)
def test_inconsistent_latent_sizes_and_groups_are_refused_by_name(tmp_path, metadata, match):
    from alchemist.arch import build_model_ir
    from alchemist.errors import GGUFError

    with pytest.raises(GGUFError, match=match):
        build_model_ir(_facts(tmp_path, metadata))


def test_yarn_scales_the_scores_and_keeps_the_rotation_magnitude(tmp_path):
    """DeepSeek's YaRN: q·k scaled by (1 + 0.1 · mscale_all_dim · ln factor)² / sqrt(key_length_mla), RoPE's
    cos/sin at magnitude 1 (deepseek2.cpp hands ggml_rope_ext the inverse of ggml's own factor); the fixture's
    validation against llama.cpp is in tests/test_validation.py."""
    from alchemist.arch import build_model_ir
    from alchemist.fixtures import write_fixture
    from alchemist.gguf_io import read_gguf

    att = build_model_ir(read_gguf(write_fixture(tmp_path / "m.gguf", "deepseek2:yarn"))).layers[0].attention
    assert att.score_scale == pytest.approx((1 + 0.1 * np.log(40)) ** 2 / np.sqrt(96), rel=1e-6)
    assert att.rope.attn_factor == pytest.approx(1.0, abs=1e-6) and att.rope.scaling.value == "yarn"


def test_linear_rope_scaling_is_refused_by_name(tmp_path):
    from alchemist.arch import build_model_ir
    from alchemist.errors import UnsupportedModelError

    facts = _facts(tmp_path, (("rope.scaling.type", "linear"), ("rope.scaling.factor", 4.0)))
    with pytest.raises(UnsupportedModelError, match="deepseek2 with linear RoPE scaling"):
        build_model_ir(facts)


def test_latent_attention_composes_as_a_graph(tmp_path, composes_as_a_graph):
    """alchemist.symbolic over deepseek2: log p(ids) equals the engine's, and its gradient reaches each head's
    matrix into the latent (attn_k_b) through the absorbed attention and the group-limited routing."""
    from alchemist.fixtures import write_fixture

    composes_as_a_graph(write_fixture(tmp_path / "m.gguf", "deepseek2"), "blk.1.attn_k_b.weight", PROMPT[:9])
