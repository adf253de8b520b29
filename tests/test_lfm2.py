"""lfm2, the hybrid family: per-layer token mixers from metadata, the short-convolution component against a
numpy rendering of llama.cpp's ssm_conv, its conv cache under the prefill/decode contract (against
llama.cpp), and `alchemist diff` naming the convolution when its filter is perturbed."""

from __future__ import annotations

import numpy as np
import pytest

from alchemist.arch import build_model_ir
from alchemist.errors import UnsupportedModelError
from alchemist.fixtures import FixtureConfig, write_fixture
from alchemist.gguf_io import read_gguf

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17]


@pytest.fixture(scope="module")
def lfm2_path(fixture_files):
    return str(fixture_files("lfm2", "F32"))


@pytest.fixture(scope="module")
def lfm2_loaded(lfm2_path):
    from alchemist.harness.validate import load_for_validation

    return load_for_validation(lfm2_path)


def test_layer_mixers_come_from_the_per_layer_kv_head_counts(lfm2_loaded):
    ir = lfm2_loaded.ir
    assert [lay.conv is not None for lay in ir.layers] == [True, False, False, True]
    assert [lay.attention is None for lay in ir.layers] == [True, False, False, True]
    assert [lay.index for lay in ir.attention_layers] == [1, 2]
    assert ir.layers[0].conv.kernel == 3 and ir.attention_layers[0].attention.n_kv_head == 2
    names = {t.name for t in ir.tensors}
    assert "blk.0.shortconv.conv.weight" in names and "blk.0.attn_q.weight" not in names
    assert "blk.1.attn_q_norm.weight" in names and "blk.1.shortconv.in_proj.weight" not in names
    assert ir.tensor("blk.3.shortconv.conv.weight").shape == (256, 3)
    assert ir.output.norm.weight == "token_embd_norm.weight"
    assert ir.layer_caches()[:2] == ((("conv", (256,)),), (("k", (2, 64)), ("v", (2, 64))))
    module = lfm2_loaded.module
    assert module.CONV_LAYERS == (True, False, False, True) and module.CONV_KERNEL == 3
    assert module.LAYER_CACHES == ir.layer_caches()


def test_fields_added_for_hybrids_leave_other_irs_unchanged(tmp_path):
    ir = build_model_ir(read_gguf(write_fixture(tmp_path / "llama.gguf", "llama")))
    d = ir.to_dict()
    assert "tap_names" not in d and all("conv" not in lay for lay in d["layers"])


def test_attention_layers_with_different_kv_heads_are_refused(tmp_path):
    cfg = FixtureConfig("lfm2", metadata=(("attention.head_count_kv", (0, 2, 1, 0)),))
    path = write_fixture(tmp_path / "bad.gguf", "lfm2", config=cfg)
    with pytest.raises(UnsupportedModelError, match=r"attention layers with different KV head counts \[1, 2\]"):
        build_model_ir(read_gguf(path))


def _ssm_conv(bx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """llama.cpp's causal short conv of one sequence from a zero state: P = [0 (L-1 columns) | bx.T],
    out[t, d] = sum_i P[d, t + i] w[d, i]."""
    L = w.shape[1]
    padded = np.concatenate([np.zeros((L - 1, bx.shape[1]), np.float32), bx])
    return np.stack([(padded[t : t + L] * w.T).sum(axis=0) for t in range(bx.shape[0])])


def test_short_conv_matches_ssm_conv_across_steps(lfm2_loaded):
    """Two steps over one cache (5 tokens, then 2) give what one causal conv over all 7 gives."""
    import pytensor
    import pytensor.tensor as pt

    module, il = lfm2_loaded.module, 3
    w = {k: pt.constant(v) for k, v in lfm2_loaded.weights_for("c", quantized=False).items() if f"blk.{il}." in k}
    d = module.N_EMBD
    x = pt.matrix("x", dtype="float32")
    positions = pt.vector("positions", dtype="int64")
    cache = pt.matrix("cache", dtype="float32")
    taps = {}
    out, new_cache = module.short_conv(module.EXACT, w, il, x, positions, cache, taps)
    fn = pytensor.function([x, positions, cache], [out, new_cache, taps["model.layers.{}.conv.conv-3"]])

    rng = np.random.default_rng(1)
    xs = rng.standard_normal((7, d)).astype(np.float32)
    state = np.full((16, d), np.nan, np.float32)  # unwritten rows must never be read
    out1, state, conv1 = fn(xs[:5], np.arange(5), state)
    out2, state, conv2 = fn(xs[5:], np.arange(5, 7), state)

    params = lfm2_loaded.weights_for("c", quantized=False)
    bcx = xs @ params[f"blk.{il}.shortconv.in_proj.weight"].T
    b, c, xx = bcx[:, :d], bcx[:, d : 2 * d], bcx[:, 2 * d :]
    conv = _ssm_conv(b * xx, params[f"blk.{il}.shortconv.conv.weight"])
    want = (c * conv) @ params[f"blk.{il}.shortconv.out_proj.weight"].T
    np.testing.assert_allclose(np.concatenate([conv1, conv2]), conv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([out1, out2]), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state[:7], b * xx, rtol=1e-5, atol=1e-5)  # the cache: B·X per position


def _nmse(a, b) -> float:
    return float(np.sum((np.asarray(a, np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


def test_conv_cache_follows_the_prefill_decode_contract(lfm2_path, lfm2_loaded):
    """Against llama.cpp: a whole prompt, a prompt in two prefills then one token at a time through the caches,
    and a new prompt from position 0 over the used caches."""
    from alchemist.harness.oracle import LlamaCppOracle
    from alchemist.runtime.engine import Engine

    engine = Engine(lfm2_loaded.module, lfm2_loaded.weights_for("c"), "c", 64)
    assert [tuple(sv.name for sv in layer) for layer in engine.cache] == [
        ("conv_cache.0",),
        ("k_cache.1", "v_cache.1"),
        ("k_cache.2", "v_cache.2"),
        ("conv_cache.3",),
    ]
    assert engine.cache[0][0].get_value().shape == (64, 256)
    other = [5, 77, 300, 12, 9, 400, 33, 21]
    with LlamaCppOracle(lfm2_path, n_ctx=64, n_threads=1) as oracle:
        ref, ref_other = oracle.logits(PROMPT), oracle.logits(other)
    assert _nmse(engine.run(PROMPT, 0, all_logits=True), ref) < 1e-9
    steps = [engine.run(PROMPT[:4], 0, all_logits=True), engine.run(PROMPT[4:7], 4, all_logits=True)]
    steps += [engine.run([t], 7 + i, all_logits=True) for i, t in enumerate(PROMPT[7:])]
    assert _nmse(np.concatenate(steps), ref) < 1e-9
    assert _nmse(engine.run(other, 0, all_logits=True), ref_other) < 1e-9


def test_diff_names_the_convolution_when_its_filter_is_perturbed(lfm2_path, perturbed_weight):
    import alchemist.harness.validate as validate_mod

    perturbed_weight("blk.3.shortconv.conv.weight", 1.01)
    diff = validate_mod.diff_model(lfm2_path, "c", PROMPT[:6])
    assert diff["first_divergence"] == "model.layers.{}.conv.conv-3"
    rows = dict(diff["rows"])
    assert rows["model.layers.{}.conv.in_proj-3"] <= 1e-6 < rows["model.layers.{}.conv.conv-3"]


def test_slot_engine_keeps_a_conv_cache_per_slot(lfm2_loaded):
    """Two prompts prefilled in chunks into two slots (one a prefix copy of the other), then decoded together:
    every logit row equals the single-sequence engine's at that position."""
    from alchemist.runtime.engine import Engine
    from alchemist.runtime.slot_engine import SlotEngine

    weights = lfm2_loaded.weights_for("c")
    single = Engine(lfm2_loaded.module, weights, "c", 32)
    slots = SlotEngine(Engine(lfm2_loaded.module, weights, "c", 32), n_slots=2, chunk=4, decode_buckets=(2,))
    assert slots.cache[0][0].name == "conv_slots.0" and slots.cache[0][0].type.shape == (3, 32, 256)
    a, b = PROMPT[:9], PROMPT[:4] + [5, 77, 300]
    for lo, hi in slots.chunk_plan(len(a)):
        slots.prefill(0, a[lo:hi], lo)
    shared = slots.reusable_prefix(len(a), 4, len(b))
    assert shared == 4  # the first chunk: its conv rows are copied with the KV rows
    slots.copy_prefix(0, 1, shared)
    got_b = slots.prefill(1, b[4:], 4)
    got = slots.decode([0, 1], [17, 64], [len(a), len(b)])
    ref_a, ref_b = single.run(a + [17], 0, all_logits=True), single.run(b + [64], 0, all_logits=True)
    assert _nmse(got_b, ref_b[len(b) - 1]) < 1e-9
    assert _nmse(got[0], ref_a[-1]) < 1e-9 and _nmse(got[1], ref_b[-1]) < 1e-9
