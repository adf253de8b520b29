"""Cold start: the partial-sums rewrite, parallel g++ prebuilds, pipelined precompile and compile progress."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from alchemist.runtime import engine as engine_mod  # configures PyTensor before it is imported below
from alchemist.pytensor_ext.compile_progress import CompileEvent, TqdmProgress

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _elemwise_nodes(fn):
    from pytensor.tensor.elemwise import Elemwise

    return [n for n in fn.maker.fgraph.apply_nodes if isinstance(n.op, Elemwise)]


def test_reuse_partial_sums_keeps_residual_adds_binary_and_bit_identical():
    """A residual stream h_k = h_{k-1} + m_k (each h_k read twice) is flattened by PyTensor's canonicalizer into
    sums of k+1 inputs, one distinct fused op each; with the rewrite every sum takes the previous one."""
    from pytensor.compile.mode import Mode

    from alchemist.runtime.backends import get_mode

    x = pt.matrix("x", shape=(2, 8))
    ws = [pt.matrix(f"w{i}", shape=(8, 8)) for i in range(6)]
    h = x
    for w in ws:  # a layer: its term reads the residual (a matmul, which fusion stops at), then is added to it
        h = h + pt.dot(h * h, w)
    outs = [h, h.sum()]
    new = pytensor.function([x, *ws], outs, mode=get_mode("c"))
    old = pytensor.function([x, *ws], outs, mode=Mode(linker="cvm", optimizer="fast_run"))

    widest_old = max(len(n.inputs) for n in _elemwise_nodes(old))
    widest_new = max(len(n.inputs) for n in _elemwise_nodes(new))
    assert widest_old >= 7  # x + six terms: what the rewrite is for (still PyTensor's behaviour)
    assert widest_new <= 2  # the previous sum and this layer's term
    distinct = lambda fn: len({n.op for n in _elemwise_nodes(fn)})  # noqa: E731
    assert distinct(new) < distinct(old)

    rng = np.random.default_rng(0)
    args = [rng.standard_normal((2, 8)).astype(np.float32)] + [
        (rng.standard_normal((8, 8)) / 8).astype(np.float32) for _ in ws
    ]
    for a, b in zip(new(*args), old(*args)):
        np.testing.assert_array_equal(a, b)  # the same float32 additions, left to right


def test_tqdm_progress_draws_phase_and_counts(capsys):
    bar = TqdmProgress(delay=0, min_interval=0)
    bar(CompileEvent("decode", "rewriting"))
    bar(CompileEvent("decode", "linking", done=0, total=5))
    bar(CompileEvent("decode", "linking", done=3, total=5, compiled=2))
    bar(CompileEvent("decode", "done", done=5, total=5, compiled=2))
    err = capsys.readouterr().err
    assert "decode: rewriting graph" in err
    assert "decode: linking" in err and "3/5 C modules" in err and "2 built with g++" in err
    assert bar.bar is None  # closed at "done"

    quiet = TqdmProgress()  # a compile that ends within its delay (a cached graph's link) draws nothing
    quiet(CompileEvent("decode", "linking", done=0, total=5))
    quiet(CompileEvent("decode", "done", done=5, total=5))
    assert quiet.bar is None and capsys.readouterr().err == ""


def _engine(tiny_module):
    module, path = tiny_module("llama")
    weights = module.load_weights(path, quantized=True)
    return engine_mod.Engine(module, weights, "c", 32)


def test_compile_progress_reports_rewriting_then_every_c_module(tiny_module, tmp_path, monkeypatch):
    monkeypatch.setenv("ALCHEMIST_CACHE", str(tmp_path))  # an empty graph cache: a real compile, then a link
    events: list[CompileEvent] = []
    eng = _engine(tiny_module)
    eng.compile_progress = events.append
    eng.step_function(1)

    phases = [e.phase for e in events]
    assert phases[0] == "rewriting" and phases[-1] == "done"
    linking = [e for e in events if e.phase == "linking"]
    assert linking and phases.index("linking") > phases.index("rewriting")
    total = linking[0].total
    assert total >= 10  # a transformer step has many distinct C nodes
    assert [e.done for e in linking] == sorted(e.done for e in linking)
    assert linking[-1].done == total == events[-1].done
    assert all(e.label == "decode" for e in events)
    assert all(0 <= e.compiled <= e.done for e in linking)

    # a new engine links the same step from the graph cache: no rewriting, the same modules
    events.clear()
    again = _engine(tiny_module)
    again.compile_progress = events.append
    again.step_function(1)
    assert again.stats.graph_cache_hits == 1
    assert "rewriting" not in [e.phase for e in events]
    assert events[-1].phase == "done" and events[-1].done == events[-1].total == total
    assert events[-1].compiled == 0


def test_precompile_pipelined_gives_the_logits_of_separate_compiles(tiny_module, monkeypatch):
    monkeypatch.setenv("ALCHEMIST_GRAPH_CACHE", "0")
    tokens = [3, 1, 4, 1, 5]
    serial = _engine(tiny_module)
    expected = serial.run(tokens, 0, all_logits=True), serial.run([9], len(tokens))

    piped = _engine(tiny_module)
    piped.precompile([(8, True), (1, False), (8, True)])  # duplicates compiled once
    assert piped.stats.compiled_shapes == [(8, True), (1, False)]
    got = piped.run(tokens, 0, all_logits=True), piped.run([9], len(tokens))
    assert piped.stats.compile_count == 2  # run() compiled nothing more
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


_PREBUILD_SCRIPT = r"""
import json, sys
import numpy as np
from alchemist.runtime import engine
from alchemist.pytensor_ext import parallel_build
from alchemist.pytensor_ext.host import activated
import pytensor, pytensor.tensor as pt
from pytensor.link.c.basic import CLinker

gxx = []
x = pt.matrix("x", shape=(3, 4))
outs = [pt.exp(x) * 2.0 + 1.0, x.sum(axis=0), pt.tanh(x).T]
with activated():  # alchemist's compile set-up, parallel_build's wrapper included
    compile_cmodule = CLinker.compile_cmodule
    def counting(self, location=None):
        gxx.append(1)
        return compile_cmodule(self, location)
    CLinker.compile_cmodule = counting
    try:
        maker = engine.rewrite_step([x], outs, None, engine.get_mode("c"))
        fn = engine.link_step(maker, None)
    finally:
        CLinker.compile_cmodule = compile_cmodule
value = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
got = fn(value)
ok = all(np.allclose(a, b, rtol=1e-6) for a, b in zip(got, [np.exp(value) * 2 + 1, value.sum(0), np.tanh(value).T]))
print(json.dumps({"stats": parallel_build.stats, "gxx": len(gxx), "ok": bool(ok)}))
"""


def _run_prebuild(compiledir: Path, jobs: int) -> dict:
    env = dict(os.environ)
    env["PYTENSOR_FLAGS"] = ",".join(filter(None, [env.get("PYTENSOR_FLAGS", ""), f"base_compiledir={compiledir}"]))
    env["ALCHEMIST_COMPILE_JOBS"] = str(jobs)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _PREBUILD_SCRIPT], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_parallel_prebuild_links_modules_pytensor_then_finds_in_its_compiledir(tmp_path):
    """In an empty compiledir, each missing module is built by the parallel prebuild and PyTensor links that
    file and records it in its own index: a second process compiles nothing."""
    cold = _run_prebuild(tmp_path, jobs=2)
    assert cold["ok"]
    assert cold["stats"]["prebuilt"] >= 3  # exp-mul-add, sum, tanh, transpose: distinct C modules
    assert cold["stats"]["used"] == cold["stats"]["prebuilt"]
    assert cold["gxx"] >= cold["stats"]["prebuilt"]  # each one counted where PyTensor would have run g++
    assert not any(Path(tmp_path).glob("alchemist-prebuild/*"))  # every prebuild moved into the compiledir
    warm = _run_prebuild(tmp_path, jobs=2)
    assert warm["ok"] and warm["gxx"] == 0 and warm["stats"]["prebuilt"] == 0


def test_load_llm_pauses_the_garbage_collector_and_restores_it():
    """load_llm runs with the cyclic GC paused (loading makes many long-lived objects and little garbage), and
    leaves it as it found it, also when loading fails."""
    import gc

    import pytest

    from alchemist.runtime import api

    seen = []

    @api._gc_paused
    def load(fail=False):
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("bad file")
        return "model"

    assert gc.isenabled()
    assert load() == "model" and gc.isenabled()
    with pytest.raises(ValueError, match="bad file"):
        load(fail=True)
    assert gc.isenabled()
    gc.disable()
    try:
        load()
        assert not gc.isenabled()  # a caller's choice to keep it off is kept
    finally:
        gc.enable()
    assert seen == [False, False, False]
    assert api.load_llm.__wrapped__.__name__ == "load_llm"  # the public function is the paused one
