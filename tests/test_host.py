"""alchemist leaves its host alone: importing it changes no PyTensor flag, class or sys.modules entry, and a PyMC
model compiled after load_llm is the model a process without alchemist compiles. Each check runs in a fresh
process with no PYTENSOR_FLAGS (this test process has set float32 for the suite, see conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from alchemist.pytensor_ext import pytensor_internals
from alchemist.pytensor_ext.host import activated

_STATE = """
def state():
    import os, sys
    import pytensor
    from alchemist.pytensor_ext.host import _patch_points
    return {
        "floatX": pytensor.config.floatX,
        "PYTENSOR_FLAGS": os.environ.get("PYTENSOR_FLAGS"),
        # attributes whose code is alchemist's (a staticmethod's function included)
        "patched": [n for c, n in _patch_points()
                    if "alchemist" in getattr(c.__dict__[n], "__func__", c.__dict__[n]).__code__.co_filename],
        "fake_modules": sorted(n for n, m in sys.modules.items() if n.startswith("pytensor") and m is not None
                               and getattr(m, "__file__", None) is None and not hasattr(m, "__path__")),
    }
"""

_PYMC = """
def pymc_model():
    import numpy as np
    import pymc as pm
    import pytensor
    with pm.Model() as m:
        mu = pm.Normal("mu", 0.0, 1.0)
        sigma = pm.HalfNormal("sigma", 1.0)
        pm.Normal("y", mu, sigma, observed=np.array([0.5, -1.25, 2.0]))
    fn = m.compile_logp()
    value = fn(m.initial_point())
    return {"dtype": str(np.asarray(value).dtype), "value": float(value),
            "graph": pytensor.dprint(fn.f, file="str", print_type=True)}
"""


def _run(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTENSOR_FLAGS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_alchemist_changes_nothing():
    code = _STATE + """
import json, pytensor
before = state()
import alchemist, alchemist.runtime.api, alchemist.runtime.engine, alchemist.runtime.slot_engine, alchemist.symbolic
import alchemist.kernels, alchemist.harness, alchemist.audit, alchemist.serve.app, alchemist.views
print(json.dumps({"before": before, "after": state()}))
"""
    seen = _run(code)
    assert seen["before"] == seen["after"]
    assert seen["after"]["floatX"] == "float64" and seen["after"]["PYTENSOR_FLAGS"] is None
    assert seen["after"]["patched"] == [] and seen["after"]["fake_modules"] == []


def test_load_llm_leaves_a_pymc_model_alone(tiny_gguf):
    """The same PyMC model in a process that never imports alchemist and in one that loads, runs and differentiates
    an alchemist model first: the same dtype, value and compiled graph, and PyTensor as it was."""
    path = tiny_gguf("llama")
    alone = _run(_PYMC + "import json\nprint(json.dumps(pymc_model()))")
    code = _STATE + _PYMC + f"""
import json
import pytensor
from alchemist import inference, load_llm
model = load_llm({str(path)!r}, backend="c", context=32)
ids = inference(model, input=[1, 40, 300], max_tokens=3).output_token_ids
lp = model.log_prob([7], given=[1, 40, 300])
lp_value = float(pytensor.function([], lp)())
print(json.dumps({{"ids": ids, "lp_dtype": lp.dtype, "lp": lp_value, "state": state(), "pymc": pymc_model()}}))
"""
    after = _run(code)
    assert len(after["ids"]) == 3 and after["lp_dtype"] == "float32" and after["lp"] < 0
    assert after["state"]["floatX"] == "float64" and after["state"]["PYTENSOR_FLAGS"] is None
    assert after["state"]["patched"] == [] and after["state"]["fake_modules"] == []
    assert after["pymc"] == alone


def test_a_run_makes_pytensor_probe_for_no_blas(tiny_gguf):
    """Loading and running a model on C, its report included (which names the BLAS alchemist links), never reads
    PyTensor's BLAS flag under the host's own settings, where PyTensor would probe and warn that it found none."""
    code = f"""
import json, warnings
warnings.simplefilter("always")
from alchemist import inference, load_llm
model = load_llm({str(tiny_gguf("llama"))!r}, backend="c", context=32, progress=False)
result = inference(model, input=[1, 40, 300], max_tokens=2)
print(json.dumps({{"blas": result.report["blas"]}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTENSOR_FLAGS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "could not link to a BLAS" not in done.stderr, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["blas"]


def test_activated_sets_and_restores_in_order():
    """Inside: float32 and the speed-ups (re-entrant); outside: exactly the attributes and flags from before."""
    import pytensor

    from alchemist.pytensor_ext.host import _patch_points, active

    points = _patch_points()
    before = [c.__dict__[n] for c, n in points]
    floatx = pytensor.config.floatX
    with pytensor.config.change_flags(floatX="float64"):
        with activated():
            assert active() and pytensor.config.floatX == "float32"
            inner = [c.__dict__[n] for c, n in points]
            with activated():
                assert [c.__dict__[n] for c, n in points] == inner
            assert active()
        assert not active() and pytensor.config.floatX == "float64"
    assert [c.__dict__[n] for c, n in points] == before and pytensor.config.floatX == floatx
    changed = [n for (c, n), b, i in zip(points, before, inner) if b is not i]
    assert changed == ([n for _, n in points] if pytensor_internals.tested() else [])


def test_the_system_blas_is_set_for_the_block_without_pytensors_probe():
    """Inside activated() the C backend links the system OpenBLAS; a process that had not read blas__ldflags has
    still not read it afterwards (PyTensor's BLAS probe, 0.3 s, runs only if the user reads it), and what the user
    then reads is PyTensor's own default."""
    from alchemist.pytensor_ext.host import system_blas_ldflags

    ldflags = system_blas_ldflags()
    assert ldflags, "scripts/bootstrap.sh installs libopenblas-dev"
    code = """
import json, warnings
import pytensor
from alchemist.pytensor_ext.host import activated
param = pytensor.config._config_var_dict["blas__ldflags"]
with activated():
    inside = pytensor.config.blas__ldflags
unread = not hasattr(param, "val")
warnings.simplefilter("ignore")
print(json.dumps({"inside": inside, "unread": unread, "after": pytensor.config.blas__ldflags}))
"""
    seen = _run(code)
    assert seen["inside"] == ldflags and seen["unread"]
    alone = _run("import json, warnings, pytensor\nwarnings.simplefilter('ignore')\n"
                 "print(json.dumps(pytensor.config.blas__ldflags))")
    assert seen["after"] == alone
