"""The examples in examples/ run (on tiny fixtures, so CI stays fast)."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pymc_calibration_optimizes(fixture_files, capsys):
    pytest.importorskip("pymc")
    example = _load("pymc_calibration")
    assert example.main([str(fixture_files("llama", "F32")), "--method", "map", "--reviews", "2"]) == 0
    out = capsys.readouterr().out
    tau = float(re.search(r"tau = ([0-9.e+-]+)", out).group(1))
    assert math.isfinite(tau) and tau > 0
    assert len([line for line in out.splitlines() if "positive" in line or "negative" in line]) == 2


def test_pymc_likelihood_contains_the_language_model(fixture_files):
    pytest.importorskip("pymc")
    from pytensor.graph.traversal import ancestors

    from alchemist import load_llm

    example = _load("pymc_calibration")
    model = load_llm(fixture_files("llama", "F32"), backend="c", context=64, progress=False, compile_now=False)
    pm_model, _ = example.build(model, example.REVIEWS[:2])
    inputs = set(ancestors([pm_model.logp()]))
    assert all(w in inputs for w in model.engine.weights.values())  # every weight of the LLM feeds the log-density
