"""gemma3n: the real E2B inventory binds, the KV-sharing rule, the new math (activation sparsity, AltUp predict and
correct, magnitude matching) against numpy written from llama.cpp's gemma3n.cpp, KV caches allocated per owner,
the 22-layer KV-sharing fixture against llama.cpp, and `alchemist diff` inside AltUp."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from alchemist.arch import build_model_ir
from alchemist.arch.gemma3n import FAMILY, SPARSITY_STD
from alchemist.codegen import render_module
from alchemist.errors import AlchemistError, UnsupportedModelError
from alchemist.fixtures import FixtureConfig, write_fixture
from alchemist.gguf_io import read_gguf

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]
E2B_KINDS = tuple(il % 5 < 4 for il in range(30))  # HF layer_types of gemma-3n-E2B: every 5th layer full attention


def kv_shared_config():
    """A 22-layer fixture config: past llama.cpp's KV start (20), so layer 20 (sliding) and 21 (global) attend to
    the caches of layers 18 and 19; layers 10-21 are dense. Validated in F32 only: 22 random layers amplify
    llama.cpp's activation rounding past the quantized bars, which the 6-layer fixture meets, and with the 6-layer
    fixture's larger embeddings (decisive logits) its F32 rounding past 1e-6."""
    kinds = E2B_KINDS[:20] + (True, False)
    return FixtureConfig(
        "gemma3n", n_layer=22, metadata=(("attention.sliding_window_pattern", kinds),), embedding_std=0.05
    )


@pytest.fixture(scope="module")
def e2b_like(tmp_path_factory):
    """Gemma 3n E2B's inventory and layer layout (30 layers, every 5th global, 20..29 KV-sharing) at tiny widths."""
    cfg = FixtureConfig(
        "gemma3n", n_layer=30, n_vocab=320, n_embd=64, n_head=2, n_kv_head=1, head_dim=32, n_ff=128,
        metadata=(("attention.sliding_window_pattern", E2B_KINDS),),
    )  # fmt: skip
    path = write_fixture(tmp_path_factory.mktemp("e2b") / "e2b-like.gguf", "gemma3n", config=cfg)
    return path, build_model_ir(read_gguf(path))


@pytest.fixture(scope="module")
def fixture_module(tmp_path_factory):
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import import_generated

    d = tmp_path_factory.mktemp("g3n")
    path = write_fixture(d / "gemma3n.gguf", "gemma3n")
    ir = build_model_ir(read_gguf(path))
    return path, ir, import_generated(write_generated(ir, d))


def test_family_table_is_llamacpps_gemma3n_inventory():
    """Our table is gguf-py's MODEL_TENSORS[GEMMA3N] (split q/k/v; the fused qkv it also lists is not supported)
    with the names of llama-model.cpp's gemma3n create_tensor calls."""
    import gguf

    arch = gguf.MODEL_ARCH.GEMMA3N
    names = {gguf.TENSOR_NAMES[t].replace("{bid}", "{il}") + ".weight" for t in gguf.MODEL_TENSORS[arch]}
    ours = {t.name for t in FAMILY.tensors}
    assert ours == names - {"blk.{il}.attn_qkv.weight"}
    assert {t.name for t in FAMILY.tensors if not t.required} == {"output.weight"}  # tied when absent


def test_real_e2b_layout_binds(e2b_like):
    path, ir = e2b_like
    facts = read_gguf(path)
    assert len(facts.tensors) == 7 + 24 * 30  # E2B's 727 tensors (tied output)
    assert ir.layers[0].attention.kv_layer == 0 and [lay.attention.kv_layer for lay in ir.layers[20:]] == [
        18, 18, 18, 18, 19, 18, 18, 18, 18, 19
    ]  # fmt: skip
    assert ir.kv_cache_layers == tuple(range(20)) and ir.kv_cache_of[20:] == (18,) * 4 + (19,) + (18,) * 4 + (19,)
    assert [lay.mlp.sparsity_std for lay in ir.layers] == [SPARSITY_STD] * 10 + [0.0] * 20
    assert sorted(t.name for t in ir.tensors if not t.read)[:3] == [
        "blk.20.attn_k.weight", "blk.20.attn_k_norm.weight", "blk.20.attn_v.weight"
    ]  # fmt: skip
    assert sum(not t.read for t in ir.tensors) == 30
    assert facts.tensors["per_layer_token_embd.weight"].shape == (320, 30 * 256)
    src = render_module(ir)
    assert "N_KV_CACHE = 20" in src and "slots=None" in src.split("def forward(")[1].split(")")[0]


def test_real_e2b_layout_loads_in_llamacpp(e2b_like):
    pytest.importorskip("llama_cpp")
    from alchemist.harness.oracle import LlamaCppOracle

    with LlamaCppOracle(str(e2b_like[0]), n_ctx=32, n_threads=1) as oracle:
        assert np.isfinite(oracle.logits([1, 40, 7])).all()


def test_kv_sharing_needs_layer_18_sliding_and_19_global(tmp_path):
    kinds = tuple(il != 18 and il % 5 < 4 for il in range(22))  # layer 18 global: llama.cpp would abort
    cfg = FixtureConfig("gemma3n", n_layer=22, n_vocab=320, n_embd=64, n_head=2, n_kv_head=1, head_dim=32,
                        n_ff=128, metadata=(("attention.sliding_window_pattern", kinds),))  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="layer 20 .sliding. shares the KV cache of layer 18"):
        build_model_ir(read_gguf(write_fixture(tmp_path / "bad.gguf", "gemma3n", config=cfg)))


def test_ir_hash_leaves_new_fields_out_at_their_defaults(fixture_module):
    _, ir, _ = fixture_module
    d = ir.to_dict()
    assert "altup" in d and "kv_layer" in d["layers"][0]["attention"]
    plain = dataclasses.replace(ir, altup=None)
    assert "altup" not in plain.to_dict()


def _fn(inputs, output):
    import pytensor

    return pytensor.function(inputs, output, mode="FAST_RUN")


def test_gaussian_topk_is_llamacpps(fixture_module):
    import pytensor.tensor as pt

    module = fixture_module[2]
    x = np.random.default_rng(0).standard_normal((3, module.N_FF)).astype(np.float32) * 3 + 0.5
    v = pt.matrix("x", dtype="float32")
    got = _fn([v], module.gaussian_topk(v, SPARSITY_STD))(x)
    mean = x.astype(np.float64).mean(-1, keepdims=True)
    std = np.sqrt(((x - mean) ** 2).sum(-1, keepdims=True) / (x.shape[-1] - 1))  # Bessel-corrected, as ggml
    want = np.maximum(x - (mean + std * SPARSITY_STD), 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert 0.02 < (got > 0).mean() < 0.09  # about the top 5% of each row survive


def test_altup_predict_correct_and_magnitudes_are_llamacpps(fixture_module):
    """predictions[n] = H[n] + sum_k c[t, n*A + k] H[k]; corrected[n] = P[n] + (1 + m2 @ C.T)[n] * (out - P[0]);
    the stack's streams have the embedding's L2 norm (gemma3n.cpp's altup_predict / altup_correct)."""
    import pytensor.tensor as pt

    _, ir, module = fixture_module
    weights = module.load_weights(fixture_module[0])
    rng = np.random.default_rng(1)
    A, E, T = module.N_ALTUP, module.N_EMBD, 3
    H = rng.standard_normal((A, T, E)).astype(np.float32)
    out = rng.standard_normal((T, E)).astype(np.float32)
    h, o = pt.tensor("h", dtype="float32", shape=(A, T, E)), pt.tensor("o", dtype="float32", shape=(T, E))
    w = {k: pt.constant(v) for k, v in weights.items()}
    P, C = _fn(
        [h, o],
        [module.altup_predict(module.EXACT, w, 1, h, None), module.altup_correct(module.EXACT, w, 1, h, o, None)],
    )(H, out)

    def router(x):
        norm = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + module.NORM_EPS)
        return np.tanh((norm * weights["blk.1.altup_router_norm.weight"] / E) @ weights["blk.1.altup_router.weight"].T)

    c = (router(H[0]) @ weights["blk.1.altup_predict_coef.weight"].T).reshape(T, A, A)
    want_p = H + np.einsum("tnk,kte->nte", c, H)
    np.testing.assert_allclose(P, want_p, rtol=1e-4, atol=1e-4)
    cc = router(out) @ weights["blk.1.altup_correct_coef.weight"].T + 1
    want_c = H + cc.T[:, :, None] * (out - H[0])[None]
    np.testing.assert_allclose(C, want_c, rtol=1e-4, atol=1e-4)
    x = pt.tensor("x", dtype="float32", shape=(T, E))
    X = rng.standard_normal((T, E)).astype(np.float32)
    S = _fn([x], module.altup_streams(w, x))(X)
    np.testing.assert_allclose(
        np.linalg.norm(S, axis=-1), np.broadcast_to(np.linalg.norm(X, axis=-1), (A, T)), rtol=1e-5
    )
    np.testing.assert_array_equal(S[0], X)


def test_engines_allocate_a_cache_per_owning_layer_and_serve_the_shared_caches(tmp_path):
    """The single-sequence engine and the slot engine keep 20 caches for 22 layers; two prompts prefilled in
    chunks into two slots (one reusing the other's prefix), then decoded together, give llama.cpp's logits (F32:
    NMSE <= 1e-6) at every step, through layers 20 and 21 that read layers 18's and 19's caches (the sliding one as
    a ring)."""
    pytest.importorskip("llama_cpp")
    from alchemist.harness.oracle import LlamaCppOracle
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import Engine, import_generated
    from alchemist.runtime.slot_engine import SlotEngine

    from alchemist.audit import audit_module

    gguf_path = write_fixture(tmp_path / "kv.gguf", "gemma3n", config=kv_shared_config())
    ir = build_model_ir(read_gguf(gguf_path))
    module_path = write_generated(ir, tmp_path)
    report = audit_module(module_path, gguf_path=gguf_path)  # no gemma3n code in the auditor: the IR says it all
    assert report.passed, report.table()
    assert "the 6 the IR marks unapplied by llama.cpp do not" in report.check("coverage").why
    module = import_generated(module_path)
    assert module.N_LAYER == 22 and module.N_KV_CACHE == 20 and module.KV_CACHE_OF[20:] == (18, 19)
    weights = module.load_weights(tmp_path / "kv.gguf")
    engine = Engine(module, weights, "c", 32)
    assert len(engine.cache) == 20 and engine.cache[19][0].name == "k_cache.19"
    slots = SlotEngine(Engine(module, weights, "c", 32), n_slots=2, chunk=4, decode_buckets=(2,))
    window = module.SLIDING_WINDOW[0]
    assert len(slots.cache) == 20 and slots.rows[18] == min(window + 4, 32) and slots.rows[19] == 32
    a, b = PROMPT[:9], PROMPT[:4] + [5, 77, 300]
    for lo, hi in slots.chunk_plan(len(a)):
        slots.prefill(0, a[lo:hi], lo)
    assert slots.reusable_prefix(len(a), 4, len(b)) == 4
    slots.copy_prefix(0, 1, 4)
    for lo, hi in slots.chunk_plan(len(b), 4):
        got_b = slots.prefill(1, b[lo:hi], lo)
    got = slots.decode([0, 1], [17, 64], [len(a), len(b)])
    with LlamaCppOracle(str(gguf_path), n_ctx=32, n_threads=1) as oracle:
        ref_a, ref_b = oracle.logits(a + [17]), oracle.logits(b + [64])
    nmse = lambda x, y: float(((x - y) ** 2).sum() / (y**2).sum())  # noqa: E731
    assert nmse(got_b, ref_b[len(b) - 1]) < 1e-6
    assert nmse(got[0], ref_a[-1]) < 1e-6 and nmse(got[1], ref_b[-1]) < 1e-6


def test_kv_shared_fixture_matches_llamacpp(tmp_path):
    """22 layers: layer 20 (sliding) and 21 (global) read layers 18's and 19's caches. F32 against llama.cpp on C:
    logits and every layer output within NMSE 1e-6, then greedy decoding through the shared caches."""
    pytest.importorskip("llama_cpp")
    from alchemist.harness.oracle import LlamaCppOracle
    from alchemist.harness.validate import load_for_validation, validate_backend

    path = write_fixture(tmp_path / "kv.gguf", "gemma3n", config=kv_shared_config())
    loaded = load_for_validation(str(path))
    with LlamaCppOracle(str(path), n_ctx=64, n_threads=1) as oracle:
        res = validate_backend(loaded, "c", oracle, PROMPT, 8, 64)
    assert res["passed"], res["failures"]
    assert res["layers"]["max_nmse"] <= 1e-6 and res["layers"]["n_compared"] > 22 * 20
    assert res["greedy"]["n_agree"] == 8


@pytest.mark.parametrize(
    "tensor, first", [("altup_predict_coef", "predictions-1"), ("altup_correct_coef", "all_coefs-1")]
)
def test_diff_names_the_altup_op(fixture_module, monkeypatch, tensor, first):
    """A perturbed AltUp coefficient of layer 1 (ours only): the diff names the predict / correct op that reads it."""
    pytest.importorskip("llama_cpp")
    import alchemist.harness.validate as validate_mod

    real_loader = validate_mod.load_for_validation

    def perturbed_loader(p, **kwargs):
        loaded = real_loader(p, **kwargs)
        load = loaded.module.load_weights

        def load_weights(path, progress=None, quantized=False):
            weights = load(path, progress, quantized)
            name = f"blk.1.{tensor}.weight"
            weights[name] = weights[name] * np.float32(1.01)
            return weights

        loaded.module.load_weights = load_weights
        return loaded

    monkeypatch.setattr(validate_mod, "load_for_validation", perturbed_loader)
    diff = validate_mod.diff_model(str(fixture_module[0]), "c", PROMPT[:6])
    assert diff["first_divergence"] == first
    rows = dict(diff["rows"])
    assert rows["l_out-0"] <= 1e-6 and rows[first] > 1e-6


def test_per_layer_embeddings_stay_in_blocks_and_are_gathered_by_row(tmp_path):
    """The per-layer table (262144 x n_layer·256 in E2B) is never a float copy: its quantized rows are kept as GGUF
    blocks and the graph reads it only through the quantized row gather of the tokens."""
    pytest.importorskip("llama_cpp")
    import pytensor.tensor as pt

    from alchemist.harness.quantize import quantize_fixture
    from alchemist.kernels import QuantizedEmbedding
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import import_generated

    path = quantize_fixture(write_fixture(tmp_path / "f32.gguf", "gemma3n"), tmp_path / "q8.gguf", "Q8_0").path
    ir = build_model_ir(read_gguf(path))
    name = "per_layer_token_embd.weight"
    binding = ir.tensor(name)
    assert binding.kernel and binding.ggml_type == "Q8_0" and binding.role == "embedding"
    module = import_generated(write_generated(ir, tmp_path))
    weights = module.load_weights(path, quantized=True)
    assert weights[name].dtype == np.uint8 and weights[name].nbytes == binding.nbytes
    w = {k: pt.constant(v, name=k) for k, v in weights.items()}
    tokens = pt.tensor("tokens", dtype="int64", shape=(3,))
    cache = [(pt.zeros((4, module.N_KV_HEAD, module.HEAD_DIM)),) * 2 for _ in range(module.N_KV_CACHE)]
    logits, _ = module.forward(w, tokens, pt.constant(np.arange(3, dtype=np.int64)), cache, attend_len=4)
    from pytensor.graph.traversal import applys_between

    users = [node for node in applys_between([w[name]], [logits]) if w[name] in node.inputs]

    def reads_tokens(var) -> bool:  # the tokens, or forward()'s tokens.reshape((-1,)) of them
        return var is tokens or (var.owner is not None and var.owner.inputs[0] is tokens and var.ndim == 1)

    assert users and all(
        isinstance(node.op, QuantizedEmbedding) and any(map(reads_tokens, node.inputs)) for node in users
    )
