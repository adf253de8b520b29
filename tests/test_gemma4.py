"""gemma4: heads of their own sizes per layer kind, proportional RoPE on the global layers, KV sharing, gated
per-layer inputs and output scales (the fixture's validation against llama.cpp, layer by layer, is in
tests/test_validation.py; its slot engine in tests/test_serving_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from alchemist.fixtures import write_fixture
    from alchemist.harness.validate import load_for_validation

    return load_for_validation(str(write_fixture(tmp_path_factory.mktemp("gemma4") / "m.gguf", "gemma4")))


def test_each_layer_caches_rows_of_its_own_heads(loaded):
    """Sliding layers cache 2 KV heads of 32, global ones 1 of 64; the last two layers own no cache and read those
    of layers 2 and 3 (the engine allocates four, of their owners' shapes)."""
    from alchemist.runtime.engine import Engine

    module = loaded.module
    assert module.HEAD_DIM == (32, 32, 32, 64, 32, 64) and module.N_KV_HEAD == (2, 2, 2, 1, 2, 1)
    assert module.ROPE_DIM == module.HEAD_DIM and module.ROPE_FACTOR_LAYERS == (False, False, False, True, False, True)
    assert module.KV_CACHE_OF == (0, 1, 2, 3, 2, 3) and module.N_FF == (512,) * 4 + (1024,) * 2
    engine = Engine(module, loaded.weights_for("c"), backend="c", capacity=16)
    shapes = [tuple(c.get_value(borrow=True).shape) for layer in engine.cache for c in layer]
    assert shapes == [(16, 2, 32)] * 6 + [(16, 1, 64)] * 2


def test_rope_freqs_turn_only_the_global_layers(loaded, tmp_path):
    """Halving rope_freqs changes the keys the global layers (3) rotate, not the sliding layers' (0)."""
    from alchemist.harness.validate import load_for_validation, tap_values

    before = tap_values(loaded.engine("c", 64), PROMPT[:6])
    halved = load_for_validation(loaded.path)
    weights = halved.weights_for("c")
    weights["rope_freqs.weight"] = weights["rope_freqs.weight"] / np.float32(2)
    after = tap_values(halved.engine("c", 64), PROMPT[:6])
    assert np.array_equal(before["Kcur_pos-0"], after["Kcur_pos-0"])
    assert not np.allclose(before["Kcur_pos-3"], after["Kcur_pos-3"])


def test_global_layers_without_attn_v_take_their_values_from_their_keys(tmp_path):
    """gemma4:k_eq_v (the 31B's layout): the global layers have no attn_v, and their values are their keys'
    projection (Vcur is Kcur, before the key norm); the sliding layers' are their own. Against llama.cpp: the
    fixture's validation in tests/test_validation.py."""
    from alchemist.fixtures import write_fixture
    from alchemist.harness.validate import load_for_validation, tap_values

    loaded = load_for_validation(str(write_fixture(tmp_path / "m.gguf", "gemma4:k_eq_v")))
    assert loaded.module.VALUES_FROM_KEYS == (False, False, False, True, False, True)
    assert "blk.3.attn_v.weight" not in loaded.module.TENSORS and "blk.2.attn_v.weight" in loaded.module.TENSORS
    taps = tap_values(loaded.engine("c", 64), PROMPT[:6])
    np.testing.assert_array_equal(taps["Vcur-3"], taps["Kcur-3"])
    assert not np.allclose(taps["Vcur-2"], taps["Kcur-2"])


def test_diff_names_the_per_layer_gate(tmp_path, perturbed_weight):
    """A perturbed per-layer input norm of layer 1 (ours only; the gate and projection before it are scaled away by
    that RMS norm): the diff names the op that reads it."""
    from alchemist.fixtures import write_fixture
    from alchemist.harness import validate as validate_mod

    path = str(write_fixture(tmp_path / "m.gguf", "gemma4"))
    perturbed_weight("blk.1.post_norm.weight", 1.05)
    diff = validate_mod.diff_model(path, "c", PROMPT[:6])
    assert diff["first_divergence"] == "per_layer_embd_out-1"


def test_kv_sharing_layers_may_go_without_their_keys_and_values(tmp_path):
    """llama.cpp does not require attn_k, attn_v and attn_k_norm of the layers that read another layer's cache: a
    file without them binds to the same layers (they were never applied); a layer that writes a cache without its
    attn_k is refused by name."""
    from alchemist.arch import build_model_ir
    from alchemist.errors import UnsupportedModelError
    from alchemist.fixtures import write_fixture
    from alchemist.gguf_io import read_gguf

    path = write_fixture(tmp_path / "m.gguf", "gemma4")
    full = build_model_ir(read_gguf(path))
    facts = read_gguf(path)
    for il in (4, 5):
        for suffix in ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight"):
            del facts.tensors[f"blk.{il}.{suffix}"]
    assert build_model_ir(facts).layers == full.layers
    facts = read_gguf(path)
    del facts.tensors["blk.2.attn_k.weight"]
    with pytest.raises(UnsupportedModelError, match="layer 2 writes a KV cache but has no blk.2.attn_k.weight"):
        build_model_ir(facts)


def test_experts_with_gate_and_up_apart_compute_as_the_stacked_ones(tmp_path):
    """gemma4:moe (the 26B-A4B's layout) stacks each expert's gate and up as [gate | up] in ffn_gate_up_exps; the
    same experts with ffn_gate_exps and ffn_up_exps apart compute the same, every layer as llama.cpp does. Each
    file needs one of the two forms (the fixture's own validation is in tests/test_validation.py)."""
    from gguf_copy import rewrite_gguf

    from alchemist.arch import build_model_ir
    from alchemist.errors import UnsupportedModelError
    from alchemist.fixtures import write_fixture
    from alchemist.gguf_io import read_gguf
    from alchemist.harness import LlamaCppOracle
    from alchemist.harness.validate import layer_nmse, load_for_validation, tap_values

    fused = write_fixture(tmp_path / "fused.gguf", "gemma4:moe")
    facts = read_gguf(fused)
    n_ff = build_model_ir(facts).layers[0].mlp.n_ff
    stacks = [f"blk.{il}.ffn_gate_up_exps.weight" for il in range(6)]
    split = {}
    for name in stacks:
        stack = facts.tensor_bytes(name).view(np.float32).reshape(facts.tensors[name].shape)  # [gate | up]
        split[name.replace("gate_up", "gate")] = np.ascontiguousarray(stack[:, :n_ff])
        split[name.replace("gate_up", "up")] = np.ascontiguousarray(stack[:, n_ff:])
    apart = rewrite_gguf(fused, tmp_path / "apart.gguf", drop=set(stacks), extra=split)
    stacked_model, apart_model = load_for_validation(str(fused)), load_for_validation(str(apart))
    assert "blk.0.ffn_gate_up_exps.weight" not in apart_model.module.TENSORS
    stacked, separate = (tap_values(m.engine("c", 64), PROMPT[:6]) for m in (stacked_model, apart_model))
    for name in ("ffn_moe_geglu-0", "ffn_moe-3", "l_out-5"):
        np.testing.assert_array_equal(separate[name], stacked[name])
    with LlamaCppOracle(str(apart), n_ctx=64, n_threads=1) as oracle:
        compared = layer_nmse(apart_model.engine("c", 64), oracle, PROMPT[:6])
    assert compared["first_divergence"] is None and "ffn_moe_geglu-0" in compared["nmse"], compared

    neither = read_gguf(apart)
    for il in range(6):
        del neither.tensors[f"blk.{il}.ffn_gate_exps.weight"]
    with pytest.raises(UnsupportedModelError, match="layer 0: its experts need ffn_gate_up_exps.weight, or"):
        build_model_ir(neither)


def test_diff_names_the_router_of_experts_beside_the_mlp(tmp_path, perturbed_weight):
    """A perturbed router input scale of layer 1 (ours only): the diff names the router's logits."""
    from alchemist.fixtures import write_fixture
    from alchemist.harness import validate as validate_mod

    path = str(write_fixture(tmp_path / "m.gguf", "gemma4:moe"))
    perturbed_weight("blk.1.ffn_gate_inp.scale", 1.05)
    diff = validate_mod.diff_model(path, "c", PROMPT[:6])
    assert diff["first_divergence"] == "ffn_moe_logits-1"


def test_gemma4_composes_as_a_graph(tmp_path, composes_as_a_graph):
    """alchemist.symbolic over gemma4: log p(ids) equals the engine's, and its gradient reaches a KV-sharing layer's
    per-layer input gate through the shared caches and the output scales."""
    from alchemist.fixtures import write_fixture

    composes_as_a_graph(write_fixture(tmp_path / "m.gguf", "gemma4"), "blk.4.inp_gate.weight", PROMPT[:9])
