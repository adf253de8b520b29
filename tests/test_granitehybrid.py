"""granitehybrid, the Mamba-2 hybrid: its layers and states from the metadata, the mixer against a numpy
rendering of llama.cpp's build_mamba2_layer (ssm_conv, ssm_scan, D, the gated group norm) across steps and
padding, and `alchemist diff` naming the Mamba-2 op when one of its weights is perturbed. The states' cache
contract (against llama.cpp, per slot, in chat) is in test_recurrent.py."""

from __future__ import annotations

import numpy as np
import pytest

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 5, 77, 300, 12, 9, 400, 33, 21]


@pytest.fixture(scope="module")
def hybrid_path(fixture_files):
    return str(fixture_files("granitehybrid", "F32"))


@pytest.fixture(scope="module")
def hybrid_loaded(hybrid_path):
    from alchemist.harness.validate import load_for_validation

    return load_for_validation(hybrid_path)


def _nmse(a, b) -> float:
    return float(np.sum((np.asarray(a, np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


def test_mamba2_layers_and_their_states_come_from_the_metadata(hybrid_loaded):
    ir, module = hybrid_loaded.ir, hybrid_loaded.module
    assert [lay.ssm is not None for lay in ir.layers] == [True, False, True, True]
    assert [lay.index for lay in ir.attention_layers] == [1]
    ssm = ir.layers[0].ssm
    assert (ssm.conv_kernel, ssm.n_inner, ssm.n_state, ssm.n_head, ssm.n_group) == (4, 512, 16, 8, 2)
    assert (ssm.head_dim, ssm.n_xbc) == (64, 576)
    assert ir.tensor("blk.0.ssm_in.weight").shape == (2 * 512 + 2 * 2 * 16 + 8, 256)
    assert ir.tensor("blk.2.ssm_a").shape == (8, 1) and ir.tensor("blk.3.ssm_norm.weight").shape == (2, 256)
    names = {t.name for t in ir.tensors}
    assert "blk.0.attn_q.weight" not in names and "blk.1.ssm_in.weight" not in names
    # the states: the same size whatever the context
    assert ir.layer_caches()[:2] == (
        (("conv_window", (3, 576)), ("ssm", (8, 64, 16))),
        (("k", (2, 64)), ("v", (2, 64))),
    )
    assert module.STATE_KINDS == ("conv_window", "ssm") and module.LAYER_CACHES == ir.layer_caches()
    assert module.SSM_LAYERS == (True, False, True, True)
    # Granite's scales, and no RoPE (rope.scaling.finetuned = false, as in Granite 4.0)
    assert module.EMBED_SCALE == 2.0 and module.RESIDUAL_SCALE == 0.5 and module.LOGIT_SCALE == 0.25
    assert not hasattr(module, "ROPE_DIM")


def _mamba2_reference(params: dict, il: int, x: np.ndarray, module) -> np.ndarray:
    """llama.cpp's build_mamba2_layer for one sequence from zero states, token by token in float64:
    ssm_conv, + bias, silu; ssm_scan's recurrence; + D·x; · silu(z); RMSNorm per group; out_proj."""
    p = f"blk.{il}."
    inner, xbc_n, heads, hd = module.SSM_INNER, module.SSM_XBC, module.SSM_HEAD, module.SSM_HEAD_DIM
    groups, n_state, k = module.SSM_GROUP, module.SSM_STATE, module.SSM_CONV
    zxbcdt = x.astype(np.float64) @ params[p + "ssm_in.weight"].T
    z, xbc, dt = zxbcdt[:, :inner], zxbcdt[:, inner : inner + xbc_n], zxbcdt[:, inner + xbc_n :]
    padded = np.concatenate([np.zeros((k - 1, xbc_n)), xbc])
    conv = np.stack([(padded[t : t + k] * params[p + "ssm_conv1d.weight"].T).sum(axis=0) for t in range(len(x))])
    conv = conv + params[p + "ssm_conv1d.bias"]
    conv = conv / (1 + np.exp(-conv))
    xs = conv[:, :inner].reshape(-1, heads, hd)
    b = conv[:, inner : inner + groups * n_state].reshape(-1, groups, n_state)
    c = conv[:, inner + groups * n_state :].reshape(-1, groups, n_state)
    a, d = params[p + "ssm_a"][:, 0], params[p + "ssm_d"][:, 0]
    state, ys = np.zeros((heads, hd, n_state)), []
    for t in range(len(x)):
        dt_t = np.log1p(np.exp(dt[t] + params[p + "ssm_dt.bias"]))
        g = np.arange(heads) // (heads // groups)
        state = state * np.exp(dt_t * a)[:, None, None] + (xs[t] * dt_t[:, None])[:, :, None] * b[t][g][:, None, :]
        ys.append((state * c[t][g][:, None, :]).sum(-1) + xs[t] * d[:, None])
    y = np.stack(ys).reshape(len(x), inner) * (z / (1 + np.exp(-z)))
    y = y.reshape(len(x), groups, -1)
    y = y / np.sqrt((y**2).mean(-1, keepdims=True) + module.NORM_EPS) * params[p + "ssm_norm.weight"]
    return y.reshape(len(x), inner) @ params[p + "ssm_out.weight"].T


def test_mamba2_matches_the_recurrence_across_steps_and_padding(hybrid_loaded):
    """Three steps over one layer's states (5 tokens; 2 real of a padded 4; 3) give the recurrence over all 10."""
    import pytensor
    import pytensor.tensor as pt

    module, il = hybrid_loaded.module, 2
    params = hybrid_loaded.weights_for("c", quantized=False)
    w = {k: pt.constant(v) for k, v in params.items() if k.startswith(f"blk.{il}.")}
    x = pt.matrix("x", dtype="float32")
    positions = pt.vector("positions", dtype="int64")
    window, state = pt.matrix("window", dtype="float32"), pt.tensor3("state", dtype="float32")
    n_valid = pt.scalar("n_valid", dtype="int64")
    step = {}
    for n in (5, 4, 3):
        xn, pn = pt.matrix(f"x{n}", dtype="float32", shape=(n, module.N_EMBD)), pt.vector(
            f"p{n}", dtype="int64", shape=(n,)
        )
        outs = module.mamba2(module.EXACT, w, il, xn, pn, window, state, n_valid, None)
        step[n] = pytensor.function([xn, pn, window, state, n_valid], list(outs))

    rng = np.random.default_rng(1)
    xs = rng.standard_normal((10, module.N_EMBD)).astype(np.float32)
    # states full of garbage: position 0 must start from zeros
    win, st = np.full((3, 576), 7.0, np.float32), np.full((8, 64, 16), -3.0, np.float32)
    out1, win, st = step[5](xs[:5], np.arange(5), win, st, 5)
    padded = np.concatenate([xs[5:7], rng.standard_normal((2, module.N_EMBD)).astype(np.float32)])
    out2, win, st = step[4](padded, np.arange(5, 9), win, st, 2)
    out3, win, st = step[3](xs[7:], np.arange(7, 10), win, st, 3)
    want = _mamba2_reference(params, il, xs, module)
    got = np.concatenate([out1, out2[:2], out3])
    assert _nmse(got, want) < 1e-10


def test_diff_names_the_mamba2_op_when_its_weights_are_perturbed(hybrid_path, perturbed_weight):
    import alchemist.harness.validate as validate_mod

    perturbed_weight("blk.2.ssm_a", 1.05)
    diff = validate_mod.diff_model(hybrid_path, "c", PROMPT[:6])
    assert diff["first_divergence"] == "mamba2_y_add_d-2"
    rows = dict(diff["rows"])
    assert rows["attn_norm-2"] <= 1e-6 < rows["mamba2_y_add_d-2"]
