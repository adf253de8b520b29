"""The generated graph's pieces against plain numpy, and the KV-cached engine on every backend."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from alchemist.errors import AlchemistError, BackendUnavailableError
from alchemist.fixtures import FixtureConfig, write_fixture
from alchemist.runtime.backends import BACKENDS, get_mode
from alchemist.runtime.engine import Engine
from alchemist.runtime.sampling import Sampler, SamplingParams

C_MODE = get_mode("c")
RNG = np.random.default_rng(1234)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def compile_c(inputs, output):
    return pytensor.function(inputs, output, mode=C_MODE)


# ------------------------------------------------------------------------------ numpy references


def np_rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps) * w


def np_rope(x, positions, base, style, rope_dim):
    """Reference RoPE, written from the RoFormer formula and llama.cpp's two pairings."""
    out = x.astype(np.float64).copy()
    half = rope_dim // 2
    for t, pos in enumerate(positions):
        for i in range(half):
            theta = pos * base ** (-2.0 * i / rope_dim)
            c, s = np.cos(theta), np.sin(theta)
            a, b = (2 * i, 2 * i + 1) if style == "norm" else (i, i + half)
            x0, x1 = x[t, :, a].astype(np.float64), x[t, :, b].astype(np.float64)
            out[t, :, a] = x0 * c - x1 * s
            out[t, :, b] = x0 * s + x1 * c
    return out


def np_attention(q, keys, values, q_pos, window, scale, n_kv):
    """Naive per-head causal attention: query head h reads KV head h // (n_head / n_kv)."""
    T, H, D = q.shape
    group = H // n_kv
    out = np.zeros((T, H, D))
    for h in range(H):
        kv = h // group
        for t in range(T):
            s = keys[:, kv, :].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            k_pos = np.arange(keys.shape[0])
            visible = k_pos <= q_pos[t]
            if window:
                visible &= q_pos[t] - k_pos < window
            s = np.where(visible, s, -np.inf)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ values[:, kv, :]
    return out.reshape(T, H * D)


# ------------------------------------------------------------------------------ per-op numerics


def test_rms_norm_matches_numpy(tiny_module):
    mod, _ = tiny_module("qwen2")
    x, w = pt.matrix("x", dtype="float32"), pt.vector("w", dtype="float32")
    fn = compile_c([x, w], mod.rms_norm(x, w))
    xv, wv = f32(5, 256), f32(256)
    np.testing.assert_allclose(fn(xv, wv), np_rms_norm(xv, wv, mod.NORM_EPS), rtol=2e-5, atol=1e-6)


def test_layer_norm_matches_numpy(tiny_module):
    mod, _ = tiny_module("gpt2")
    x = pt.matrix("x", dtype="float32")
    w, b = pt.vector("w", dtype="float32"), pt.vector("b", dtype="float32")
    fn = compile_c([x, w, b], mod.layer_norm(x, w, b))
    xv, wv, bv = f32(5, 256) + 3.0, f32(256), f32(256)
    mean = xv.astype(np.float64).mean(-1, keepdims=True)
    var = ((xv - mean) ** 2).mean(-1, keepdims=True)
    expected = (xv - mean) / np.sqrt(var + mod.NORM_EPS) * wv + bv
    np.testing.assert_allclose(fn(xv, wv, bv), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("arch, style", [("llama", "norm"), ("qwen2", "neox")])
def test_rope_matches_numpy(tiny_module, arch, style):
    mod, _ = tiny_module(arch)
    assert mod.__dict__["rope"].__doc__  # the module documents its pairing
    x = pt.tensor("x", dtype="float32", shape=(None, None, mod.HEAD_DIM))
    pos = pt.vector("pos", dtype="int64")
    angles = pos.astype("float32")[:, None] * mod.rope_frequencies(0)[None, :]
    fn = compile_c([x, pos], mod.rope(x, angles))
    xv = f32(6, 3, mod.HEAD_DIM)
    positions = np.array([0, 1, 2, 7, 100, 511])
    expected = np_rope(xv, positions, mod.ROPE_BASE[0], style, mod.ROPE_DIM)
    np.testing.assert_allclose(fn(xv, positions), expected, rtol=1e-4, atol=2e-4)
    # the other pairing is measurably different: a NORM/NEOX mix-up cannot pass this test
    other = np_rope(xv, positions, mod.ROPE_BASE[0], "neox" if style == "norm" else "norm", mod.ROPE_DIM)
    assert np.abs(fn(xv, positions) - other).max() > 0.1


@pytest.mark.parametrize("window", [0, 3])
def test_grouped_attention_matches_numpy(tiny_module, window):
    mod, _ = tiny_module("qwen3")
    T, S = 4, 9
    q = pt.tensor("q", dtype="float32", shape=(T, mod.N_HEAD, mod.HEAD_DIM))
    k = pt.tensor("k", dtype="float32", shape=(None, mod.N_KV_HEAD, mod.HEAD_DIM))
    v = pt.tensor("v", dtype="float32", shape=(None, mod.N_KV_HEAD, mod.HEAD_DIM))
    qp, kp = pt.vector("qp", dtype="int64"), pt.vector("kp", dtype="int64")
    # one sequence: the batch axis of keys and positions is 1
    fn = compile_c([q, k, v, qp, kp], mod.causal_attention(q, k[None], v[None], qp[None], kp[None], window))
    qv, kv, vv = f32(T, mod.N_HEAD, mod.HEAD_DIM), f32(S, mod.N_KV_HEAD, mod.HEAD_DIM), f32(S, mod.N_KV_HEAD, mod.HEAD_DIM)
    q_pos = np.array([5, 6, 7, 8])
    ours = fn(qv, kv, vv, q_pos, np.arange(S))
    ref = np_attention(qv, kv, vv, q_pos, window, mod.SCORE_SCALE, mod.N_KV_HEAD)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_final_logit_softcap(tmp_path):
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import import_generated

    cfg = FixtureConfig(arch="gemma3", metadata=(("final_logit_softcapping", 2.0),))
    path = write_fixture(tmp_path / "capped.gguf", "gemma3", config=cfg)
    mod = import_generated(write_generated(build_model_ir(read_gguf(path)), tmp_path))
    assert mod.FINAL_LOGIT_SOFTCAP == 2.0
    logits = Engine(mod, mod.load_weights(str(path)), "c", 16).run([1, 5, 9], 0, all_logits=True)
    assert np.abs(logits).max() < 2.0  # tanh-capped
    assert np.abs(logits).max() > 1.0  # and not trivially zero


# ------------------------------------------------------------------------------ engine


@pytest.fixture(scope="session")
def oracle_factory():
    pytest.importorskip("llama_cpp")
    from alchemist.harness import LlamaCppOracle

    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = LlamaCppOracle(str(path), n_ctx=64, n_threads=1)
        return cache[path]

    yield get
    for o in cache.values():
        o.close()


PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500]


def nmse(a, b):
    return float(((a - b) ** 2).sum() / (b**2).sum())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_c_backend_matches_llama_cpp_on_every_family(tiny_module, oracle_factory, arch):
    mod, path = tiny_module(arch)
    engine = Engine(mod, mod.load_weights(str(path)), "c", 64)
    ours = engine.run(PROMPT, 0, all_logits=True)
    ref = oracle_factory(path).logits(PROMPT)
    assert ours.shape == ref.shape == (len(PROMPT), mod.N_VOCAB)
    assert nmse(ours, ref) <= 1e-6
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="session")
def engines(tiny_module):
    """One engine per backend on the qwen2 fixture (compiled functions are reused across tests)."""
    mod, path = tiny_module("qwen2")
    weights = mod.load_weights(str(path))
    return {b: Engine(mod, weights, b, 64) for b in BACKENDS}


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_prefill_matches_oracle(engines, tiny_module, oracle_factory, backend):
    _, path = tiny_module("qwen2")
    engine = engines[backend]
    ours = engine.run(PROMPT, 0, all_logits=True)
    assert nmse(ours, oracle_factory(path).logits(PROMPT)) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_cached_decode_equals_full_recompute_and_compiles_once(engines, backend):
    engine = engines[backend]
    rng = np.random.default_rng(7)
    seq = rng.integers(0, 512, 26).tolist()
    full = engine.run(seq, 0, all_logits=True)  # whole sequence, fresh prefix recompute
    engine.reset()
    engine.run(seq[:6], 0)
    engine.run([seq[6]], 6)  # compiles decode if it is not compiled yet
    compiled = engine.stats.compile_count
    for pos in range(7, 26):  # 19 more decode steps + the one above = 20
        step = engine.run([seq[pos]], pos)
        np.testing.assert_allclose(step[0], full[pos], rtol=1e-4, atol=2e-4)
    assert engine.stats.compile_count == compiled, "decoding recompiled"


def test_a_short_prompt_goes_through_the_linked_decode_function(tiny_module):
    """A new engine with only its decode function linked feeds a prompt of <= SHORT_PROMPT tokens one token at a
    time (no prefill function is linked for it) and gets the prefill's logits; once the prefill function is
    linked, or the prompt is longer, or all logits are asked for, the prefill function runs."""
    from alchemist.runtime.engine import SHORT_PROMPT

    mod, path = tiny_module("qwen2")
    engine = Engine(mod, mod.load_weights(str(path)), "c", 64)
    engine.precompile([(1, False)])
    prompt = PROMPT[:SHORT_PROMPT]
    stepped = engine.run(prompt, 0)
    assert set(engine._functions) == {(1, False)}
    engine.reset()
    prefilled = engine.run(prompt, 0, all_logits=True)[-1:]
    assert (SHORT_PROMPT, True) in engine._functions
    np.testing.assert_allclose(stepped, prefilled, rtol=1e-4, atol=2e-4)
    engine.precompile([(SHORT_PROMPT, False)])
    np.testing.assert_allclose(engine.run(prompt, 0), stepped, rtol=1e-4, atol=2e-4)
    engine.run(list(range(3, 3 + SHORT_PROMPT + 1)), 0)  # longer: its bucket's prefill function
    assert (32, False) in engine._functions


def test_sliding_window_decode_matches_oracle_past_the_window(tiny_module, oracle_factory):
    """gemma3 fixture: window 8 on layer 0; 20 positions cross it several times."""
    mod, path = tiny_module("gemma3")
    engine = Engine(mod, mod.load_weights(str(path)), "c", 64)
    seq = [2] + list(range(10, 29))
    engine.run(seq[:3], 0)
    steps = [engine.run([t], i + 3)[0] for i, t in enumerate(seq[3:])]
    ref = oracle_factory(path).logits(seq)
    assert nmse(np.stack(steps), ref[3:]) <= 1e-6


def test_context_overflow_is_a_clear_error(engines):
    with pytest.raises(AlchemistError, match="context overflow"):
        engines["c"].run(list(range(70)), 0)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match="unknown backend 'cuda'"):
        get_mode("cuda")


# ------------------------------------------------------------------------------ API + sampling


def test_load_llm_and_inference_greedy_equals_oracle(tiny_gguf, oracle_factory, tmp_path):
    from alchemist import inference, load_llm

    path = tiny_gguf("qwen3")
    model = load_llm(path, backend="c", context=64, generated_dir=tmp_path, progress=False)
    result = inference(model, input=PROMPT, max_tokens=12)
    assert result.output_token_ids == oracle_factory(path).greedy(PROMPT, 12)
    report = result.report
    assert report["compilations"]["during_decode"] == 0
    assert report["generated_tokens"] == 12 and report["timings"]["decode_tok_per_s"] > 0
    assert report["memory"]["peak_rss_mb"] > 0
    # a second call compiles nothing new
    again = inference(model, input=PROMPT, max_tokens=12)
    assert again.output_token_ids == result.output_token_ids and again.report["compilations"]["this_call"] == 0
    # the first call compiled (or linked) its prefill bucket inside the prefill; the rate leaves that out
    first, second = report["timings"], again.report["timings"]
    assert first["prefill_compile_s"] > 0 and second["prefill_compile_s"] == 0
    assert first["first_token_s"] >= first["prefill_s"] + first["prefill_compile_s"] - 1e-3


def test_sampler_behaviour():
    logits = np.array([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams())(logits, []) == 1
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=0))(logits, []) == 1
    draws = [Sampler(SamplingParams(temperature=1.0, seed=s))(logits, []) for s in range(50)]
    assert draws == [Sampler(SamplingParams(temperature=1.0, seed=s))(logits, []) for s in range(50)]
    assert {1, 2} <= set(draws)
    # top_p small keeps only the best token
    assert {Sampler(SamplingParams(temperature=1.0, top_p=0.01, seed=s))(logits, []) for s in range(20)} == {1}
    # repetition penalty pushes a seen token below its rival
    assert Sampler(SamplingParams(repetition_penalty=1.5))(logits, [1]) == 2
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_text_in_text_out_with_streaming(tiny_gguf, oracle_factory, tmp_path):
    from alchemist import inference, load_llm

    path = tiny_gguf("qwen2")
    model = load_llm(path, backend="c", context=64, generated_dir=tmp_path, progress=False)
    pieces: list[str] = []
    result = inference(model, input="the cat and the dog", max_tokens=10, stream=pieces.append)
    oracle = oracle_factory(path)
    prompt = oracle.tokenize("the cat and the dog", add_special=True, special=True)
    assert result.prompt_token_ids == prompt
    expected = oracle.greedy(prompt, 10, stop_at_eog=True)
    assert result.output_token_ids == [t for t in expected if not oracle.is_eog(t)][: len(result.output_token_ids)]
    assert "".join(pieces) == result.output == model.tokenizer.decode(result.output_token_ids)
    # chat on a GGUF without a template falls back to plain text and says so
    chat = inference(model, input=[{"role": "user", "content": "the cat"}], max_tokens=2)
    assert "chat_template" in chat.report
