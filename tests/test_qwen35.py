"""qwen35, the gated delta-net hybrid: its layers and states from the metadata, the delta-net mixer against a
numpy rendering of llama.cpp's per-token gated delta rule across chunk boundaries and padding, the gated
attention, `alchemist diff` naming the delta-net op when one of its weights is perturbed, and Qwen3-Next's fused
layouts and interleaved k heads against llama.cpp. The states' cache contract (against llama.cpp, per slot, in
chat) is in test_recurrent.py."""

from __future__ import annotations

import numpy as np
import pytest

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 5, 77, 300, 12, 9, 400, 33, 21]


@pytest.fixture(scope="module")
def qwen35_path(fixture_files):
    return str(fixture_files("qwen35", "F32"))


@pytest.fixture(scope="module")
def qwen35(qwen35_path):
    from alchemist.harness.validate import load_for_validation

    return load_for_validation(qwen35_path)


def _nmse(a, b) -> float:
    return float(np.sum((np.asarray(a, np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


def test_delta_net_layers_and_their_states_come_from_the_metadata(qwen35):
    ir, module = qwen35.ir, qwen35.module
    assert [lay.deltanet is not None for lay in ir.layers] == [True, True, True, False]  # every 4th attends
    dn = ir.layers[0].deltanet
    assert (dn.conv_kernel, dn.n_k_head, dn.n_v_head, dn.head_dim, dn.n_qkv) == (4, 2, 4, 64, 512)
    assert ir.tensor("blk.0.attn_qkv.weight").shape == (512, 256) and ir.tensor("blk.1.ssm_a").shape == (4,)
    att = ir.attention_layers[0].attention
    assert att.output_gate and att.qkv is None and ir.tensor("blk.3.attn_q.weight").shape == (2 * 4 * 64, 256)
    assert ir.layer_caches()[0] == (("conv_window", (3, 512)), ("delta", (4, 64, 64)))
    assert module.STATE_KINDS == ("conv_window", "delta") and module.DELTA_CHUNK == 64
    assert ir.layers[0].ffn_norm.weight == "post_attention_norm.weight"


def _delta_net_reference(params: dict, il: int, x: np.ndarray, module) -> np.ndarray:
    """llama.cpp's linear-attention layer for one sequence from zero states, token by token in float64 (the
    autoregressive gated delta rule of delta-net-base.cpp, k heads tiled over the v heads)."""
    p = f"blk.{il}."
    kh, vh, d, k_conv = module.DELTA_K_HEAD, module.DELTA_V_HEAD, module.DELTA_HEAD_DIM, module.DELTA_CONV
    x = x.astype(np.float64)
    qkv = x @ params[p + "attn_qkv.weight"].T
    z = (x @ params[p + "attn_gate.weight"].T).reshape(len(x), vh, d)
    beta = 1 / (1 + np.exp(-(x @ params[p + "ssm_beta.weight"].T)))
    g = np.log1p(np.exp(x @ params[p + "ssm_alpha.weight"].T + params[p + "ssm_dt.bias"])) * params[p + "ssm_a"]
    padded = np.concatenate([np.zeros((k_conv - 1, qkv.shape[1])), qkv])
    conv = np.stack([(padded[t : t + k_conv] * params[p + "ssm_conv1d.weight"].T).sum(0) for t in range(len(x))])
    conv = conv / (1 + np.exp(-conv))
    q, k = conv[:, : kh * d].reshape(-1, kh, d), conv[:, kh * d : 2 * kh * d].reshape(-1, kh, d)
    v = conv[:, 2 * kh * d :].reshape(-1, vh, d)
    q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), module.NORM_EPS) / np.sqrt(d)
    k = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), module.NORM_EPS)
    heads = np.arange(vh) % kh
    state, outs = np.zeros((vh, d, d)), []  # [head, k index, v index]
    for t in range(len(x)):
        state = state * np.exp(g[t])[:, None, None]
        kt, qt = k[t, heads], q[t, heads]
        delta = (v[t] - np.einsum("hkv,hk->hv", state, kt)) * beta[t][:, None]
        state = state + kt[:, :, None] * delta[:, None, :]
        outs.append(np.einsum("hkv,hk->hv", state, qt))
    out = np.stack(outs)
    out = out / np.sqrt((out**2).mean(-1, keepdims=True) + module.NORM_EPS) * params[p + "ssm_norm.weight"]
    out = (out * z / (1 + np.exp(-z))).reshape(len(x), vh * d)
    return out @ params[p + "ssm_out.weight"].T


def test_delta_net_matches_the_recurrence_across_chunks_and_padding(qwen35):
    """Three steps over one layer's states (130 tokens: three chunks of 64, the last padded; 2 real of a padded
    8; 1) give the per-token recurrence over all 133."""
    import pytensor
    import pytensor.tensor as pt

    module, il = qwen35.module, 1
    params = qwen35.weights_for("c", quantized=False)
    w = {k: pt.constant(v) for k, v in params.items() if k.startswith(f"blk.{il}.")}
    window, state = pt.matrix("window", dtype="float32"), pt.tensor3("state", dtype="float32")
    n_valid = pt.scalar("n_valid", dtype="int64")
    step = {}
    for n in (130, 8, 1):
        xn, pn = pt.matrix(f"x{n}", dtype="float32", shape=(n, module.N_EMBD)), pt.vector(
            f"p{n}", dtype="int64", shape=(n,)
        )
        outs = module.delta_net(module.EXACT, w, il, xn, pn, window, state, n_valid, None)
        step[n] = pytensor.function([xn, pn, window, state, n_valid], list(outs))

    rng = np.random.default_rng(2)
    xs = rng.standard_normal((133, module.N_EMBD)).astype(np.float32)
    win, st = np.full((3, 512), 5.0, np.float32), np.full((4, 64, 64), -1.0, np.float32)  # garbage: position 0 zeroes
    out1, win, st = step[130](xs[:130], np.arange(130), win, st, 130)
    padded = np.concatenate([xs[130:132], rng.standard_normal((6, module.N_EMBD)).astype(np.float32)])
    out2, win, st = step[8](padded, np.arange(130, 138), win, st, 2)
    out3, win, st = step[1](xs[132:], np.arange(132, 133), win, st, 1)
    want = _delta_net_reference(params, il, xs, module)
    assert _nmse(np.concatenate([out1, out2[:2], out3]), want) < 1e-10


def test_diff_names_the_delta_net_op_when_its_weights_are_perturbed(qwen35_path, perturbed_weight):
    import alchemist.harness.validate as validate_mod

    perturbed_weight("blk.1.ssm_norm.weight", 1.05)
    diff = validate_mod.diff_model(qwen35_path, "c", PROMPT[:6])
    assert diff["first_divergence"] == "final_output-1"
    rows = dict(diff["rows"])
    assert rows["attn_output-1"] <= 1e-6 < rows["final_output-1"]


@pytest.mark.parametrize("case", ["qwen3next", "qwen3next:fused"])
def test_qwen3next_layouts_match_llamacpp(case, fixture_files):
    """Fused [beta | alpha] per k head (and, in older files, [q | k | v | z] per k head), k heads interleaved over
    the v heads: a prompt, then decode steps through the states, against llama.cpp."""
    from alchemist.harness.oracle import LlamaCppOracle
    from alchemist.harness.validate import load_for_validation
    from alchemist.runtime.engine import Engine

    path = str(fixture_files(case, "F32"))
    loaded = load_for_validation(path)
    dn = loaded.ir.layers[0].deltanet
    assert not dn.k_heads_tiled and dn.beta_alpha == "ssm_ba.weight"
    assert (dn.qkvz is not None) == case.endswith(":fused") and (dn.qkv is None) == case.endswith(":fused")
    engine = Engine(loaded.module, loaded.weights_for("c"), "c", 64)
    with LlamaCppOracle(path, n_ctx=64, n_threads=1) as oracle:
        ref = oracle.logits(PROMPT)
    steps = [engine.run(PROMPT[:12], 0, all_logits=True)] + [
        engine.run([t], 12 + i, all_logits=True) for i, t in enumerate(PROMPT[12:])
    ]
    assert _nmse(np.concatenate(steps), ref) < 1e-9


def test_the_delta_net_composes_as_a_graph(qwen35_path, composes_as_a_graph):
    """alchemist.symbolic over a recurrent model: log p(ids) equals the engine's, and its gradient reaches the
    delta-net's decay rates A through the chunked delta rule."""
    composes_as_a_graph(qwen35_path, "blk.1.ssm_a", PROMPT[:9])
