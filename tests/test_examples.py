"""The examples in examples/ run as a user runs them (a fresh process each, on tiny fixtures so CI stays fast).

A fresh process also keeps the examples' imports out of the test session: importing PyMC appends a flag to
PyTensor's C compiler flags, which would change every later compiled module's key in this process.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args], capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_pymc_calibration_optimizes_with_the_model_in_the_likelihood(fixture_files):
    if importlib.util.find_spec("pymc") is None:  # not importorskip: that would import PyMC here
        pytest.skip("the pymc extra is not installed")
    out = _run("pymc_calibration", str(fixture_files("llama", "F32")), "--method", "map", "--reviews", "2")
    n_read, n_weights = map(int, re.search(r"reads (\d+) of the language model's (\d+) weight", out).groups())
    assert n_read == n_weights > 0  # every weight of the LLM feeds PyMC's log-density
    tau = float(re.search(r"tau = ([0-9.e+-]+)", out).group(1))
    assert math.isfinite(tau) and tau > 0
    assert (
        len(
            [
                line
                for line in out.splitlines()
                if line.endswith(("positive", "negative")) or " positive " in line or " negative " in line
            ]
        )
        == 2
    )
