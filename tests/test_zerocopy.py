"""Quantized weights held without copies: read-only views of the GGUF memory map on C and Numba (the map lives as
long as they do; nothing writes into them; the KV cache is private and written), and the "quantized" / "float32"
weight formats of load_llm agreeing on JAX and MLX."""

from __future__ import annotations

import gc
import importlib.util
import mmap

import numpy as np
import pytest

from alchemist.errors import AlchemistError
from alchemist.runtime.backends import check_weights, default_weights
from alchemist.runtime.engine import Engine

IDS = [1, 5, 9, 3, 7]


def _mapping(arr: np.ndarray):
    """The mmap.mmap at the end of arr's chain of bases, or None for memory numpy owns."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, mmap.mmap) else None


@pytest.fixture(scope="module")
def q8_module(fixture_files, tiny_dir):
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import import_generated

    path = fixture_files("llama", "Q8_0")
    module_path = write_generated(build_model_ir(read_gguf(path)), tiny_dir / "gen-zerocopy-Q8_0")
    return import_generated(module_path), path


def test_kernel_weights_are_read_only_views_of_the_file(q8_module):
    module, path = q8_module
    weights = module.load_weights(str(path), quantized=True)
    raw = np.fromfile(path, np.uint8)
    assert module.KERNEL_WEIGHTS, "the fixture has no quantized tensors"
    for name in module.KERNEL_WEIGHTS:
        w = weights[name]
        assert w.dtype == np.uint8 and not w.flags.writeable and w.flags.c_contiguous
        mapped = _mapping(w)
        assert mapped is not None and len(mapped) == raw.size, f"{name} is a copy, not a view of the file's map"
        _, _, offset, nbytes = module.TENSORS[name]
        start = module.DATA_OFFSET + offset
        assert np.array_equal(w.reshape(-1), raw[start : start + nbytes])
        with pytest.raises(ValueError):  # read-only: a write would fail loudly, never reach the file
            w[0, 0] = 1
    for name in set(weights) - set(module.KERNEL_WEIGHTS):  # F32 norms etc. stay private float32 arrays
        assert weights[name].dtype == np.float32 and _mapping(weights[name]) is None


@pytest.mark.parametrize("backend", ["c", "numba"])
def test_engine_runs_on_the_mapped_weights_without_copying(q8_module, backend):
    if backend == "numba" and importlib.util.find_spec("numba") is None:
        pytest.skip("numba not installed")
    module, path = q8_module
    weights = module.load_weights(str(path), quantized=True)
    before = {name: weights[name].copy() for name in module.KERNEL_WEIGHTS}
    engine = Engine(module, weights, backend, 16)
    held = {name: engine.weights[name].get_value(borrow=True) for name in module.KERNEL_WEIGHTS}
    for name, value in held.items():  # pytensor.shared(borrow=True) keeps the very array: no copy
        assert np.shares_memory(value, weights[name]) and _mapping(value) is not None
    del weights
    gc.collect()  # only the engine's shared variables hold the map now
    logits = engine.run(IDS, 0, all_logits=True)
    assert np.isfinite(logits).all() and logits.std() > 0
    for name, value in held.items():  # still the same views, unwritten
        now = engine.weights[name].get_value(borrow=True)
        assert np.shares_memory(now, value) and not now.flags.writeable
        np.testing.assert_array_equal(now, before[name])
    k0 = engine.cache[0][0].get_value(borrow=True)  # the KV cache: private, writeable, written
    assert _mapping(k0) is None and k0.flags.writeable and np.abs(k0[: len(IDS)]).sum() > 0
    # private writeable copies of the same bytes (what as_blocks(copy=True) gave) give the same logits
    copies = {
        n: (a.copy() if a.dtype == np.uint8 else a) for n, a in module.load_weights(str(path), quantized=True).items()
    }
    engine.set_weights(copies)
    np.testing.assert_array_equal(engine.run(IDS, 0, all_logits=True), logits)


def test_weight_formats_and_defaults():
    assert default_weights("c") == default_weights("numba") == "quantized"
    assert default_weights("jax") == default_weights("mlx") == "float32"
    from alchemist.kernels import jax_ffi, mlx_host

    for backend, kernels in (("jax", jax_ffi), ("mlx", mlx_host)):  # numerics="ggml" multiplies with the C kernels
        if importlib.util.find_spec(backend) is not None and kernels.available():
            assert default_weights(backend, "ggml") == check_weights(None, backend, "ggml") == "quantized"
    assert check_weights(None, "mlx") == "float32" and check_weights("quantized", "mlx") == "quantized"
    with pytest.raises(AlchemistError, match="unknown weights 'int4'"):
        check_weights("int4", "c")


@pytest.mark.parametrize("backend", ["jax", "mlx"])
def test_quantized_and_float32_weights_agree(q8_module, tiny_dir, backend):
    """JAX/MLX with GGUF blocks dequantized inside the graph equal the float32 weights dequantized at load."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} not installed")
    from alchemist import load_llm

    module, path = q8_module
    out = tiny_dir / "gen-zerocopy-Q8_0"
    logits = {}
    for fmt in ("quantized", "float32"):
        model = load_llm(path, backend=backend, context=16, generated_dir=out, progress=False, weights=fmt)
        assert model.weights == fmt
        dtypes = {str(sv.type.dtype) for name, sv in model.engine.weights.items() if name in module.KERNEL_WEIGHTS}
        assert dtypes == ({"uint8"} if fmt == "quantized" else {"float32"})
        logits[fmt] = model.engine.run(IDS, 0, all_logits=True)
    assert logits["quantized"].shape == (len(IDS), module.N_VOCAB)
    np.testing.assert_allclose(logits["quantized"], logits["float32"], rtol=1e-4, atol=1e-4)
    assert np.abs(logits["float32"]).max() > 0.1  # not a vacuous comparison


_LOAD_AND_MEASURE = """
import json, mmap, sys
import numpy as np
def _mapping(arr):
    while isinstance(arr, np.ndarray):
        arr = arr.base
    return arr if isinstance(arr, mmap.mmap) else None
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) / 1024
import alchemist.runtime.engine
from alchemist import load_llm
before = anon()
model = load_llm(sys.argv[1], backend="c", context=64, progress=False, compile_now=False)
held = {n: sv.get_value(borrow=True) for n, sv in model.engine.weights.items()}
kernel = set(model.module.KERNEL_WEIGHTS)
print(json.dumps({"grown_mb": anon() - before, "kernel_mb": sum(held[n].nbytes for n in kernel) / 2**20,
                  "unmapped": sorted(n for n in kernel if _mapping(held[n]) is None)}))
"""


@pytest.mark.slow
def test_gemma_weights_add_no_private_memory(reference_models):
    """gemma-3-270m on C: its 235 MB of quantized tensors stay in the page cache; the process's private (anonymous)
    memory grows by far less than their size while loading (a fresh process, so nothing else is counted)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_MEASURE, str(reference_models["gemma-3-270m"])],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["unmapped"] == [] and got["kernel_mb"] > 200
    assert got["grown_mb"] < 0.25 * got["kernel_mb"], got
