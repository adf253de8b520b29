"""Numerics modes (alchemist.runtime.numerics): "ggml" computes what llama.cpp's CPU backend computes, "exact" what
the generated module says, both as bundles of primitives its layers call through `ops` (no function of a loaded
module is ever replaced); a ggml engine is cached on disk under its own keys; a failing exact validation is
attributed (or not) to llama.cpp's activation rounding; greedy disagreements must be within-noise ties."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from alchemist.errors import AlchemistError
from alchemist.harness.metrics import greedy_agreement
from alchemist.runtime import graph_cache
from alchemist.runtime.engine import Engine, import_generated, is_as_imported
from alchemist.kernels import gelu_table
from alchemist.runtime.numerics import NUMERICS, primitives, resolve_numerics

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]  # token 1 only at position 0
DECODE = [9, 4, 13, 6]
CONTEXT = 32


# ------------------------------------------------------------------------------------------ modes and copies
def test_unknown_numerics_is_a_clear_error(tiny_gguf):
    from alchemist import load_llm
    from alchemist.cli import main

    assert NUMERICS == ("ggml", "exact")
    with pytest.raises(AlchemistError, match=r"numerics='fp16': unknown numerics mode \(choose from ggml, exact\)"):
        load_llm(tiny_gguf("qwen2"), numerics="fp16", progress=False, compile_now=False)
    with pytest.raises(AlchemistError, match="--llamacpp-rounding means --numerics ggml"):
        resolve_numerics("exact", llamacpp_rounding=True)
    assert resolve_numerics(None) == "ggml" and resolve_numerics(None, llamacpp_rounding=True) == "ggml"
    with pytest.raises(SystemExit) as exit_info:  # argparse: a bad choice is a usage error (status 2)
        main(["run", str(tiny_gguf("qwen2")), "--numerics", "fp16"])
    assert exit_info.value.code == 2


def test_every_model_loading_command_takes_numerics():
    from alchemist.cli import _numerics, build_parser

    parser = build_parser()
    for command in (
        ["run", "m"],
        ["chat", "m"],
        ["serve", "m"],
        ["validate", "m"],
        ["diff", "m"],
        ["perplexity", "m", "f"],
    ):
        assert _numerics(parser.parse_args(command)) == "ggml"  # the default
        assert _numerics(parser.parse_args(command + ["--numerics", "exact"])) == "exact"
    for command in (["validate", "m"], ["diff", "m"], ["perplexity", "m", "f"]):  # the older flag still works
        assert _numerics(parser.parse_args(command + ["--llamacpp-rounding"])) == "ggml"
        with pytest.raises(AlchemistError, match="contradicts numerics='exact'"):
            _numerics(parser.parse_args(command + ["--llamacpp-rounding", "--numerics", "exact"]))


def test_the_ggml_primitives_leave_the_generated_module_alone(tiny_module):
    module, _ = tiny_module("gemma3")
    names = dict(vars(module))
    exact, ggml = primitives(module, "exact"), primitives(module, "ggml")
    assert exact is module.EXACT and exact.gelu is module.gelu and exact.rms_norm is module.rms_norm
    assert ggml.gelu is gelu_table and ggml.rms_norm is not module.rms_norm and ggml.project is not module.project
    assert ggml.swiglu_oai is exact.swiglu_oai and ggml.layer_norm is exact.layer_norm  # what ggml does not change
    assert vars(module) == names and is_as_imported(module)  # not a name of the module rebound
    module.rms_norm = lambda x, w: x  # a user's rebinding: not the source the hash names, never cached
    assert not is_as_imported(module)
    assert "numerics.py" in "".join(graph_cache._GRAPH_SOURCES)


def test_editing_the_generated_file_changes_what_runs(tiny_gguf, tmp_path):
    """The generated file is the program under the default numerics too: an edit of attention() in the file
    (its output scaled) changes the logits of load_llm's default engine, and no function of the loaded module
    is replaced after import."""
    from alchemist import load_llm

    model = load_llm(tiny_gguf("llama"), context=CONTEXT, generated_dir=tmp_path / "g", progress=False)
    assert model.numerics == "ggml" and model.engine.module is model.module
    for name, value in vars(model.module).items():  # every function is the file's own, as written
        if callable(value) and getattr(value, "__module__", None) == model.module.__name__:
            assert value.__code__.co_filename == str(model.module_path), name
    source = model.module_path.read_text()
    line = '    return ops.project(out, w, p + "attn_output.weight"), k_cache, v_cache\n'
    assert source.count(line) == 1
    edited_path = tmp_path / "edited" / model.module_path.name
    edited_path.parent.mkdir()
    edited_path.write_text(source.replace(line, line.replace("ops.project(out,", "ops.project(out * np.float32(2),")))
    edited = import_generated(edited_path)
    weights = model.module.load_weights(model.path, quantized=True)
    runs = [
        Engine(module, weights, "c", CONTEXT, numerics="ggml").run(PROMPT, 0, all_logits=True)
        for module in (model.module, edited)
    ]
    np.testing.assert_array_equal(runs[0], model.engine.run(PROMPT, 0, all_logits=True))
    assert np.abs(runs[1] - runs[0]).max() > 1e-3


# ------------------------------------------------------------------------------------------ against llama.cpp
@pytest.fixture(scope="module")
def q4k_file(fixture_files):
    pytest.importorskip("llama_cpp")
    return str(fixture_files("qwen2", "Q4_K"))


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "float32-weights"])
def test_ggml_numerics_reproduce_llamacpp(q4k_file, kernels):
    """Q4_K: with the weights in GGUF blocks (C's kernels) and as float32 (as JAX and MLX hold them), ggml numerics
    give llama.cpp's logits up to float32 summation order; exact numerics differ by llama.cpp's Q8_K rounding."""
    from alchemist.harness import LlamaCppOracle
    from alchemist.harness.validate import load_for_validation, validate_backend

    results = {}
    with LlamaCppOracle(q4k_file, n_ctx=CONTEXT, n_threads=1) as oracle:
        for numerics in NUMERICS:
            loaded = load_for_validation(q4k_file, numerics=numerics)
            results[numerics] = validate_backend(loaded, "c", oracle, PROMPT, 0, CONTEXT, quantized=kernels)
    assert all(r["quantized_kernels"] == kernels and r["passed"] for r in results.values())
    assert results["ggml"]["numerics"] == "ggml" and results["exact"]["numerics"] == "exact"
    assert results["ggml"]["prompt"]["logits_nmse"] <= 1e-10, results["ggml"]["prompt"]
    assert results["exact"]["prompt"]["logits_nmse"] >= 1e-6, results["exact"]["prompt"]


@pytest.mark.parametrize("backend", ["c", "numba", "jax", "mlx"])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])  # SiLU / GELU, Q4_K and Q6_K weights
def test_ggml_numerics_are_llamacpps_to_the_bit(
    prompt_and_decode_are_llamacpps, fixture_files, c_kernels_on, arch, backend
):
    """On C, Numba and JAX, numerics="ggml" computes every op as llama.cpp's CPU backend does: the 14-token prompt
    (padded to a bucket of 32: ggml's tiled K-quant order, which llama.cpp takes from 8 rows on) gives llama.cpp's
    logits bit for bit, and so do the decode steps after it (T = 1: ggml's vec_dot order). Numba calls the C
    backend's code for the products, RoPE, attention and SiLU (alchemist.kernels.native) and runs ggml's RMS norm
    loops itself; JAX calls all of them as XLA custom calls, MLX from its eager graph (alchemist.kernels.jax_ffi,
    mlx_host), their static-shape graphs attending over the whole cache."""
    from alchemist.harness.validate import load_for_validation

    if backend in ("jax", "mlx"):
        c_kernels_on(backend)

    path = str(fixture_files(arch, "Q4_K"))
    engine = load_for_validation(path, numerics="ggml").engine(backend, CONTEXT, True)
    prompt_and_decode_are_llamacpps(engine, path, PROMPT, CONTEXT)


def test_a_shared_engine_must_compute_with_the_files_numerics(fixture_files):
    pytest.importorskip("llama_cpp")
    from alchemist.harness.validate import load_for_validation, validate_backend

    q8 = load_for_validation(str(fixture_files("qwen2", "Q8_0")), numerics="ggml")
    q4 = load_for_validation(str(fixture_files("qwen2", "Q4_K")), numerics="ggml")
    engine = q8.engine("c", CONTEXT, False)
    with pytest.raises(AlchemistError, match="numerics='ggml' for its own file's weight types"):
        validate_backend(q4, "c", None, PROMPT, 0, CONTEXT, engine=engine, quantized=False)


@pytest.mark.parametrize("backend", ("c", "numba"))
def test_ggml_rms_norm_is_llamacpps_bit_for_bit(fixture_files, backend):
    """gemma3 scales its embeddings just before the first norm: written as graph ops, PyTensor folds the scale into
    the norm's division and about half the normalized values differ from llama.cpp's in the last bit (each one
    may flip a Q8 rounding in the next matmul). The ggml copy's norm is ggml's own loops. The integer kernels (C's,
    which Numba calls) sum as ggml does, so the Q and K projections that follow (then normed per head) are exact
    too."""
    pytest.importorskip("llama_cpp")
    from alchemist.harness import LlamaCppOracle
    from alchemist.harness.validate import load_for_validation, tap_values

    path = str(fixture_files("gemma3", "Q8_0"))
    loaded = load_for_validation(path, numerics="ggml")
    ours = tap_values(loaded.engine(backend, CONTEXT), PROMPT)
    names = ["attn_norm-0", "Qcur_normed-0", "Kcur_normed-0"]
    with LlamaCppOracle(path, n_ctx=CONTEXT, n_threads=1) as oracle:
        theirs = oracle.intermediates(PROMPT, names)
    for name in names:
        assert np.array_equal(ours[name].reshape(theirs[name].shape), theirs[name]), name


# ------------------------------------------------------------------------------------------ the graph cache
@pytest.fixture
def graph_dir(tmp_path, monkeypatch):
    target = tmp_path / "graphs"
    monkeypatch.setattr(graph_cache, "cache_dir", lambda: target)
    monkeypatch.delenv("ALCHEMIST_GRAPH_CACHE", raising=False)
    return target


def _generate(engine) -> np.ndarray:
    engine.reset()
    rows = [engine.run(PROMPT, 0, all_logits=True)]
    rows += [engine.run([t], len(PROMPT) + i) for i, t in enumerate(DECODE)]
    return np.concatenate(rows)


def test_a_ggml_engine_loads_from_the_graph_cache(q4k_file, graph_dir, tmp_path):
    from alchemist.harness.validate import load_for_validation

    exact = load_for_validation(q4k_file, numerics="exact")
    weights = exact.weights_for("c")  # GGUF blocks: the kernels
    first = Engine(exact.module, weights, "c", CONTEXT, numerics="ggml")
    expected = _generate(first)
    assert first.stats.graph_cache_hits == 0 and first.stats.compile_count == 2
    exact_key = Engine(exact.module, weights, "c", CONTEXT)._graph_cache_key(1, False)
    ggml_key = first._graph_cache_key(1, False)
    assert exact_key and ggml_key and exact_key != ggml_key

    second = Engine(exact.module, weights, "c", CONTEXT, numerics="ggml")  # another engine
    np.testing.assert_array_equal(_generate(second), expected)
    assert second.stats.graph_cache_hits == 2

    out = tmp_path / "child.npy"
    script = textwrap.dedent(f"""
        import json
        import numpy as np
        from pathlib import Path
        from alchemist.runtime import graph_cache
        graph_cache.cache_dir = lambda: Path({str(graph_dir)!r})
        from alchemist import load_llm
        model = load_llm({q4k_file!r}, backend="c", context={CONTEXT}, progress=False, compile_now=False)
        engine = model.engine
        rows = [engine.run({PROMPT!r}, 0, all_logits=True)]
        rows += [engine.run([t], {len(PROMPT)} + i) for i, t in enumerate({DECODE!r})]
        np.save({str(out)!r}, np.concatenate(rows))
        print(json.dumps({{"hits": engine.stats.graph_cache_hits, "numerics": model.numerics}}))
        """)
    env = {k: v for k, v in os.environ.items() if k != "ALCHEMIST_GRAPH_CACHE"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"hits": 2, "numerics": "ggml"}  # load_llm's default, linked from this process's entries
    np.testing.assert_array_equal(np.load(out), expected)


def test_load_llm_numerics(tiny_gguf, tmp_path):
    from alchemist import inference, load_llm

    model = load_llm(tiny_gguf("gemma3"), context=CONTEXT, generated_dir=tmp_path, progress=False, compile_now=False)
    assert model.numerics == model.engine.numerics == "ggml" and model.engine.ops.gelu is gelu_table
    assert (
        model.engine.module is model.module
    )  # the module as written; its EXACT is what alchemist.symbolic differentiates
    exact = load_llm(tiny_gguf("gemma3"), context=CONTEXT, generated_dir=tmp_path, progress=False, numerics="exact")
    assert exact.engine.module is exact.module and exact.engine.ops is exact.module.EXACT
    ids = [2, 40, 300, 7, 99]
    a, b = (inference(m, ids, max_tokens=2) for m in (model, exact))
    assert a.report["numerics"] == "ggml" and b.report["numerics"] == "exact"
    # F32 weights: ggml differs from exact only by its fp16 GELU table, a small but real difference
    diff = np.abs(model.engine.run(ids, 0, all_logits=True) - exact.engine.run(ids, 0, all_logits=True)).max()
    assert 0 < diff < 0.05


# ------------------------------------------------------------------------------------------ the greedy bar
def test_greedy_disagreements_are_judged_against_the_noise():
    oracle = np.zeros((3, 5))
    oracle[:, 0] = 1.0  # the oracle always picks token 0
    oracle[1, 3] = 0.99  # step 1: our token 3 is 0.01 behind (its second choice)
    oracle[2, 1], oracle[2, 4] = 0.95, 0.5  # step 2: our token 4 is its third choice, 0.5 behind
    ours = oracle.copy()
    ours[1, 3] += 0.02  # we moved token 3 by 0.02 > its 0.01 margin: a tie
    ours[2, 4] += 0.6  # we moved token 4 by 0.6 past both: its margin 0.5 < max |Δ| 0.6, noise-sized
    agreement = greedy_agreement([0, 3, 4], oracle, our_logits=ours)
    assert agreement.n_agree == 1 and [d["step"] for d in agreement.disagreements] == [1, 2]
    tie, wide = agreement.disagreements
    assert tie["oracle_top2_gap"] == pytest.approx(0.01) and tie["oracle_margin"] == pytest.approx(0.01)
    assert tie["max_abs_delta"] == pytest.approx(0.02) and tie["tie"]
    assert wide["oracle_top2_gap"] == pytest.approx(0.05) and wide["oracle_margin"] == pytest.approx(0.5)
    assert wide["tie"] and not agreement.untied
    ours[2] = oracle[2] + [-0.25, -0.2, 0, 0, 0.3]  # 4 wins by moves of 0.3 at most: margin 0.5 >= max |Δ| 0.3
    assert np.argmax(ours[2]) == 4
    agreement = greedy_agreement([0, 3, 4], oracle, our_logits=ours)
    assert [d["step"] for d in agreement.untied] == [2]
    assert greedy_agreement([0, 3, 4], oracle).disagreements == []  # without our logits: counts only


# ------------------------------------------------------------------------------------------ attribution
@pytest.fixture(scope="module")
def massive_q4k(tmp_path_factory):
    """qwen2 with one channel of the residual stream 1000x the others at position 0, quantized to Q4_K."""
    pytest.importorskip("llama_cpp")
    from alchemist.fixtures import add_massive_activation, write_fixture
    from alchemist.harness import quantize_fixture

    root = tmp_path_factory.mktemp("massive")
    f32 = add_massive_activation(write_fixture(root / "massive-F32.gguf", "qwen2"), PROMPT[0])
    quantize_fixture(f32, root / "massive-Q4_K.gguf", "Q4_K", nthread=1)
    return f32, root / "massive-Q4_K.gguf"


def test_exact_failures_are_attributed(q4k_file, tmp_path, monkeypatch, capsys):
    """A strict KL bar that exact numerics miss and ggml meets: `alchemist validate --numerics exact` says the
    difference is llama.cpp's activation rounding, layer by layer; with a bar nothing meets, it says it is not."""
    from alchemist.cli import main
    from alchemist.harness import validate

    path = q4k_file
    tokens = ",".join(map(str, PROMPT))
    argv = ["validate", path, "--backend", "c", "--tokens", tokens, "--generate", "4", "--numerics", "exact"]
    monkeypatch.setitem(validate.THRESHOLDS, "mean_kl", 1e-13)  # exact: 3e-11 here, ggml 2e-17
    assert main(argv + ["-o", str(tmp_path / "a")]) == 1
    out = capsys.readouterr().out
    assert "c: explained by llama.cpp's activation rounding: with numerics ggml PASS" in out
    assert "validation FAILED (numerics exact)" in out
    report = json.loads((tmp_path / "a" / "qwen2_q4_k_exact.json").read_text())
    assert report["numerics"] == "exact"
    res = report["backends"]["c"]
    attribution = res["attribution"]
    assert attribution["explained"] and attribution["ggml"]["passed"]
    assert [row["tensor"] for row in attribution["layers"]] == ["l_out-0", "l_out-1"]
    assert attribution["first_exact_divergence"] == "l_out-0"
    for row in attribution["layers"]:  # every layer: exact is llama.cpp's rounding away, ggml its summation order
        assert row["exact_nmse"] > 1e-6 and row["ggml_nmse"] < 1e-10, row
    md = (tmp_path / "a" / "qwen2_q4_k_exact.md").read_text()
    assert "**explained by llama.cpp's activation rounding**" in md and "| l_out-0 |" in md

    monkeypatch.setitem(validate.THRESHOLDS, "mean_pearson", 1.1)  # a bar nothing meets: ggml fails too
    assert main(argv + ["-o", str(tmp_path / "b")]) == 1
    assert "c: not explained by llama.cpp's activation rounding" in capsys.readouterr().out
    report = json.loads((tmp_path / "b" / "qwen2_q4_k_exact.json").read_text())
    assert not report["backends"]["c"]["attribution"]["explained"]


def test_with_a_massive_activation_exact_is_closer_to_f32(massive_q4k):
    """The massive-activation experiment (benchmarks/massive_activation.py) in short: against llama.cpp on the F32
    file (no activation rounding there), exact numerics on the Q4_K file are closer than ggml numerics, whose
    8-bit activation blocks lose the small channels beside the massive one."""
    from alchemist.harness import LlamaCppOracle, kl_divergence
    from alchemist.harness.validate import load_for_validation

    f32, q4k = map(str, massive_q4k)
    with LlamaCppOracle(f32, n_ctx=CONTEXT, n_threads=1) as oracle:
        reference = oracle.logits(PROMPT)
    kl = {}
    for numerics in NUMERICS:
        loaded = load_for_validation(q4k, numerics=numerics)
        logits = loaded.engine("c", CONTEXT).run(PROMPT, 0, all_logits=True)
        kl[numerics] = kl_divergence(reference, logits)
    assert kl["exact"].mean() * 2 < kl["ggml"].mean(), kl
    assert kl["exact"][0] * 2 < kl["ggml"][0], kl  # position 0, the massive one
