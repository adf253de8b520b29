"""Shared session-scoped fixtures: tiny random-weight GGUFs per family, their generated modules, and
the two real reference models (assembled once from the `models` extra)."""

from __future__ import annotations

import numpy as np
import pytest

from alchemist.pytensor_ext.host import configure_pytensor

# The suite is a host that wants alchemist's settings everywhere (float32, the system BLAS), also for the graphs
# the tests build themselves: set PyTensor's flags before anything imports it. alchemist itself changes nothing
# at import (tests/test_host.py checks that in fresh processes).
configure_pytensor()

from alchemist.fixtures import FAMILIES, write_fixture  # noqa: E402


def pytest_report_header(config):
    """Which llama.cpp build the oracle tests run against, and which arithmetic numerics="ggml" reproduces."""
    try:
        from alchemist.harness.oracle_build import describe, oracle_build

        return describe(oracle_build())
    except ImportError:
        return "oracle: llama-cpp-python is not installed"


@pytest.fixture(scope="session")
def llamacpp_bits():
    """For a test asserting llama.cpp's bits: the oracle must be built for the instruction-set variant whose
    arithmetic numerics="ggml" reproduces (scripts/bootstrap.sh pins it, and test_oracle checks that it did).
    Against another build (ALCHEMIST_ORACLE_ANY_BUILD=1 with a native AVX-512 or ARM build) bits are not claimed."""
    pytest.importorskip("llama_cpp")
    from alchemist.harness.oracle_build import describe, oracle_build

    build = oracle_build()
    if not build.reproduced:
        pytest.skip(describe(build))
    return build


@pytest.fixture(scope="session")
def prompt_and_decode_are_llamacpps(llamacpp_bits):
    """check(engine, path, prompt, context, n_decode=3): the engine's logits at every prompt position and at
    n_decode greedy steps after it (llama.cpp's continuation) equal llama.cpp's bit for bit."""
    from alchemist.harness import LlamaCppOracle

    def check(engine, path, prompt, context, n_decode=3):
        with LlamaCppOracle(str(path), n_ctx=context, n_threads=1) as oracle:
            assert np.array_equal(engine.run(prompt, 0, all_logits=True), oracle.logits(prompt)), "prompt"
            continuation = oracle.greedy(prompt, n_decode)
            steps = oracle.decode_steps(prompt, continuation)
        for i, token in enumerate(continuation):
            assert np.array_equal(np.asarray(engine.run([token], len(prompt) + i)).reshape(-1), steps[i]), i

    return check


@pytest.fixture(scope="session")
def composes_as_a_graph():
    """check(path, weight, ids): alchemist.symbolic's log p(ids) of the model at `path` equals its engine's (exact
    numerics), and its gradient reaches tensor `weight`, finite and not all zero."""

    def check(path, weight: str, ids: list[int]) -> None:
        import pytensor

        from alchemist import load_llm
        from alchemist.symbolic import log_prob

        model = load_llm(path, backend="c", context=32, progress=False, numerics="exact")
        lp = log_prob(model, ids)
        logits = model.engine.run(ids, 0, all_logits=True).astype(np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        want = sum(logits[i, ids[i + 1]] - logz[i] for i in range(len(ids) - 1))
        outputs = [lp, pytensor.grad(lp, model.engine.weights[weight])]
        got, grad = pytensor.function([], outputs, mode="FAST_COMPILE")()  # Python thunks: no C to build
        assert abs(float(got) - want) < 1e-3 * abs(want)
        assert np.isfinite(grad).all() and np.abs(grad).sum() > 0

    return check


@pytest.fixture
def perturbed_weight(monkeypatch):
    """perturbed_weight(name, factor): the models alchemist.harness.validate loads (as `alchemist diff` does)
    get weight `name` times `factor`; the GGUF, and so llama.cpp, keep it."""
    import alchemist.harness.validate as validate_mod

    real_loader = validate_mod.load_for_validation

    def perturb(name: str, factor: float) -> None:
        def loader(p, **kwargs):
            loaded = real_loader(p, **kwargs)
            weights = loaded.weights_for("c")  # cached by the loaded model: what diff_model's engine gets
            weights[name] = weights[name] * np.float32(factor)
            return loaded

        monkeypatch.setattr(validate_mod, "load_for_validation", loader)

    return perturb


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_gguf(tiny_dir):
    """tiny_gguf(arch, weight_type="F32") -> path of a cached random-weight fixture."""
    cache = {}

    def make(arch: str, weight_type: str = "F32"):
        key = (arch, weight_type)
        if key not in cache:
            cache[key] = write_fixture(tiny_dir / f"{arch}-{weight_type}.gguf", arch, weight_type=weight_type)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_module(tiny_gguf, tiny_dir):
    """tiny_module(arch) -> (imported generated module, gguf path)."""
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import import_generated

    cache = {}

    def make(arch: str, weight_type: str = "F32"):
        key = (arch, weight_type)
        if key not in cache:
            path = tiny_gguf(arch, weight_type)
            out = tiny_dir / f"gen-{arch}-{weight_type}"
            module_path = write_generated(build_model_ir(read_gguf(path)), out)
            cache[key] = (import_generated(module_path), path)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def reference_models():
    from alchemist.models import reference_model_path

    return {
        "gemma-3-270m": reference_model_path("gemma-3-270m"),
        "qwen2.5-coder-0.5b": reference_model_path("qwen2.5-coder-0.5b"),
    }


@pytest.fixture(scope="session")
def all_families():
    return FAMILIES


@pytest.fixture(scope="session")
def fixture_files(tmp_path_factory):
    """fixture_files(arch, weight_type) -> path; quantized files come from llama.cpp's own quantizer."""
    from alchemist.harness import quantize_fixture

    root = tmp_path_factory.mktemp("validation")
    cache = {}

    def get(arch, wtype):
        if (arch, wtype) not in cache:
            stem = arch.replace(":", "_")
            if wtype in ("F32", "F16"):
                cache[arch, wtype] = write_fixture(root / f"{stem}-{wtype}.gguf", arch, weight_type=wtype)
            else:
                src = get(arch, "F32")
                dst = root / f"{stem}-{wtype}.gguf"
                quantize_fixture(src, dst, wtype, nthread=1)
                cache[arch, wtype] = dst
        return cache[arch, wtype]

    return get


@pytest.fixture(scope="session")
def png_size():
    """png_size(path) -> (width, height), after checking that the file is a PNG that decodes and is not blank."""
    import struct

    def check(path):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
        from matplotlib.image import imread

        pixels = imread(path)
        width, height = struct.unpack(">II", data[16:24])
        assert pixels.shape[:2] == (height, width)
        assert pixels[..., :3].std() > 0.05  # something is drawn, not a blank canvas
        return width, height

    return check


@pytest.fixture
def c_kernels_on(monkeypatch):
    """c_kernels_on(backend, on): JAX's or MLX's calls into alchemist's C kernels for numerics="ggml"
    (alchemist.kernels.jax_ffi, mlx_host) switched on, skipping when they did not build here, or off (the Ops'
    formulas instead); skips when the backend is not installed."""

    def switch(backend: str, on: bool = True) -> None:
        pytest.importorskip(backend)
        from alchemist.kernels import jax_ffi, mlx_host

        module, env = {"jax": (jax_ffi, "ALCHEMIST_JAX_FFI"), "mlx": (mlx_host, "ALCHEMIST_MLX_KERNELS")}[backend]
        monkeypatch.setenv(env, "1" if on else "0")
        if on and not module.available():
            pytest.skip(f"{backend}: the C kernels did not build here")

    return switch
