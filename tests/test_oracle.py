"""The independent oracle side of the validation harness: llama.cpp logits / intermediates,
comparison metrics, and fixture quantization through llama.cpp's own quantizer."""

from __future__ import annotations

import numpy as np
import pytest

from alchemist.fixtures import write_fixture

# the oracle's own behaviour, on the four llama-like fixtures (every family is validated in test_validation)
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
from alchemist.harness import (
    FIXTURE_QTYPES,
    compare_logits,
    first_divergence,
    greedy_agreement,
    kl_divergence,
    nmse,
    pearson,
    top2_gap,
)

IDS = [5, 17, 300, 42, 42, 260, 301, 9, 77, 128, 400, 3]


# ------------------------------------------------------------------ metrics (no llama.cpp needed)


def test_identical_logits_are_perfect():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 50)).astype(np.float32)
    m = compare_logits(a, a.copy())
    assert m.n_positions == 6
    assert np.all(m.kl == 0.0)
    assert np.allclose(m.pearson, 1.0)
    assert m.n_top1_agree == 6 and np.all(m.top10_overlap == 10)
    assert m.max_abs_logit_diff == 0.0 and np.all(m.nmse == 0.0)
    assert m.disagreements == []
    assert m.summary()["mean_kl"] == 0.0


def test_constant_shift_changes_nothing_but_the_logits():
    rng = np.random.default_rng(1)
    b = rng.standard_normal((4, 30))
    m = compare_logits(b + 3.0, b)
    assert np.allclose(m.kl, 0.0, atol=1e-12)  # softmax is shift-invariant
    assert np.allclose(m.pearson, 1.0)
    assert np.allclose(m.max_abs_diff, 3.0)
    assert np.allclose(m.nmse, 9.0 * 30 / np.sum(b * b, axis=-1))
    assert m.n_top1_agree == 4


def test_known_kl_value():
    # two-way distributions: oracle p = softmax([0, 0]) = (.5, .5); ours q = softmax([log 3, 0]) = (.75, .25)
    oracle = np.array([[0.0, 0.0]])
    ours = np.array([[np.log(3.0), 0.0]])
    expected = 0.5 * np.log(0.5 / 0.75) + 0.5 * np.log(0.5 / 0.25)
    assert np.isclose(kl_divergence(oracle, ours)[0], expected, rtol=1e-12)
    assert np.isclose(compare_logits(ours, oracle).kl[0], expected, rtol=1e-12)
    # stable for huge logits
    assert np.isfinite(kl_divergence(oracle * 0 + [[1e4, -1e4]], [[-1e4, 1e4]])[0])


def test_anticorrelated_and_pearson_edge_cases():
    x = np.arange(10, dtype=np.float64)
    assert np.isclose(pearson(x, -x)[0], -1.0)
    assert pearson(np.ones(5), np.ones(5))[0] == 1.0


def test_near_tie_flagged_and_excluded():
    oracle = np.array(
        [
            [1.0, 1.0 + 5e-4, 0.0, -1.0],  # near-tie: oracle picks 1 by 5e-4
            [3.0, 0.0, 0.0, 0.0],  # decisive
            [0.0, 2.0, 0.0, 0.0],  # decisive
        ]
    )
    ours = np.array(
        [
            [1.0 + 1e-3, 1.0, 0.0, -1.0],  # we pick 0: a near-tie disagreement
            [3.0, 0.0, 0.0, 0.0],
            [2.5, 2.0, 0.0, 0.0],  # we pick 0: a decisive disagreement
        ]
    )
    m = compare_logits(ours, oracle)
    assert list(m.near_tie) == [True, False, False]
    assert np.isclose(m.oracle_top2_gap[0], 5e-4)
    assert m.n_top1_agree == 1
    assert m.n_decisive == 2 and m.n_top1_agree_decisive == 1
    assert [(d["position"], d["near_tie"]) for d in m.disagreements] == [(0, True), (2, False)]
    assert m.decisive_disagreements == [2]
    assert "decisive" in str(m)


def test_top2_gap():
    assert np.allclose(top2_gap(np.array([[0.0, 2.0, 1.5], [1.0, 1.0, 0.0]])), [0.5, 0.0])


def test_nmse_and_first_divergence():
    b = np.array([1.0, 2.0, 3.0])
    assert nmse(b, b) == 0.0
    assert np.isclose(nmse(b + 1.0, b), 3.0 / 14.0)
    assert nmse(np.zeros(3), np.zeros(3)) == 0.0
    assert nmse(np.ones(3), np.zeros(3)) == np.inf
    # layouts may differ as long as sizes match: (T, H*D) vs (T, H, D)
    q = np.arange(24.0).reshape(2, 3, 4)
    assert nmse(q.reshape(2, 12), q) == 0.0

    oracle = {"a": b, "b": b * 2, "c": b * 3, "d": b}
    ours = {"a": b, "b": b * 2 * (1 + 1e-9), "c": b * 3 + 0.1, "d": b + 1}
    order = ["a", "x", "b", "c", "d"]
    rep = first_divergence(ours, oracle, order, tol=1e-6)
    assert rep.name == "c" and rep
    assert rep.missing == ["x"]
    assert list(rep.nmse) == ["a", "b", "c", "d"]  # everything compared, in order
    assert "first divergence at c" in str(rep)
    assert not first_divergence(ours, oracle, ["a", "b"])
    assert first_divergence({"a": np.ones(4)}, {"a": np.ones(3)}, ["a"]).mismatched == ["a"]


def test_greedy_agreement():
    logits = np.zeros((4, 5))
    logits[0, 1] = 2.0
    logits[1, 2] = 2.0
    logits[2, 3] = 1.0
    logits[2, 4] = 1.0 - 1e-4  # oracle picks 3, we pick 4: near-tie
    logits[3, 0] = 5.0  # oracle picks 0, we pick 1: decisive
    g = greedy_agreement([1, 2, 4, 1], logits)
    assert (g.n_steps, g.n_agree) == (4, 2)
    assert g.first_divergence == 2 and g.first_divergence_near_tie
    assert np.isclose(g.first_divergence_gap, 1e-4)
    assert (g.our_token, g.oracle_token) == (4, 3)
    assert g.n_decisive_disagree == 1
    ok = greedy_agreement([1, 2], logits[:2])
    assert ok.all_agree and ok.first_divergence is None
    with pytest.raises(ValueError):
        greedy_agreement([1, 2, 3], logits[:2])


# ------------------------------------------------------------------ llama.cpp


@pytest.fixture(scope="session")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("oracle_fixtures")


@pytest.fixture(scope="session")
def f32_paths(fixture_dir):
    return {fam: write_fixture(fixture_dir / f"{fam}-F32.gguf", fam, weight_type="F32") for fam in FAMILIES}


@pytest.fixture(scope="session")
def oracles(llama_cpp, f32_paths):
    from alchemist.harness import LlamaCppOracle

    opened = {fam: LlamaCppOracle(path, n_ctx=128, n_threads=1) for fam, path in f32_paths.items()}
    yield opened
    for o in opened.values():
        o.close()


@pytest.mark.oracle
@pytest.mark.parametrize("fam", FAMILIES)
def test_logits_shape_determinism_causality(oracles, fam):
    o = oracles[fam]
    assert o.vocab_size == 512 and o.n_layer == 2
    a = o.logits(IDS)
    assert a.shape == (len(IDS), 512) and a.dtype == np.float32
    assert np.all(np.isfinite(a))
    assert np.array_equal(a, o.logits(IDS))  # fresh cache each call: bit-identical
    prefix = o.logits(IDS[:5])
    scale = float(np.abs(a).max())
    # causal: later tokens change nothing (up to kernel choice for a different batch shape)
    assert np.abs(prefix - a[:5]).max() <= 1e-6 * scale
    one = o.logits(IDS[:1])  # a single-token batch takes llama.cpp's gemv path
    if fam == "gemma3":
        # gemv and gemm round the last bit differently, and llama.cpp's GELU reads an fp16 table: on an AVX2
        # CPU that flips one fp16 step for some activations (measured: NMSE 1e-13 before the first GELU,
        # 1.5e-10 after layer 1); exact-rounding families stay at 1e-12
        assert nmse(one[0], a[0]) < 1e-9
    else:
        assert np.abs(one[0] - a[0]).max() <= 1e-6 * scale
        assert nmse(one[0], a[0]) < 1e-12


@pytest.mark.oracle
def test_chunked_decode_matches_single_batch(llama_cpp, f32_paths):
    from alchemist.harness import LlamaCppOracle

    with LlamaCppOracle(f32_paths["qwen3"], n_ctx=64, n_threads=1, n_batch=4) as small:
        chunked = small.logits(IDS)
    with LlamaCppOracle(f32_paths["qwen3"], n_ctx=64, n_threads=1) as big:
        whole = big.logits(IDS)
    assert compare_logits(chunked, whole).max_kl < 1e-8
    assert np.allclose(chunked, whole, rtol=1e-4, atol=1e-4)


@pytest.mark.oracle
def test_greedy_and_rescore(oracles):
    o = oracles["qwen2"]
    prompt = IDS[:4]
    cont = o.greedy(prompt, 6)
    assert len(cont) == 6 and all(0 <= t < o.vocab_size for t in cont)
    r = o.rescore(prompt, cont)
    assert r.shape == (6, o.vocab_size)
    g = greedy_agreement(cont, r)
    assert g.n_agree >= 5  # incremental vs batched evaluation may only flip exact near-ties
    assert g.n_decisive_disagree == 0
    # the first step is the same computation as logits(prompt)[-1]
    assert np.allclose(r[0], o.logits(prompt)[-1], atol=1e-5)


@pytest.mark.oracle
def test_tokenize(oracles):
    o = oracles["llama"]
    ids = o.tokenize("the cat", add_special=True)
    assert ids[0] == o.bos_id == 1
    assert o.tokenize("the cat", add_special=False) == ids[1:]
    q = oracles["qwen2"]
    assert 510 in q.tokenize("<|im_start|>the", add_special=False, special=True)  # specials parsed
    assert 510 not in q.tokenize("<|im_start|>the", add_special=False, special=False)


@pytest.mark.oracle
@pytest.mark.parametrize("fam", FAMILIES)
def test_intermediates_shapes_and_result_output(oracles, fam):
    o = oracles[fam]
    n = len(IDS)
    t = o.intermediates(IDS)
    assert o.arch == fam
    order = o.capture_order()
    assert set(order) == set(t) and order[-1] == "result_output"  # every captured tensor, in evaluation order
    ours = {k: v.reshape(len(IDS), -1) for k, v in t.items()}  # e.g. our (T, H*D) layout for Qcur
    assert not first_divergence(ours, t, order, tol=0.0)  # exact self-comparison through the layout change
    assert o.capture_order().index("l_out-0") < o.capture_order().index("l_out-1")
    for name in ("attn_norm-0", "kqv_out-0", "ffn_out-0", "l_out-0", "l_out-1", "result_norm"):
        assert t[name].shape == (n, 256), name
    assert not any(k == "norm" or k.startswith("norm-") for k in t)  # ambiguous build_norm scratch names
    assert t["Qcur-0"].shape == (n, 4, 64)
    assert t["Kcur-0"].shape == (n, 2, 64) and t["Vcur-0"].shape == (n, 2, 64)
    assert t["result_output"].shape == (n, 512)
    assert t["l_out-1"].dtype == np.float32
    # the instrumented evaluation computes the same logits as the plain one
    assert np.allclose(t["result_output"], o.logits(IDS), rtol=1e-6, atol=1e-6)
    # Qcur is the last node of that name: post-RoPE, i.e. the ROPE op
    assert [op for name, op, _ in o.last_capture_log if name == "Qcur-0"][-1] == "ROPE"
    # selective capture and single-token rank preservation
    s = o.intermediates(IDS[:1], names=["Qcur-1", "l_out-*"])
    assert set(s) == {"Qcur-1", "l_out-0", "l_out-1"}
    assert s["Qcur-1"].shape == (1, 4, 64) and s["l_out-1"].shape == (1, 256)
    # the tensors of a list that this family's graph evaluates, in evaluation order; the others left out
    shared_order, shared = o.shared_intermediates(IDS, ["l_out-1", "attn_norm-0", "no_such_tensor-0"])
    assert shared_order == ["attn_norm-0", "l_out-1"] and set(shared) == {"attn_norm-0", "l_out-1"}


@pytest.mark.oracle
def test_intermediates_unknown_name_raises(oracles):
    from alchemist.harness import OracleError

    with pytest.raises(OracleError, match="no tensor named"):
        oracles["llama"].intermediates(IDS, names=["no_such_tensor-0"])


def _gguf_f32(path, name):
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == name)
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # numpy order
    return dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float64)


@pytest.mark.oracle
def test_attn_norm_matches_independent_numpy(oracles, f32_paths):
    """RMSNorm of the token-embedding rows, computed from the file with gguf-py, matches llama.cpp."""
    path = f32_paths["llama"]
    emb = _gguf_f32(path, "token_embd.weight")  # (n_vocab, n_embd)
    w = _gguf_f32(path, "blk.0.attn_norm.weight")
    wv = _gguf_f32(path, "blk.0.attn_v.weight")  # (n_kv*head_dim, n_embd)
    eps = 1e-6
    x = emb[IDS]
    ref = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    got = oracles["llama"].intermediates(IDS, names=["embd", "attn_norm-0", "Vcur-0"])
    assert np.allclose(got["embd"], x, atol=0)  # get_rows of an F32 table is exact
    assert np.allclose(got["attn_norm-0"], ref, rtol=1e-5, atol=1e-5)
    assert nmse(got["attn_norm-0"], ref) < 1e-10
    # V has no RoPE: a plain projection of the normed rows, (T, n_kv, head_dim)
    v = (ref @ wv.T).reshape(len(IDS), 2, 64)
    assert np.allclose(got["Vcur-0"], v, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ quantization


@pytest.fixture(scope="session")
def quantized(llama_cpp, f32_paths, fixture_dir):
    from alchemist.harness import quantize_fixture

    return {
        q: quantize_fixture(f32_paths["qwen3"], fixture_dir / f"qwen3-{q}.gguf", q, nthread=1) for q in FIXTURE_QTYPES
    }


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", FIXTURE_QTYPES)
def test_quantize_fixture_produces_type(quantized, oracles, qtype):
    from alchemist.gguf_io import read_gguf
    from alchemist.harness import LlamaCppOracle

    rep = quantized[qtype]
    assert rep.path.is_file()
    assert qtype in rep.type_counts, str(rep)
    assert rep.types_of("attn_q.weight") == {qtype}
    assert rep.types_of("attn_norm.weight") == {"F32"}  # 1-D tensors stay F32
    assert rep.tensor_types == {n: i.ggml_type for n, i in read_gguf(rep.path).tensors.items()}
    with LlamaCppOracle(rep.path, n_ctx=64, n_threads=1) as o:
        q = o.logits(IDS)
    ref = oracles["qwen3"].logits(IDS)
    m = compare_logits(q, ref)
    assert np.all(np.isfinite(q))
    # quantization noise, not another model (llama.cpp's own file against its F32 logits); ternary TQ2_0 / TQ1_0
    # keep about half of a random Gaussian matrix's signal (its block maximum sets the scale: most weights round to 0)
    floor = {"Q2_K": 0.75, "TQ2_0": 0.4, "TQ1_0": 0.4}.get(qtype, 0.9)
    assert m.mean_pearson > floor, str(m)


@pytest.mark.oracle
def test_quantize_pure_and_errors(llama_cpp, f32_paths, fixture_dir):
    from alchemist.harness import OracleError, ftype_for, quantize_fixture

    assert ftype_for("Q4_K") == "Q4_K_M" and ftype_for("q4_k_s") == "Q4_K_S"
    with pytest.raises(ValueError):
        ftype_for("Q7_X")
    rep = quantize_fixture(f32_paths["qwen3"], fixture_dir / "qwen3-Q4_K-pure.gguf", "Q4_K", pure=True, nthread=1)
    assert {t for n, t in rep.tensor_types.items() if n.endswith(".weight") and "norm" not in n} == {"Q4_K"}
    with pytest.raises(OracleError):
        quantize_fixture(fixture_dir / "missing.gguf", fixture_dir / "out.gguf", "Q8_0")


@pytest.mark.oracle
def test_a_quantization_llamacpp_refuses_says_why(llama_cpp, tmp_path):
    """deepseek2's attn_k_b rows of 64 are no whole Q1_0 block (128) and Q1_0 has no fallback type: the error carries
    llama.cpp's reason, not its dump of the file's metadata."""
    from alchemist.fixtures import write_fixture
    from alchemist.harness import OracleError, quantize_fixture

    f32 = write_fixture(tmp_path / "ds.gguf", "deepseek2")
    with pytest.raises(OracleError) as info:
        quantize_fixture(f32, tmp_path / "out.gguf", "Q1_0", nthread=1)
    assert "not divisible by 128" in str(info.value) and "no tensor type fallback" in str(info.value)
    assert "llama_model_loader" not in str(info.value)
