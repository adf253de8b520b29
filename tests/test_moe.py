"""Mixture of experts: the gathered-experts kernel against dequantize-then-einsum, the router's math for every
gating kind, and the qwen3moe / llama:moe fixtures through the quantized kernels, Numba, the auditor, the
layer diff (routing included) and the serving slots."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from alchemist.pytensor_ext.host import configure_pytensor

configure_pytensor()

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from test_kernels import random_blocks  # noqa: E402

from alchemist.kernels import quantized_expert_linear, row_bytes  # noqa: E402
from alchemist.kernels.formats import reference_dequantize  # noqa: E402
from alchemist.runtime.backends import get_mode  # noqa: E402
from slot_runs import assert_slots_equal_engine  # noqa: E402

TYPES = ("F32", "Q8_0", "Q4_K")
N_EXPERT, N_OUT, N_IN, K = 6, 24, 256, 2
PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]
CONTEXT = 64


@pytest.fixture(scope="session")
def moe_module(tiny_module):
    """The generated qwen3moe fixture module (its project_experts serves the float32 experts)."""
    return tiny_module("qwen3moe")[0]


def experts_of(rng, ggml_type):
    """(weights as the graph gets them, float64 dequantized (n_expert, n_out, n_in))."""
    if ggml_type == "F32":
        w = rng.standard_normal((N_EXPERT, N_OUT, N_IN)).astype(np.float32)
        return w, w.astype(np.float64)
    w = np.stack([random_blocks(rng, ggml_type, N_OUT, N_IN) for _ in range(N_EXPERT)])
    return w, np.stack([reference_dequantize(b, ggml_type) for b in w]).astype(np.float64)


@pytest.fixture(scope="session")
def expert_fn(moe_module):
    """(backend, ggml_type, x_ndim) -> f(x, w, ids), compiled once per session."""
    cache = {}

    def get(backend, ggml_type, x_ndim):
        key = (backend, ggml_type, x_ndim)
        if key not in cache:
            pytest.importorskip({"c": "pytensor", "numba": "numba"}[backend])
            x = pt.tensor("x", dtype="float32", shape=(None,) * (x_ndim - 1) + (N_IN,))
            ids = pt.matrix("ids", dtype="int64")
            if ggml_type == "F32":
                w = pt.tensor3("w", dtype="float32")
                y = moe_module.project_experts(x, {"e": w}, "e", ids)  # the generated module's float32 path
            else:
                w = pt.tensor3("w", dtype="uint8", shape=(N_EXPERT, N_OUT, row_bytes(ggml_type, N_IN)))
                y = quantized_expert_linear(x, w, ids, ggml_type, N_EXPERT, N_OUT, N_IN)
            cache[key] = pytensor.function([x, w, ids], y, mode=get_mode(backend))
        return cache[key]

    return get


def reference(x, dense, ids):
    rows = x.astype(np.float64)[:, None, :] if x.ndim == 2 else x.astype(np.float64)
    rows = np.broadcast_to(rows, ids.shape + (N_IN,))
    return np.einsum("tkoi,tki->tko", dense[ids], rows), np.einsum("tkoi,tki->tko", np.abs(dense[ids]), np.abs(rows))


@pytest.mark.parametrize("x_ndim", (2, 3))
@pytest.mark.parametrize("n_tokens", (1, 5, 20))
@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("backend", ("c", "numba"))
def test_gathered_experts_equal_dequantize_then_einsum(expert_fn, backend, ggml_type, n_tokens, x_ndim):
    """y[t, j] = x[t] (or x[t, j]) @ W[ids[t, j]].T to float32 summation order; at 20 tokens one expert gets
    every token (the C kernel's BLAS path for >= 16 rows of one expert)."""
    rng = np.random.default_rng(n_tokens * 10 + x_ndim)
    w, dense = experts_of(rng, ggml_type)
    ids = np.stack([rng.choice(N_EXPERT, K, replace=False) for _ in range(n_tokens)]).astype(np.int64)
    if n_tokens == 20:
        ids[:, 0] = 3
        ids[:, 1] = np.where(ids[:, 1] == 3, 4, ids[:, 1])
    x = rng.standard_normal((n_tokens, N_IN) if x_ndim == 2 else (n_tokens, K, N_IN)).astype(np.float32)
    y = np.asarray(expert_fn(backend, ggml_type, x_ndim)(x, w, ids))
    ref, magnitude = reference(x, dense, ids)
    assert y.dtype == np.float32 and y.shape == (n_tokens, K, N_OUT)
    err = np.abs(y - ref)
    assert np.all(err <= 1e-5 * magnitude + 1e-30), f"max error {np.max(err / (1e-5 * magnitude)):.2f} x tolerance"


@pytest.mark.parametrize("backend", ("c", "numba"))
@pytest.mark.parametrize("ggml_type", ("Q8_0", "Q4_K"))
def test_gathered_experts_with_ggml_numerics(backend, ggml_type):
    """numerics="ggml": each (token, rank) row of the experts' product is the ggml-numerics product of that
    token's activations with its expert's rows (rounded to llama.cpp's activation blocks first)."""
    from alchemist.kernels import quantized_linear
    from alchemist.kernels.activations import round_rows

    rng = np.random.default_rng(11)
    w, dense = experts_of(rng, ggml_type)
    n_tokens = 20
    ids = np.stack([rng.choice(N_EXPERT, K, replace=False) for _ in range(n_tokens)]).astype(np.int64)
    x = rng.standard_normal((n_tokens, N_IN)).astype(np.float32)
    xv, iv = pt.matrix("x", dtype="float32"), pt.matrix("ids", dtype="int64")
    wv = pt.tensor3("w", dtype="uint8", shape=(N_EXPERT, N_OUT, row_bytes(ggml_type, N_IN)))
    y_ggml = quantized_expert_linear(xv, wv, iv, ggml_type, N_EXPERT, N_OUT, N_IN, numerics="ggml")
    y = np.asarray(pytensor.function([xv, wv, iv], y_ggml, mode=get_mode(backend))(x, w, ids))
    ref, magnitude = reference(round_rows(x, ggml_type), dense, ids)
    assert np.all(np.abs(y - ref) <= 1e-5 * magnitude + 1e-30)
    # the same rounding as the dense ggml kernel: one token through QuantizedMatmul(numerics="ggml")
    row = pt.matrix("r", dtype="uint8", shape=(N_OUT, row_bytes(ggml_type, N_IN)))
    dense_fn = pytensor.function([xv, row], quantized_linear(xv, row, ggml_type, N_OUT, N_IN, "ggml"), mode=get_mode(backend))
    t, j = 3, 1
    single = np.asarray(dense_fn(x[t : t + 1], w[ids[t, j]]))[0]
    assert np.abs(y[t, j] - single).max() <= 1e-5 * np.abs(single).max()


@pytest.mark.parametrize("ggml_type", ("Q8_0", "Q4_K"))
def test_jax_takes_the_chosen_experts_in_the_graph(ggml_type):
    pytest.importorskip("jax")
    rng = np.random.default_rng(9)
    w, dense = experts_of(rng, ggml_type)
    ids = np.array([[1, 4], [4, 0], [5, 1]], dtype=np.int64)
    x = rng.standard_normal((3, N_IN)).astype(np.float32)
    xv = pt.tensor("x", dtype="float32", shape=(3, N_IN))
    wv = pt.tensor("w", dtype="uint8", shape=w.shape)
    iv = pt.tensor("ids", dtype="int64", shape=(3, K))
    fn = pytensor.function([xv, wv, iv], quantized_expert_linear(xv, wv, iv, ggml_type, N_EXPERT, N_OUT, N_IN),
                           mode=get_mode("jax"))
    ref, magnitude = reference(x, dense, ids)
    assert np.all(np.abs(np.asarray(fn(x, w, ids)) - ref) <= 1e-5 * magnitude + 1e-30)


@pytest.mark.parametrize("backend", ("c", "numba"))
def test_unchosen_experts_are_never_read(expert_fn, backend):
    """Every expert but the chosen ones has NaN scales: a kernel that touched them would return NaN. So a
    decode step reads K experts' blocks, whatever the expert count."""
    rng = np.random.default_rng(5)
    w, _ = experts_of(rng, "Q8_0")
    ids = np.array([[2, 5]], dtype=np.int64)
    poisoned = w.copy()
    for e in set(range(N_EXPERT)) - {2, 5}:
        blocks = poisoned[e].reshape(N_OUT, -1, 34)
        blocks[:, :, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    x = rng.standard_normal((1, N_IN)).astype(np.float32)
    fn = expert_fn(backend, "Q8_0", 2)
    assert np.isfinite(np.asarray(fn(x, poisoned, ids))).all()
    np.testing.assert_array_equal(np.asarray(fn(x, poisoned, ids)), np.asarray(fn(x, w, ids)))


@pytest.mark.parametrize("backend", ("c", "numba"))
def test_expert_id_out_of_range(expert_fn, backend):
    rng = np.random.default_rng(6)
    w, _ = experts_of(rng, "Q8_0")
    with pytest.raises(IndexError):
        expert_fn(backend, "Q8_0", 2)(np.ones((1, N_IN), np.float32), w, np.array([[0, N_EXPERT]], dtype=np.int64))


# ---------------------------------------------------------------------------------------------------
# the router: llama.cpp's build_moe_ffn for every gating kind
# ---------------------------------------------------------------------------------------------------
def llamacpp_route(logits, k, gating, normalize, scale, bias=None):
    """numpy reference: gating, a stable descending top-k (ties: lower index first), weights from the unbiased
    scores (softmax over the chosen for softmax_weight), renormalized with the sum clamped at 2^-14, scaled."""
    logits = logits.astype(np.float64) + (0 if bias is None else bias)
    if gating == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    elif gating == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        scores = logits
    ids = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, ids, -1)
    if gating == "softmax_weight":
        w = np.exp(w - w.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
    if normalize:
        w = w / np.maximum(w.sum(-1, keepdims=True), 6.103515625e-5)
    return ids, w * scale


@pytest.mark.parametrize(
    "gating,normalize,scale,biased",
    [("softmax", True, 1.0, False), ("softmax", False, 2.5, False), ("sigmoid", True, 1.0, False),
     ("softmax_weight", False, 1.0, True)],  # the last is gpt-oss's: router bias, top-k of logits, softmax of k
)  # fmt: skip
def test_router_matches_llamacpp(tiny_gguf, tmp_path, gating, normalize, scale, biased):
    """The router is data: the same template renders every gating kind from the IR's RouterSpec."""
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.ir import Gating
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import import_generated

    ir = build_model_ir(read_gguf(tiny_gguf("qwen3moe")))
    lay = ir.layers[0]
    router = dataclasses.replace(
        lay.mlp.router,
        gating=Gating(gating),
        normalize=normalize,
        weight_scale=scale,
        bias="ffn_gate_inp.bias" if biased else None,
    )
    layers = tuple(dataclasses.replace(x, mlp=dataclasses.replace(x.mlp, router=router)) for x in ir.layers)
    module = import_generated(write_generated(dataclasses.replace(ir, layers=layers), tmp_path))
    n_expert, n_embd = module.N_EXPERT, module.N_EMBD
    x = pt.matrix("x", dtype="float32")
    w = {"blk.0.ffn_gate_inp.weight": pt.matrix("r", dtype="float32"), "blk.0.ffn_gate_inp.bias": pt.vector("b")}
    taps: dict = {}
    experts, weights = module.route(module.EXACT, w, 0, x, taps)
    fn = pytensor.function([x, *w.values()], [experts, weights], mode=get_mode("c"), on_unused_input="ignore")
    rng = np.random.default_rng(2)
    xs = rng.standard_normal((7, n_embd)).astype(np.float32)
    xs[0] = 0.0  # every logit equal: the lowest indices win
    r = (rng.standard_normal((n_expert, n_embd)) / 4).astype(np.float32)
    r[5] = r[2]  # experts 2 and 5 always score alike: the lower index goes first
    b = (rng.standard_normal(n_expert) * 0.1).astype(np.float32)
    b[5] = b[2]
    got_ids, got_w = fn(xs, r, b)
    want_ids, want_w = llamacpp_route(xs @ r.T, module.N_EXPERT_USED, gating, normalize, scale, b if biased else None)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=2e-6, atol=1e-7)
    if not biased:
        assert list(got_ids[0]) == [0, 1]
    # the taps llama.cpp's callback names: logits, probabilities, chosen experts and weights per token
    assert {"ffn_moe_logits-0", "ffn_moe_probs-0", "ffn_moe_topk-0", "ffn_moe_weights-0"} <= set(taps)
    assert ("ffn_moe_logits_biased-0" in taps) == biased and ("ffn_moe_weights_norm-0" in taps) == normalize
    assert ("ffn_moe_weights_softmax-0" in taps) == (gating == "softmax_weight")
    assert ("ffn_moe_weights_scaled-0" in taps) == (scale != 1.0)


# ---------------------------------------------------------------------------------------------------
# the fixtures against llama.cpp
# ---------------------------------------------------------------------------------------------------
MOE_CASES = ("qwen3moe", "llama:moe")


@pytest.fixture(scope="session")
def moe_engines():
    return {}


def _validate(fixture_files, moe_engines, case, backend, wtype, n_generate, kernels):
    from alchemist.harness import LlamaCppOracle
    from alchemist.harness.validate import load_for_validation, validate_backend

    pytest.importorskip("llama_cpp")
    path = fixture_files(case, wtype)
    loaded = load_for_validation(str(path))
    key = (case, backend, wtype if kernels else "float32")
    if key not in moe_engines:
        moe_engines[key] = loaded.engine(backend, CONTEXT, kernels)
    with LlamaCppOracle(str(path), n_ctx=CONTEXT, n_threads=1) as oracle:
        res = validate_backend(loaded, backend, oracle, PROMPT, n_generate, CONTEXT, engine=moe_engines[key],
                               quantized=kernels)
    assert res["passed"], res["failures"]
    return res


# both routings on C; the Numba kernel (the same one for both) through qwen3moe's graph, while llama:moe's routing
# runs on Numba in test_llama_moe_on_numba (a cold Numba compile of a MoE prompt graph is ~2 min of the suite)
@pytest.mark.parametrize("case, backend", [("qwen3moe", "c"), ("llama:moe", "c"), ("qwen3moe", "numba")])
def test_moe_kernels_path(fixture_files, moe_engines, case, backend):
    """Q4_K experts kept in their GGUF blocks, multiplied by the gathered-experts kernel, against llama.cpp: the
    prompt, and on C 32 greedy decode steps (Numba compiles each graph whole: the prompt graph only)."""
    n_generate = 32 if backend == "c" else 0
    res = _validate(fixture_files, moe_engines, case, backend, "Q4_K", n_generate, kernels=True)
    assert res["quantized_kernels"] and (not n_generate or res["greedy"]["n_agree"] == 32)


@pytest.mark.parametrize("wtype", ("F32", "Q8_0", "Q4_K"))
def test_llama_moe_on_numba(fixture_files, moe_engines, wtype):
    """The variant's bar on Numba too (test_validation runs Numba per family, variants on C only)."""
    res = _validate(fixture_files, moe_engines, "llama:moe", "numba", wtype, 0, kernels=False)
    if wtype == "F32":
        assert res["layers"]["max_nmse"] <= 1e-6 and res["layers"]["n_compared"] >= 2 * 12


def test_diff_names_the_router_and_the_experts(fixture_files, monkeypatch):
    """The routing is compared with llama.cpp like any layer output: a perturbed router weight in layer 1 makes
    `alchemist diff` name that router's logits first; a perturbed expert matrix, that expert product."""
    import alchemist.harness.validate as validate_mod

    pytest.importorskip("llama_cpp")
    path = str(fixture_files("qwen3moe", "F32"))
    clean = validate_mod.diff_model(path, "c", PROMPT[:6])
    names = [n for n, _ in clean["rows"]]
    assert clean["first_divergence"] is None
    assert {"ffn_moe_topk-1", "ffn_moe_weights_norm-1", "ffn_moe_logits-1", "ffn_moe_out-1"} <= set(names)
    real_loader = validate_mod.load_for_validation

    def perturbing(name, scale):
        def loader(p, **kwargs):
            loaded = real_loader(p, **kwargs)
            real_weights = loaded.weights_for

            def weights_for(*args, **kw):
                weights = dict(real_weights(*args, **kw))
                weights[name] = weights[name] * np.float32(scale)
                return weights

            loaded.weights_for = weights_for
            return loaded

        return loader

    monkeypatch.setattr(validate_mod, "load_for_validation", perturbing("blk.1.ffn_gate_inp.weight", 1.05))
    assert validate_mod.diff_model(path, "c", PROMPT[:6])["first_divergence"] == "ffn_moe_logits-1"
    monkeypatch.setattr(validate_mod, "load_for_validation", perturbing("blk.1.ffn_down_exps.weight", 1.01))
    assert validate_mod.diff_model(path, "c", PROMPT[:6])["first_divergence"] == "ffn_moe_down-1"


# ---------------------------------------------------------------------------------------------------
# the auditor: no MoE-specific code, the MoE modules pass and their defects are caught
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def audited_moe(tmp_path_factory):
    """(module, gguf) of llama:moe as F32 and as llama.cpp's Q8_0 (the experts in GGUF blocks)."""
    from alchemist.arch import build_model_ir
    from alchemist.fixtures import write_fixture
    from alchemist.gguf_io import read_gguf
    from alchemist.harness.quantize import quantize_fixture
    from alchemist.runtime.api import write_generated

    pytest.importorskip("llama_cpp")
    d = tmp_path_factory.mktemp("audit_moe")
    f32 = write_fixture(d / "llama_moe-F32.gguf", "llama:moe")
    q8 = quantize_fixture(f32, d / "llama_moe-Q8_0.gguf", "Q8_0", nthread=1).path
    square = write_fixture(d / "qwen3moe-F32.gguf", "qwen3moe")  # experts (8, 256, 256): a flip still builds
    out = {}
    for key, path in (("F32", f32), ("Q8_0", q8), ("square", square)):
        ir = build_model_ir(read_gguf(path))
        out[key] = (write_generated(ir, d / key), path, ir)
    assert any(t.kernel and t.role == "experts" for t in out["Q8_0"][2].tensors)
    return out


def test_audit_passes_moe_modules(audited_moe):
    from alchemist.audit import audit_module

    for key, (module, path, _) in audited_moe.items():  # llama:moe F32 and Q8_0, qwen3moe F32
        report = audit_module(module, gguf_path=path)
        assert report.passed, report.table()
    why = audit_module(*audited_moe["F32"][:2]).check("orientation").why
    assert "every float32 expert stack (6 tensors" in why


def test_audit_catches_flipped_experts_and_dequantized_blocks(audited_moe, tmp_path):
    from test_audit import _forward_prologue, _replace_calls, write_mutant

    from alchemist.audit import audit_module

    module, path, ir = audited_moe["square"]
    name = "blk.1.ffn_up_exps.weight"  # applied as x @ W[e] instead of x @ W[e].T
    text = _forward_prologue(module.read_text(), [f"w = {{**w, {name!r}: w[{name!r}].dimshuffle(0, 2, 1)}}"])
    report = audit_module(write_mutant(tmp_path, module, text), gguf_path=path)
    assert report.failed == ["orientation"], report.table()
    assert f"{name} (experts, stored (n_expert, n_out, n_in) = (8, 256, 256)) is contracted over its axis 1" in (
        report.check("orientation").why
    )

    module, path, ir = audited_moe["Q8_0"]
    mutant = _replace_calls(
        module.read_text(), {"alchemist.kernels.quantized_expert_linear": lambda a: f"({a[1]})[{a[2]}].astype('float32').sum(-1)"}
    )
    report = audit_module(write_mutant(tmp_path, module, mutant), gguf_path=path)
    assert "dequantization" in report.failed and "exps.weight" in report.check("dequantization").why, report.table()


# ---------------------------------------------------------------------------------------------------
# serving
# ---------------------------------------------------------------------------------------------------
def test_slot_engine_runs_moe(tiny_gguf, tmp_path_factory):
    """The mixture is per token, so the SlotEngine's batched steps need nothing of their own: three sequences'
    prefill chunks and batched decode rows equal the one-sequence engine's logits (Q8_0 experts, kernels)."""
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.harness.quantize import quantize_fixture
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import Engine, import_generated
    from alchemist.runtime.slot_engine import SlotEngine

    pytest.importorskip("llama_cpp")
    d = tmp_path_factory.mktemp("slots_moe")
    path = quantize_fixture(tiny_gguf("qwen3moe"), d / "qwen3moe-Q8_0.gguf", "Q8_0", nthread=1).path
    module = import_generated(write_generated(build_model_ir(read_gguf(path)), d))
    weights = module.load_weights(str(path), quantized=True)
    se = SlotEngine(Engine(module, weights, "c", 32), 3, chunk=4, decode_buckets=(4,))
    single = Engine(module, weights, "c", 32)
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(0, module.N_VOCAB, n)] for n in (9, 6, 11)]
    assert_slots_equal_engine(se, single, seqs, [5, 5, 5])


def test_expert_routing_reports_choices_weights_and_load(moe_module, tiny_gguf):
    from alchemist.harness.routing import expert_routing
    from alchemist.runtime.engine import Engine

    engine = Engine(moe_module, moe_module.load_weights(str(tiny_gguf("qwen3moe"))), "c", 32)
    r = expert_routing(engine, PROMPT[:6])
    assert r["layers"] == [0, 1] and r["experts"].shape == (2, 6, 2) and r["weights"].shape == (2, 6, 2)
    np.testing.assert_allclose(r["weights"].sum(-1), 1.0, rtol=1e-6)  # renormalized top-2
    assert (r["experts"][..., 0] != r["experts"][..., 1]).all() and (np.diff(r["weights"], axis=-1) <= 0).all()
    assert r["load"].shape == (2, 8) and (r["load"].sum(-1) == 12).all()
