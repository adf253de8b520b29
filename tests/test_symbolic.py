"""The model as PyTensor expressions: log-probabilities equal the engine's, compile on C and JAX alike, and
their gradients (through the quantized kernels too) agree with finite differences."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")  # the Q4_K fixture comes from llama.cpp's quantizer

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

from alchemist import load_llm  # noqa: E402
from alchemist.errors import AlchemistError  # noqa: E402
from alchemist.explain import saliency, saliency_function  # noqa: E402
from alchemist.symbolic import embedding_rows  # noqa: E402

PROMPT = "hello world"
TARGET = " the cat sat"


@pytest.fixture(scope="module")
def models(fixture_files):
    """(arch, weight type) -> a model loaded on C: float32 weights for F32, GGUF blocks for Q4_K."""
    cache = {}

    def get(arch, wtype):
        if (arch, wtype) not in cache:
            # numerics "exact": the expressions are the generated module's (differentiable), the engine must match
            cache[arch, wtype] = load_llm(
                fixture_files(arch, wtype), backend="c", context=64, progress=False, compile_now=False, numerics="exact"
            )
        return cache[arch, wtype]

    return get


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("wtype", ["F32", "Q4_K"])
def test_token_log_probs_equal_the_engines(models, wtype):
    model = models("llama", wtype)
    assert model.engine.weights["blk.0.attn_q.weight"].dtype == ("float32" if wtype == "F32" else "uint8")
    ids = model.tokenizer.encode(PROMPT + TARGET)
    got = pytensor.function([], model.token_log_probs(ids), mode=model.mode)()
    want = _log_softmax(model.engine.run(ids, 0, all_logits=True))
    want = np.array([want[t - 1, ids[t]] for t in range(1, len(ids))])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)


def test_given_text_scores_only_the_continuation(models):
    model = models("llama", "F32")
    prompt = model.tokenizer.encode(PROMPT)
    rest = model.tokenizer.encode(TARGET, add_special_tokens=False)
    by_text = pytensor.function([], model.token_log_probs(TARGET, given=PROMPT), mode=model.mode)()
    full = pytensor.function([], model.token_log_probs(prompt + rest), mode=model.mode)()
    assert by_text.shape == (len(rest),)
    np.testing.assert_allclose(by_text, full[len(prompt) - 1 :], rtol=1e-6)
    lp = pytensor.function([], model.log_prob(TARGET, given=PROMPT), mode=model.mode)()
    np.testing.assert_allclose(lp, by_text.sum(), rtol=1e-5)


def test_log_prob_is_the_same_number_on_c_and_jax(models):
    model = models("llama", "Q4_K")
    lp = model.log_prob(TARGET, given=PROMPT)
    on_c = float(pytensor.function([], lp, mode=model.mode)())
    on_jax = float(pytensor.function([], lp, mode="JAX")())
    assert on_c < 0
    assert abs(on_c - on_jax) <= 1e-5 * abs(on_c)


def test_symbolic_ids_and_logits(models):
    model = models("llama", "F32")
    ids = model.tokenizer.encode(PROMPT)
    tokens = pt.tensor("ids", dtype="int64", shape=(len(ids),))
    f = pytensor.function([tokens], model.symbolic_logits(tokens), mode=model.mode)
    np.testing.assert_allclose(f(np.array(ids)), model.engine.run(ids, 0, all_logits=True), rtol=1e-5, atol=1e-4)


def _richardson(f, x, v, h):
    """Central difference of f along v with Richardson extrapolation (error O(h^4))."""

    def central(step):
        return (float(f(x + step * v)) - float(f(x - step * v))) / (2 * step)

    return (4 * central(h / 2) - central(h)) / 3


@pytest.mark.parametrize("arch,wtype", [("llama", "F32"), ("llama", "Q4_K"), ("gemma3", "Q4_K")])
def test_embedding_gradient_matches_finite_differences(models, arch, wtype):
    model = models(arch, wtype)
    fn, ids, n_prompt = saliency_function(model, TARGET, PROMPT)
    emb = embedding_rows(model, ids)
    _, grad = fn(emb)
    grad = np.asarray(grad, np.float64)
    assert np.abs(grad[-1]).max() == 0  # the last target token's embedding feeds no scored logit

    def log_p(e):
        return fn(e.astype(np.float32))[0]

    # along the whole gradient, and along the gradient of the two most salient tokens alone
    directions = [grad]
    for t in np.argsort(-np.linalg.norm(grad, axis=1))[:2]:
        only = np.zeros_like(grad)
        only[t] = grad[t]
        directions.append(only)
    for v in directions:
        v = v / np.linalg.norm(v)
        analytic = float((grad * v).sum())
        numeric = _richardson(log_p, emb.astype(np.float64), v, 2e-2)
        assert abs(numeric - analytic) <= 1e-3 * abs(analytic), (numeric, analytic)


def test_weight_gradients_where_the_weights_are_float(models):
    f32 = models("llama", "F32")
    lp = f32.log_prob(TARGET, given=PROMPT)
    norm = f32.engine.weights["output_norm.weight"]
    fn = pytensor.function([], [lp, pytensor.grad(lp, norm)], mode=f32.mode)
    value, grad = fn()
    base = norm.get_value().copy()
    v = (grad / np.linalg.norm(grad)).astype(np.float32)
    h = 1e-2
    values = []
    for step in (h, -h, h / 2, -h / 2):
        norm.set_value(base + np.float32(step) * v)
        values.append(float(fn()[0]))
    norm.set_value(base)
    numeric = (4 * (values[2] - values[3]) / h - (values[0] - values[1]) / (2 * h)) / 3
    assert abs(numeric - np.linalg.norm(grad)) <= 1e-3 * np.linalg.norm(grad)

    q4 = models("llama", "Q4_K")
    blocks = q4.engine.weights["blk.0.attn_q.weight"]
    assert blocks.dtype == "uint8"
    with pytest.raises(pytensor.gradient.NullTypeGradError, match="not differentiable"):
        pytensor.grad(q4.log_prob(TARGET, given=PROMPT), blocks)


def test_saliency_table(models):
    model = models("llama", "F32")
    result = saliency(model, TARGET, PROMPT)
    n = len(result.token_ids)
    assert result.grad_x_input.shape == result.grad_norm.shape == (n,)
    np.testing.assert_allclose(result.grad_x_input, (result.gradient * result.embeddings).sum(axis=1), rtol=1e-6)
    lines = result.table().splitlines()
    assert len(lines) == n + 2 and "log p(target | prompt)" in lines[0]
    assert "".join(result.pieces).endswith(TARGET)


def test_bad_input_is_a_clear_error(models):
    model = models("llama", "F32")
    with pytest.raises(AlchemistError, match="out of range"):
        model.log_prob([1, model.ir.n_vocab + 5])
    with pytest.raises(AlchemistError, match="at least 2 tokens"):
        model.log_prob([1])
    with pytest.raises(AlchemistError, match="static length"):
        model.symbolic_logits(pt.lvector("ids"))
    with pytest.raises(AlchemistError, match="text or a list of token ids"):
        model.log_prob(3.5, given="x")


def test_explain_cli(fixture_files, tmp_path, capsys):
    from alchemist.cli import main

    out = tmp_path / "saliency.png"
    path = str(fixture_files("llama", "F32"))
    assert main(["explain", path, "--prompt", PROMPT, "--target", TARGET, "-o", str(out), "--context", "64"]) == 0
    text = capsys.readouterr().out
    assert "grad·input" in text and "target" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["explain", path, "--prompt", PROMPT]) == 2
