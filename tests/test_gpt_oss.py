"""gpt-oss: attention sinks and swiglu_oai against numpy references written from llama.cpp's CPU ops, the family's
IR, `alchemist diff` naming the router / expert / sink op when a fixture weight is perturbed, MXFP4 experts
through the kernels, the auditor on its modules (no per-family auditor code) and the serving slots."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from alchemist.pytensor_ext.host import configure_pytensor

configure_pytensor()

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

from alchemist.runtime.backends import get_mode  # noqa: E402
from slot_runs import assert_slots_equal_engine  # noqa: E402

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]
CONTEXT = 64


@pytest.fixture(scope="session")
def oss(tiny_module):
    """(generated module, F32 gguf path) of the gpt-oss fixture."""
    return tiny_module("gpt-oss")


# ---------------------------------------------------------------------------------------------------
# the math, against numpy written from ggml-cpu's ops
# ---------------------------------------------------------------------------------------------------
def sink_attention_reference(q, keys, values, q_pos, k_pos, window, sinks, scale, group):
    """ggml_soft_max_ext with sinks (ops.cpp), float64: per query head h, s_j = scale · q·k_j (masked -inf), M the
    max of the s_j and sink[h], p_j = exp(s_j - M) / (Σ exp(s_j - M) + exp(sink[h] - M)), out = Σ p_j v_j."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    n_tok, n_head, head_dim = q.shape
    out = np.zeros((n_tok, n_head * head_dim))
    for t in range(n_tok):
        visible = (k_pos <= q_pos[t]) & ((q_pos[t] - k_pos < window) if window else True)
        for h in range(n_head):
            s = np.where(visible, keys[:, h // group] @ q[t, h] * scale, -np.inf)
            m = max(s.max(), sinks[h])
            e = np.exp(s - m)
            p = e / (e.sum() + np.exp(sinks[h] - m))
            out[t, h * head_dim : (h + 1) * head_dim] = p @ values[:, h // group]
    return out


@pytest.fixture(scope="session")
def sink_attention(oss):
    """The module's causal_attention (with sinks) compiled for 6 queries at positions 4..9 over 10 keys."""
    module = oss[0]
    n_tok, n_keys = 6, 10
    q = pt.tensor("q", dtype="float32", shape=(n_tok, module.N_HEAD, module.HEAD_DIM))
    keys = pt.tensor("k", dtype="float32", shape=(1, n_keys, module.N_KV_HEAD, module.HEAD_DIM))
    values = pt.tensor("v", dtype="float32", shape=(1, n_keys, module.N_KV_HEAD, module.HEAD_DIM))
    sinks = pt.vector("sinks", dtype="float32", shape=(module.N_HEAD,))
    q_pos = np.arange(4, 10, dtype=np.int64)
    k_pos = np.arange(n_keys, dtype=np.int64)
    fns = {}
    for window in (0, 4):
        out = module.causal_attention(
            q, keys, values, pt.as_tensor(q_pos[None]), pt.as_tensor(k_pos[None]), window, sinks
        )
        fns[window] = pytensor.function([q, keys, values, sinks], out, mode=get_mode("c"))
    return module, fns, q_pos, k_pos


@pytest.mark.parametrize("window", (0, 4))
def test_attention_sinks_match_numpy(sink_attention, window):
    module, fns, q_pos, k_pos = sink_attention
    rng = np.random.default_rng(1)
    q = rng.standard_normal((len(q_pos), module.N_HEAD, module.HEAD_DIM)).astype(np.float32)
    keys = rng.standard_normal((1, len(k_pos), module.N_KV_HEAD, module.HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal((1, len(k_pos), module.N_KV_HEAD, module.HEAD_DIM)).astype(np.float32)
    args = (q, keys[0], values[0], q_pos, k_pos, window)
    ref = dict(scale=module.SCORE_SCALE, group=module.GROUP_SIZE)
    # sinks of the scores' size, one that takes almost everything (100: exp overflows float32 unless the max
    # includes the sink) and one that takes nothing (-1e30: plain softmax)
    sinks = np.array([0.5, -1.0, 100.0, -1e30], np.float32)
    got = fns[window](q, keys, values, sinks)
    want = sink_attention_reference(*args, sinks=sinks.astype(np.float64), **ref)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    hd = module.HEAD_DIM
    assert np.abs(got[:, 2 * hd : 3 * hd]).max() < 1e-30  # head 2: the sink takes all, and it adds no value
    no_sink = sink_attention_reference(*args, sinks=np.full(4, -np.inf), **ref)
    np.testing.assert_allclose(got[:, 3 * hd :], no_sink[:, 3 * hd :], rtol=1e-5, atol=1e-6)
    # the sink really is in the denominator: head 0's rows are the plain softmax's, scaled down
    assert np.all(np.abs(got[:, :hd]) <= np.abs(no_sink[:, :hd]) + 1e-6) and not np.allclose(
        got[:, :hd], no_sink[:, :hd]
    )


def swiglu_oai_reference(gate, up):
    """ggml_compute_forward_swiglu_oai_f32: x = min(g, 7), y = clamp(u, -7, 7), x / (1 + exp(alpha · -x)) · (y+1)."""
    x = np.minimum(gate, np.float32(7.0))
    y = np.clip(up, np.float32(-7.0), np.float32(7.0))
    return (x / (np.float32(1.0) + np.exp(np.float32(1.702) * -x))) * (y + np.float32(1.0))


@pytest.mark.parametrize("backend", ("c", "numba"))
def test_swiglu_oai_matches_numpy_with_clamps_hit(oss, backend):
    pytest.importorskip({"c": "pytensor", "numba": "numba"}[backend])
    module = oss[0]
    g, u = pt.matrix("g", dtype="float32"), pt.matrix("u", dtype="float32")
    fn = pytensor.function([g, u], module.swiglu_oai(g, u), mode=get_mode(backend))
    rng = np.random.default_rng(2)
    gate = rng.uniform(-12, 12, (64, 96)).astype(np.float32)
    up = rng.uniform(-12, 12, (64, 96)).astype(np.float32)
    gate[0, :4], up[0, :4] = [7.0, -7.0, 30.0, -30.0], [7.0, -7.0, 30.0, -30.0]
    assert (gate > 7).mean() > 0.1 and (np.abs(up) > 7).mean() > 0.2  # every clamp is exercised
    got = fn(gate, up)
    np.testing.assert_allclose(got, swiglu_oai_reference(gate, up), rtol=2e-6, atol=1e-6)
    # the gate is clamped above only, the up projection both ways
    assert got[0, 2] == pytest.approx(swiglu_oai_reference(np.float32(7), np.float32(7)), rel=1e-6)
    assert got[0, 3] == pytest.approx(-30 / (1 + np.exp(1.702 * 30)) * -6, rel=1e-5)


@pytest.mark.parametrize("backend", ("c", "numba"))
def test_mxfp4_expert_kernel(backend):
    """The gathered-experts kernel on MXFP4 stacks (gpt-oss's experts) against dequantize-then-einsum, for the
    shared input of gate/up (T, n_in) and the per-rank input of down (T, K, n_in)."""
    pytest.importorskip({"c": "pytensor", "numba": "numba"}[backend])
    from test_kernels import random_blocks

    from alchemist.kernels import quantized_expert_linear
    from alchemist.kernels.formats import reference_dequantize

    rng = np.random.default_rng(3)
    n_expert, n_out, n_in, k, n_tok = 4, 24, 96, 2, 5
    w = np.stack([random_blocks(rng, "MXFP4", n_out, n_in) for _ in range(n_expert)])
    dense = np.stack([reference_dequantize(b, "MXFP4") for b in w]).astype(np.float64)
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_tok)]).astype(np.int64)
    ws, idv = pt.tensor3("w", dtype="uint8", shape=w.shape), pt.matrix("ids", dtype="int64")
    for shape, spec in (((n_tok, n_in), "ti,tkoi->tko"), ((n_tok, k, n_in), "tki,tkoi->tko")):
        x = rng.standard_normal(shape).astype(np.float32)
        xs = pt.tensor("x", dtype="float32", shape=(None,) * (len(shape) - 1) + (n_in,))
        y = quantized_expert_linear(xs, ws, idv, "MXFP4", n_expert, n_out, n_in)
        got = pytensor.function([xs, ws, idv], y, mode=get_mode(backend))(x, w, ids)
        want = np.einsum(spec, x.astype(np.float64), dense[ids])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ---------------------------------------------------------------------------------------------------
# the family's IR
# ---------------------------------------------------------------------------------------------------
def test_gpt_oss_ir(oss, tiny_gguf):
    from alchemist.arch import build_model_ir
    from alchemist.errors import GGUFError, UnsupportedModelError
    from alchemist.gguf_io import read_gguf
    from alchemist.harness.families import quirks
    from alchemist.ir import Activation, Gating, RopeScaling

    facts = read_gguf(oss[1])
    ir = build_model_ir(facts)
    lay = ir.layers[0]
    att, mlp = lay.attention, lay.mlp
    assert att.sinks == "attn_sinks.weight" and att.q_bias and att.out_bias
    assert [x.attention.sliding_window for x in ir.layers] == [8, 0]  # pattern 2: even layers slide
    assert {x.attention.rope.scaling for x in ir.layers} == {RopeScaling.YARN}
    assert lay.ffn_norm.weight == "post_attention_norm.weight" and lay.attn_post_norm is None
    assert mlp.activation is Activation.SWIGLU_OAI and mlp.gate_bias and mlp.up_bias and mlp.down_bias
    assert mlp.router.gating is Gating.SOFTMAX_WEIGHT and not mlp.router.normalize and mlp.router.bias
    assert not ir.output.tied
    assert "attention sinks" in quirks(ir)
    assert "mixture of experts (8 experts, top-2, softmax_weight router, swiglu_oai)" in quirks(ir)
    assert ir.to_dict()["layers"][0]["attention"]["sinks"] == "attn_sinks.weight"
    # an older family's IR has no "sinks" key: its hash (and its module) are unchanged
    assert "sinks" not in build_model_ir(read_gguf(tiny_gguf("llama"))).to_dict()["layers"][0]["attention"]
    meta = {k: v for k, v in facts.metadata.items() if k != "gpt-oss.attention.sliding_window"}
    with pytest.raises(GGUFError, match=r"gpt-oss\.attention\.sliding_window.*required"):  # as llama.cpp
        build_model_ir(dataclasses.replace(facts, metadata=meta))
    for name in ("output.weight", "blk.1.attn_sinks.weight"):  # never tied; sinks required
        tensors = {k: v for k, v in facts.tensors.items() if k != name}
        with pytest.raises(UnsupportedModelError, match=name.replace(".", r"\.")):
            build_model_ir(dataclasses.replace(facts, tensors=tensors))


# ---------------------------------------------------------------------------------------------------
# against llama.cpp: the layer diff names the op, MXFP4 experts through the kernels
# ---------------------------------------------------------------------------------------------------
def _perturbing(real_loader, name, change):
    def loader(p, **kwargs):
        loaded = real_loader(p, **kwargs)
        real_weights = loaded.weights_for

        def weights_for(*args, **kw):
            weights = dict(real_weights(*args, **kw))
            weights[name] = change(weights[name]).astype(np.float32)
            return weights

        loaded.weights_for = weights_for
        return loaded

    return loader


def test_diff_names_the_router_expert_and_sink_ops(fixture_files, monkeypatch):
    """Every gpt-oss op is compared with llama.cpp's tensor of the same name: a perturbed router bias in layer 1
    makes `alchemist diff` name that router's scores first (llama.cpp's name for the biased logits, which
    SOFTMAX_WEIGHT routes by); an expert bias, that expert product; an
    attention sink, that layer's attention output."""
    import alchemist.harness.validate as validate_mod

    pytest.importorskip("llama_cpp")
    path = str(fixture_files("gpt-oss", "F32"))
    clean = validate_mod.diff_model(path, "c", PROMPT)
    names = [n for n, _ in clean["rows"]]
    assert clean["first_divergence"] is None and max(v for _, v in clean["rows"]) <= 1e-6
    for op in ("ffn_moe_probs", "ffn_moe_weights_softmax", "ffn_moe_gate_biased", "ffn_moe_up_biased",
               "ffn_moe_swiglu_oai", "ffn_moe_down_biased", "ffn_moe_out", "kqv_out", "l_out"):  # fmt: skip
        assert f"{op}-0" in names and f"{op}-1" in names, op
    real_loader = validate_mod.load_for_validation
    for name, change, first in (
        ("blk.1.ffn_gate_inp.bias", lambda b: b + 0.05, "ffn_moe_probs-1"),
        ("blk.1.ffn_down_exps.bias", lambda b: b * 1.05, "ffn_moe_down_biased-1"),
        ("blk.0.attn_sinks.weight", lambda s: s + 0.1, "kqv_out-0"),
    ):
        monkeypatch.setattr(validate_mod, "load_for_validation", _perturbing(real_loader, name, change))
        assert validate_mod.diff_model(path, "c", PROMPT)["first_divergence"] == first, name


@pytest.fixture(scope="session")
def oss_mxfp4(fixture_files, tmp_path_factory):
    """(module path, gguf path, IR) of the gpt-oss fixture as llama.cpp's MXFP4_MOE: experts MXFP4, the rest Q8_0."""
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.runtime.api import write_generated

    pytest.importorskip("llama_cpp")
    path = fixture_files("gpt-oss", "MXFP4_MOE")
    ir = build_model_ir(read_gguf(path))
    return write_generated(ir, tmp_path_factory.mktemp("oss_mxfp4")), path, ir


def test_mxfp4_experts_through_the_kernels(oss_mxfp4):
    """The real files' format: the MXFP4 expert stacks stay in their blocks (the gathered-experts kernel), the
    Q8_0 matrices too, against llama.cpp at the quantized bar, and 8 greedy steps through the KV cache."""
    from alchemist.harness.oracle import LlamaCppOracle
    from alchemist.harness.validate import load_for_validation, validate_backend

    module, path, ir = oss_mxfp4
    kernels = {t.name.split(".", 2)[-1]: t.ggml_type for t in ir.tensors if t.kernel}
    assert kernels["ffn_gate_exps.weight"] == kernels["ffn_up_exps.weight"] == kernels["ffn_down_exps.weight"]
    assert kernels["ffn_down_exps.weight"] == "MXFP4" and kernels["attn_q.weight"] == "Q8_0"
    loaded = load_for_validation(str(path))
    with LlamaCppOracle(str(path), n_ctx=CONTEXT, n_threads=1) as oracle:
        res = validate_backend(loaded, "c", oracle, PROMPT, 8, CONTEXT, quantized=True)
    assert res["passed"], res["failures"]
    assert res["quantized_kernels"] and res["prompt"]["top1_agree"] == len(PROMPT)
    assert res["prompt"]["mean_pearson"] >= 0.999 and res["greedy"]["n_agree"] == 8


# ---------------------------------------------------------------------------------------------------
# the auditor (no gpt-oss code in it) and serving
# ---------------------------------------------------------------------------------------------------
def test_audit_passes_gpt_oss_modules(oss, oss_mxfp4):
    from pathlib import Path

    from alchemist.audit import audit_module

    for module, path in ((Path(oss[0].__file__), oss[1]), oss_mxfp4[:2]):  # F32; MXFP4 experts in their blocks
        report = audit_module(module, gguf_path=path)
        assert report.passed, report.table()


def test_slot_engine_runs_gpt_oss(oss_mxfp4, tmp_path_factory):
    """Sinks and the sliding window's ring need nothing of the SlotEngine's own: three sequences' prefill chunks
    and batched decode rows equal the one-sequence engine's logits (MXFP4 experts, kernels), past the window."""
    from alchemist.runtime.engine import Engine, import_generated
    from alchemist.runtime.slot_engine import SlotEngine

    module_path, path, ir = oss_mxfp4
    module = import_generated(module_path)
    weights = module.load_weights(str(path), quantized=True)
    se = SlotEngine(Engine(module, weights, "c", 32), 3, chunk=4, decode_buckets=(4,))
    single = Engine(module, weights, "c", 32)
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(0, module.N_VOCAB, n)] for n in (19, 6, 14)]
    assert_slots_equal_engine(se, single, seqs, [5, 5, 5])
