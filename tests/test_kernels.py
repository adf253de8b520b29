"""alchemist.kernels: quantized matmuls == gguf-py dequantize-then-matmul, on every backend."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from alchemist.pytensor_ext.host import configure_pytensor

configure_pytensor()

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

from alchemist.kernels import (  # noqa: E402
    BLOCK_SIZES,
    SUPPORTED_TYPES,
    QuantizedMatmul,
    as_blocks,
    quantized_embedding,
    dequantize_rows,
    quantized_linear,
    row_bytes,
)
from alchemist.kernels.iq_grids import GRID_TYPES
from alchemist.kernels.formats import reference_dequantize  # noqa: E402
from alchemist.kernels import native  # noqa: E402
from alchemist.runtime.backends import get_mode  # noqa: E402

# byte offsets of the fp16 scale fields (d, and m / dmin where present) in each block
SCALE_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "TQ2_0": (64,),
    "TQ1_0": (52,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ1_S": (0,),
    "Q1_0": (0,),
}
# byte offsets of the E8M0 scale bytes (MXFP4, scale 2^(e - 128)): moderate exponents, or the extremes
E8M0_FIELDS = {"MXFP4": (0,)}
EXTREME_E8M0 = np.array([0, 1, 2, 3, 100, 127, 128, 150], dtype=np.uint8)
REFERENCE_TYPES = ("Q8_0", "Q5_0", "Q4_K", "Q6_K")
BACKENDS = ("c", "numba", "numba-own", "jax", "mlx")  # numba-own: Numba without the C kernels (see `compiled`)
EXTREME_F16 = np.array([65504.0, -65504.0, 6.0e-8, -6.0e-8, 6.1e-5, 0.0, -0.0, 1.0, -2.5, 1024.0], dtype=np.float16)


def random_blocks(rng, ggml_type, n_out, n_in, scales=None):
    """Random quant bytes with finite scales (fp16 normal(0, 0.05) or E8M0 2^-10..2^-1, unless `scales`: the extremes)."""
    qk, bs = BLOCK_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(n_out, n_in // qk, bs), dtype=np.uint8)
    for off in SCALE_FIELDS.get(ggml_type, ()):
        if scales is None:
            values = (rng.standard_normal(blocks.shape[:2]) * 0.05).astype(np.float16)
        else:
            values = rng.choice(scales, size=blocks.shape[:2])
        blocks[:, :, off : off + 2] = values.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    for off in E8M0_FIELDS.get(ggml_type, ()):
        pool = np.arange(118, 128, dtype=np.uint8) if scales is None else EXTREME_E8M0
        blocks[:, :, off] = rng.choice(pool, size=blocks.shape[:2])
    if ggml_type == "IQ1_M":  # its fp16 d lives in the top nibbles of the 4 uint16 scales (bytes 49, 51, 53, 55)
        if scales is None:
            values = (rng.standard_normal(blocks.shape[:2]) * 0.05).astype(np.float16)
        else:
            values = rng.choice(scales, size=blocks.shape[:2]).astype(np.float16)
        bits = values.view(np.uint16).astype(np.uint32)
        for k in range(4):
            nibble = ((bits >> (4 * k)) & 15).astype(np.uint8)
            blocks[:, :, 49 + 2 * k] = (blocks[:, :, 49 + 2 * k] & 15) | (nibble << 4)
    return blocks.reshape(n_out, -1)


def reference(x, raw, ggml_type):
    weights = reference_dequantize(raw, ggml_type).astype(np.float64)
    return x.astype(np.float64) @ weights.T, np.abs(x.astype(np.float64)) @ np.abs(weights).T


def assert_close(y, x, raw, ggml_type):
    """|y - x @ W.T| <= 1e-5 * (|x| @ |W|.T): float32 summation-order differences only."""
    ref, magnitude = reference(x, raw, ggml_type)
    assert y.dtype == np.float32 and y.shape == ref.shape
    tol = 1e-5 * magnitude + 1e-30
    err = np.abs(y.astype(np.float64) - ref)
    assert np.all(err <= tol), f"{ggml_type}: max error {np.max(err / tol):.2f} x tolerance"


@pytest.fixture(scope="session")
def compiled():
    """(backend, ggml_type, n_out, n_in) -> f(x, w), compiled once per session.

    On C one module serves every shape of a type (n_out / n_in are run-time parameters); Numba compiles one
    driver per type; JAX and MLX trace per shape.
    """
    cache = {}

    def get(backend, ggml_type, n_out, n_in):
        key = (backend, ggml_type, n_out, n_in)
        if key not in cache:
            pytest.importorskip(
                {"c": "pytensor", "numba": "numba", "jax": "jax", "mlx": "mlx"}[backend.removesuffix("-own")]
            )
            x = pt.matrix("x", dtype="float32")
            w = pt.matrix("w", dtype="uint8", shape=(n_out, row_bytes(ggml_type, n_in)))
            with pytest.MonkeyPatch.context() as m:
                if backend == "numba-own":  # Numba's own kernels, not the C kernels' shared library
                    m.setenv("ALCHEMIST_NUMBA_NATIVE", "0")
                cache[key] = pytensor.function(
                    [x, w], quantized_linear(x, w, ggml_type, n_out, n_in), mode=get_mode(backend.removesuffix("-own"))
                )
        return cache[key]

    return get


@pytest.fixture(scope="session")
def reference_tensors():
    """ggml type -> (name, 64 rows of a real tensor's bytes, n_in), from the reference GGUFs."""
    from alchemist.gguf_io import read_gguf
    from alchemist.models import reference_model_path

    found = {}
    for model in ("gemma-3-270m", "qwen2.5-coder-0.5b"):
        try:
            path = reference_model_path(model)
        except Exception:  # noqa: BLE001
            continue
        facts = read_gguf(path)
        for name, info in facts.tensors.items():
            if info.ggml_type in REFERENCE_TYPES and info.ggml_type not in found and len(info.shape) == 2:
                n_out, n_in = info.shape
                rows = as_blocks(facts.tensor_bytes(name), info.ggml_type, info.shape, copy=False)
                start = (n_out // 2) // 64 * 64
                found[info.ggml_type] = (f"{model}:{name}", np.array(rows[start : start + 64]), n_in)
    return found


# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES)
def test_numpy_dequantizer_matches_gguf(ggml_type):
    rng = np.random.default_rng(1)
    qk, _ = BLOCK_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(6, row_bytes(ggml_type, 3 * qk)), dtype=np.uint8)  # any bytes, nan too
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(
            dequantize_rows(np, raw, ggml_type, 6, 3 * qk), reference_dequantize(raw, ggml_type)
        )


# Numba with the C kernels' library runs C's code for every type (test_ggml_numerics_match_ggml_vec_dot holds
# each type's Numba products to C's): here one type per activation kind and layout, the others on their own paths
NUMBA_C_TYPES = ("Q8_0", "Q4_1", "Q4_K", "IQ4_XS", "IQ2_XXS", "NVFP4")
RANDOM_BLOCK_CASES = [(t, b) for t in SUPPORTED_TYPES for b in BACKENDS if b != "numba" or t in NUMBA_C_TYPES]


@pytest.mark.parametrize("ggml_type, backend", RANDOM_BLOCK_CASES)
def test_random_blocks(compiled, backend, ggml_type):
    rng = np.random.default_rng(zlib.crc32(f"{backend}{ggml_type}".encode()))
    qk, _ = BLOCK_SIZES[ggml_type]
    n_out, n_in = 19, 3 * qk
    f = compiled(backend, ggml_type, n_out, n_in)
    raw = random_blocks(rng, ggml_type, n_out, n_in)
    for n_tokens in (1, 5):
        x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
        assert_close(np.asarray(f(x, raw)), x, raw, ggml_type)


@pytest.mark.parametrize(
    "ggml_type, backend", [(t, b) for t, b in RANDOM_BLOCK_CASES if b in ("c", "numba", "numba-own")]
)
def test_extreme_scales(compiled, backend, ggml_type):
    """fp16 scales at max, subnormal, zero, negative zero; activations spanning 1e-30..1e4."""
    rng = np.random.default_rng(7)
    qk, _ = BLOCK_SIZES[ggml_type]
    n_out, n_in = 19, 3 * qk  # the shape of test_random_blocks: same compiled function
    f = compiled(backend, ggml_type, n_out, n_in)
    raw = random_blocks(rng, ggml_type, n_out, n_in, scales=EXTREME_F16)
    for n_tokens in (1, 5):
        x = rng.standard_normal((n_tokens, n_in)) * 10.0 ** rng.integers(-30, 4, size=(n_tokens, n_in))
        assert_close(np.asarray(f(x.astype(np.float32), raw)), x.astype(np.float32), raw, ggml_type)


@pytest.mark.parametrize("backend", ("c", "numba", "numba-own"))
def test_non_finite_scales_propagate(compiled, backend):
    rng = np.random.default_rng(3)
    raw = random_blocks(rng, "Q8_0", 19, 96)
    raw[1, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    raw[2, 34:36] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    y = np.asarray(compiled(backend, "Q8_0", 19, 96)(np.ones((1, 96), np.float32), raw))
    assert np.isfinite(y[0, [0, 3]]).all() and not np.isfinite(y[0, 1]) and np.isnan(y[0, 2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ggml_type", REFERENCE_TYPES)
def test_real_tensor_rows(compiled, reference_tensors, backend, ggml_type):
    if ggml_type not in reference_tensors:
        pytest.skip("reference model not assembled")
    name, raw, n_in = reference_tensors[ggml_type]
    f = compiled(backend, ggml_type, raw.shape[0], n_in)
    rng = np.random.default_rng(5)
    for n_tokens in (1, 5):
        x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
        assert_close(np.asarray(f(x, raw)), x, raw, ggml_type)


def test_c_and_numba_agree_on_long_prefill(compiled):
    """T above the C kernel's token chunk (32) and a row count that is not a multiple of its row group (4)."""
    rng = np.random.default_rng(11)
    raw = random_blocks(rng, "Q4_K", 19, 768)  # the shape of test_random_blocks: same compiled function
    x = rng.standard_normal((70, 768)).astype(np.float32)
    for backend in ("c", "numba", "numba-own"):
        assert_close(np.asarray(compiled(backend, "Q4_K", 19, 768)(x, raw)), x, raw, "Q4_K")


def test_perform_and_non_contiguous_inputs():
    rng = np.random.default_rng(2)
    raw = random_blocks(rng, "Q6_K", 6, 512)
    x = pt.matrix("x", dtype="float32")
    w = pt.matrix("w", dtype="uint8")
    y = quantized_linear(x.T, w, "Q6_K", 6, 512)  # x.T: a non-contiguous input
    xv = rng.standard_normal((512, 3)).astype(np.float32)
    for mode in (get_mode("c"), pytensor.compile.mode.Mode(linker="py", optimizer=None)):
        f = pytensor.function([x, w], y, mode=mode)
        assert_close(f(xv, raw), np.ascontiguousarray(xv.T), raw, "Q6_K")


def test_shape_errors():
    x = pt.matrix("x", dtype="float32")
    w = pt.matrix("w", dtype="uint8")
    with pytest.raises(NotImplementedError):
        QuantizedMatmul("Q8_K", 4, 256)  # an activation type: no kernel
    with pytest.raises(ValueError):
        QuantizedMatmul("Q4_K", 4, 100)
    with pytest.raises(TypeError):
        quantized_linear(x.astype("float64"), w, "Q8_0", 4, 64)
    with pytest.raises(ValueError):
        quantized_linear(x, pt.matrix("w", dtype="uint8", shape=(4, 60)), "Q8_0", 4, 64)
    f = pytensor.function([x, w], quantized_linear(x, w, "Q8_0", 4, 64), mode=get_mode("c"))
    with pytest.raises(ValueError):
        f(np.ones((1, 64), np.float32), np.zeros((4, 60), np.uint8))
    with pytest.raises(ValueError):  # n_out differs from the Op's
        f(np.ones((1, 64), np.float32), np.zeros((5, 68), np.uint8))
    with pytest.raises(ValueError):
        as_blocks(np.zeros(100, np.uint8), "Q8_0", (4, 64))


def test_as_blocks_is_a_view():
    raw = np.zeros(4 * 68, np.uint8)
    blocks = as_blocks(raw, "Q8_0", (4, 64))  # the default: zero-copy
    assert blocks.shape == (4, 68) and np.shares_memory(blocks, raw)
    copied = as_blocks(raw, "Q8_0", (4, 64), copy=True)
    assert copied.flags.c_contiguous and copied.flags.writeable and not np.shares_memory(copied, raw)


@pytest.mark.parametrize("ggml_type", ("Q8_0", "Q5_0", "Q4_1", "Q4_K", "Q6_K", "MXFP4"))
def test_c_rows_of_a_small_batch_equal_single_token_products(compiled, ggml_type):
    """Below the BLAS threshold the C kernel applies the same operations per token, whatever T is (tokens go
    through the kernel in register groups of 4, so T = 2..9 covers full groups and every remainder): batched
    decoding must not change tokens."""
    rng = np.random.default_rng(4)
    n_in = 256 if ggml_type.endswith("_K") else 96
    raw = random_blocks(rng, ggml_type, 19, n_in)
    f = compiled("c", ggml_type, 19, n_in)
    x = rng.standard_normal((9, n_in)).astype(np.float32)
    singles = np.concatenate([f(x[t : t + 1], raw) for t in range(9)])
    for n in range(2, 10):
        np.testing.assert_array_equal(f(x[:n], raw), singles[:n], err_msg=f"T={n}")


@pytest.fixture(scope="session")
def compiled_embedding():
    cache = {}

    def get(backend, ggml_type, n_rows, n_in, n_tokens):
        key = (backend, ggml_type, n_rows, n_in, n_tokens)
        if key not in cache:
            w = pt.matrix("w", dtype="uint8", shape=(n_rows, row_bytes(ggml_type, n_in)))
            idx = pt.vector("idx", dtype="int64", shape=(n_tokens,))
            y = quantized_embedding(w, idx, ggml_type, n_rows, n_in)
            cache[key] = pytensor.function([w, idx], y, mode=get_mode(backend))
        return cache[key]

    return get


@pytest.mark.parametrize("backend", ("c", "numba", "jax", "mlx"))
@pytest.mark.parametrize("ggml_type", ("Q8_0", "Q5_0", "Q4_K", "Q6_K", "Q4_1", "MXFP4"))
def test_embedding_is_exact(compiled_embedding, backend, ggml_type):
    """quantized_embedding(w, idx) == gguf-py's dequantize(w)[idx], bit for bit."""
    rng = np.random.default_rng(zlib.crc32(f"emb{backend}{ggml_type}".encode()))
    qk, _ = BLOCK_SIZES[ggml_type]
    raw = random_blocks(rng, ggml_type, 11, 2 * qk)
    idx = np.array([3, 0, 10, 3, -1], dtype=np.int64)
    f = compiled_embedding(backend, ggml_type, 11, 2 * qk, len(idx))
    np.testing.assert_array_equal(np.asarray(f(raw, idx)), reference_dequantize(raw, ggml_type)[idx])


@pytest.mark.parametrize("backend", ("c", "numba"))
def test_embedding_index_out_of_range(compiled_embedding, backend):
    raw = random_blocks(np.random.default_rng(0), "Q8_0", 11, 64)  # test_embedding_is_exact's function
    with pytest.raises(IndexError):
        compiled_embedding(backend, "Q8_0", 11, 64, 5)(raw, np.array([1, 4, 11, 0, 0], dtype=np.int64))


def test_gradient_with_respect_to_x():
    rng = np.random.default_rng(6)
    raw = random_blocks(rng, "Q4_K", 3, 256)
    x = pt.matrix("x", dtype="float32")
    w = pt.matrix("w", dtype="uint8", shape=raw.shape)
    g = pytensor.grad(quantized_linear(x, w, "Q4_K", 3, 256).sum(), x)
    f = pytensor.function([x, w], g, mode=get_mode("c"))
    expected = np.broadcast_to(reference_dequantize(raw, "Q4_K").sum(axis=0), (2, 256))
    np.testing.assert_allclose(f(np.ones((2, 256), np.float32), raw), expected, rtol=1e-5, atol=1e-6)


_CACHED_RUN = """
import numpy as np
from alchemist.runtime.backends import get_mode
from alchemist.pytensor_ext.host import configure_pytensor
configure_pytensor()
import pytensor, pytensor.tensor as pt
from alchemist.kernels import quantized_linear
x = pt.matrix("x", dtype="float32")
w = pt.matrix("w", dtype="uint8", shape=(300, 68))
f = pytensor.function([x, w], quantized_linear(x, w, "Q8_0", 300, 64), mode=get_mode("numba"))
raw = np.ones((300, 2, 34), np.uint8)
raw[:, :, 0], raw[:, :, 1] = 0, 0x3C  # d = 1.0 in both blocks, quants 1
raw = raw.reshape(300, 68)
print(float(f(np.ones((1, 64), np.float32), raw).sum()))
"""


def test_numba_graph_loaded_from_pytensor_cache_runs(tmp_path):
    """The second process loads the compiled graph from PyTensor's cache: the prange driver must still work
    (regression: Numba's threading layer was not started and the process segfaulted)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTENSOR_FLAGS=f"base_compiledir={tmp_path}")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _CACHED_RUN], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert float(out.stdout.split()[-1]) == 300 * 64


# ---------------------------------------------------------------------------------------------------
# numerics="ggml": llama.cpp's activation quantization and integer dot products, against ggml-cpu itself


@pytest.fixture(scope="session")
def ggml_ref(llamacpp_bits):
    from alchemist.harness._llama import ggml_cpu

    return ggml_cpu()


@pytest.fixture(scope="session")
def compiled_ggml():
    cache = {}

    def get(backend, ggml_type, n_out, n_in):
        """backend "numba-own": Numba with its own kernels (not the C kernels' shared library); "jax-formula",
        "mlx-formula": JAX / MLX without the C kernels (alchemist.kernels.jax_ffi, mlx_host), the Op expanded."""
        key = (backend, ggml_type, n_out, n_in)
        if key not in cache:
            x = pt.matrix("x", dtype="float32")
            w = pt.matrix("w", dtype="uint8", shape=(n_out, row_bytes(ggml_type, n_in)))
            y = quantized_linear(x, w, ggml_type, n_out, n_in, numerics="ggml")
            with pytest.MonkeyPatch.context() as m:
                if backend == "numba-own":
                    m.setenv("ALCHEMIST_NUMBA_NATIVE", "0")
                if backend == "jax-formula":
                    m.setenv("ALCHEMIST_JAX_FFI", "0")
                if backend == "mlx-formula":
                    m.setenv("ALCHEMIST_MLX_KERNELS", "0")
                mode = backend.removesuffix("-own").removesuffix("-formula")
                cache[key] = pytensor.function([x, w], y, mode=get_mode(mode))
        return cache[key]

    return get


def activations_with_outliers(rng, T, n):
    """Heavy-tailed rows with one massive activation (the case where the activation blocks round hardest)."""
    x = (rng.standard_normal((T, n)) * np.exp(rng.standard_normal((T, n)))).astype(np.float32)
    x[0, 7] = 300.0
    return x


def ggml_dequantized_activations(ggml_ref, ggml_type, x):
    """dequant(quant(x)) through ggml's own quantize_row_q8_* and dequantize_row_q8_0 / q8_K (Q8_1: its Q8_0 values)."""
    import ctypes

    from alchemist.harness._llama import ggml

    kind = ggml_ref.activation_type(ggml_type)
    out = np.empty_like(x)
    for t, row in enumerate(x):
        blocks = ggml_ref.quantize_row("Q8_0" if kind == "q8_1" else ggml_type, row)
        fn = ggml()._bind(
            f"dequantize_row_{'q8_K' if kind == 'q8_K' else 'q8_0'}", [ctypes.c_void_p] * 2 + [ctypes.c_int64], None
        )
        fn(blocks.ctypes.data, out[t].ctypes.data, row.size)
    return out


def q8_0_identity(n):
    """Q8_0 rows of the n x n identity: d = 1.0 (fp16) and a single quant 1 per row."""
    blocks = np.zeros((n, n // 32, 34), np.uint8)
    for o in range(n):
        blocks[o, o // 32, 0:2] = np.array([1.0], np.float16).view(np.uint8)
        blocks[o, o // 32, 2 + o % 32] = 1
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("backend", ("c", "numba", "numba-own"))
@pytest.mark.parametrize("ggml_type", ("Q8_0", "Q6_K"))
def test_ggml_activation_quantization_is_bit_exact(ggml_ref, compiled_ggml, backend, ggml_type):
    """With identity weights the product is dequant(quant(x)) itself: it must equal ggml's, bit for bit, for
    both activation formats (Q8_0 blocks of 32 with an fp16 scale; Q8_K blocks of 256, float scale). Except
    with the C kernels (on C, and on Numba through their shared library) with Q6_K, whose product is
    ggml_vec_dot_q6_K_q8_K's: that adds the quants' +32 offset and takes it off again in lanes that only cancel
    in the final float sum, so it is ggml's own product of the identity."""
    from alchemist.harness.quantize import quantize_array

    n = 512
    eye = (
        q8_0_identity(n) if ggml_type == "Q8_0" else quantize_array(np.eye(n, dtype=np.float32), "Q6_K").reshape(n, -1)
    )
    assert np.array_equal(reference_dequantize(eye, ggml_type), np.eye(n, dtype=np.float32))
    x = activations_with_outliers(np.random.default_rng(3), 6, n)
    x[1] = 0.0  # an all-zero row: scale 0
    x[2, :32] = np.float32(1e-3) * np.arange(32)  # ties and tiny values
    want = ggml_dequantized_activations(ggml_ref, ggml_type, x)
    if (backend == "c" or backend == "numba" and native.matmul_kernel()) and ggml_type == "Q6_K":
        want = np.array(
            [
                [ggml_ref.vec_dot(ggml_type, eye[o], ggml_ref.quantize_row(ggml_type, row), n) for o in range(n)]
                for row in x
            ],
            np.float32,
        )
    for T in (1, 6):  # the decode path and the batched path
        got = np.asarray(compiled_ggml(backend, ggml_type, n, n)(x[:T], eye))
        assert np.array_equal(got, want[:T]), f"{np.abs(got - want[:T]).max()}"


@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES)
def test_ggml_numerics_match_ggml_vec_dot(ggml_ref, compiled_ggml, ggml_type):
    """Every row of x @ W.T against ggml_vec_dot_<type>_q8_* on ggml's own activation blocks. On C the 32-blocks
    and Q4_K / Q5_K / Q6_K / IQ4_XS compute the very same float operations (bit-identical); IQ4_NL too for one
    row, where llama.cpp takes vec_dot (from two rows on it takes tinyBLAS, whose order the kernel follows);
    Q2_K, Q3_K and MXFP4 sum in another order (float32 eps).
    Numba runs the same C kernels (alchemist.kernels.native): the same results. Numba's own kernels multiply the
    rounded activations with the dequantized weights (Q4_1/Q5_1 differ in their offset term, which ggml takes
    from the fp16 block sum of Q8_1)."""
    from alchemist.harness.quantize import quantize_array

    rng = np.random.default_rng(4)
    n_out, n_in = 48, 512
    raw = quantize_array(rng.standard_normal((n_out, n_in)).astype(np.float32), ggml_type).reshape(n_out, -1)
    x = activations_with_outliers(rng, 5, n_in)
    want = np.array(
        [
            [ggml_ref.vec_dot(ggml_type, raw[o], ggml_ref.quantize_row(ggml_type, x[t]), n_in) for o in range(n_out)]
            for t in range(5)
        ],
        dtype=np.float32,
    )
    scale = np.abs(want).max()
    got_c = np.asarray(compiled_ggml("c", ggml_type, n_out, n_in)(x, raw))
    if ggml_type in (
        "Q8_0",
        "Q4_0",
        "Q5_0",
        "Q4_1",
        "Q5_1",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ4_XS",
        "TQ2_0",
        "TQ1_0",
        "NVFP4",
        "Q1_0",
        *GRID_TYPES,
    ):  # the same float operations in the same order
        assert np.array_equal(got_c, want)
    if ggml_type in (
        "Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL", "TQ2_0", "TQ1_0", "NVFP4",
        "Q1_0", *GRID_TYPES,
    ):  # fmt: skip
        assert np.array_equal(np.asarray(compiled_ggml("c", ggml_type, n_out, n_in)(x[:1], raw)), want[:1])  # decode
    assert np.abs(got_c - want).max() <= 2e-6 * scale
    if native.matmul_kernel():
        assert np.array_equal(np.asarray(compiled_ggml("numba", ggml_type, n_out, n_in)(x, raw)), got_c)
    got_numba = np.asarray(compiled_ggml("numba-own", ggml_type, n_out, n_in)(x, raw))
    tol = 2e-3 if ggml_type in ("Q4_1", "Q5_1") else 2e-6
    assert np.abs(got_numba - want).max() <= tol * scale


class _OffsetLoop(QuantizedMatmul):
    """QuantizedMatmul with the one-token Q4_0 / Q5_0 loop forced to 256-bit vectors (halves=0) or to 128-bit
    halves four rows at a time (halves=1), whichever this CPU would not pick itself."""

    __props__ = (*QuantizedMatmul.__props__, "halves")

    def __init__(self, ggml_type, n_out, n_in, halves):
        super().__init__(ggml_type, n_out, n_in, numerics="ggml")
        self.halves = halves

    def c_compile_args(self, **kwargs):
        return [*super().c_compile_args(**kwargs), f"-DALCHEMIST_OFFSET_HALVES={self.halves}"]


@pytest.mark.parametrize("ggml_type", ("Q5_0", "Q4_0"))
@pytest.mark.parametrize("halves", (0, 1))
def test_one_token_offset_loops_are_ggml_vec_dot(ggml_ref, ggml_type, halves):
    """Both versions of the one-token Q4_0 / Q5_0 loop give ggml_vec_dot's bits, also for the rows left over
    when the output count is not a multiple of four."""
    from alchemist.harness.quantize import quantize_array

    rng = np.random.default_rng(5)
    n_out, n_in = 47, 256
    raw = quantize_array(rng.standard_normal((n_out, n_in)).astype(np.float32), ggml_type).reshape(n_out, -1)
    x = activations_with_outliers(rng, 1, n_in)
    want = np.array(
        [[ggml_ref.vec_dot(ggml_type, raw[o], ggml_ref.quantize_row(ggml_type, x[0]), n_in) for o in range(n_out)]],
        np.float32,
    )
    xv, wv = pt.matrix("x", dtype="float32"), pt.matrix("w", dtype="uint8", shape=raw.shape)
    got = pytensor.function([xv, wv], _OffsetLoop(ggml_type, n_out, n_in, halves)(xv, wv), mode=get_mode("c"))(x, raw)
    assert np.array_equal(np.asarray(got), want)


class _WithoutVnni(QuantizedMatmul):
    """QuantizedMatmul built with -DALCHEMIST_VNNI=0: the batched 32-block products without vpdpbusd."""

    def c_compile_args(self, **kwargs):
        return [*super().c_compile_args(**kwargs), "-DALCHEMIST_VNNI=0"]


@pytest.mark.parametrize("ggml_type", ("Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "MXFP4"))
def test_batched_products_with_vnni_are_the_sign_trick_bits(ggml_ref, ggml_type):
    """Two or more activation rows of a 32-block type, built with VNNI where the CPU has AVX-512 VNNI or AVX-VNNI
    (elsewhere both builds are the same) and without: vpdpbusd with offset codes gives the bits of the sign-trick
    loops (the token-chunked one below 16 rows, the panels from 16), for token groups of 8, their remainders and
    rows unpacked once for several groups, and of ggml_vec_dot row by row (Q8_0 with extreme codes: -127, 127 and
    ggml's -128 in the weights)."""
    from alchemist.harness.quantize import quantize_array

    rng = np.random.default_rng(11)
    n_out, n_in = 37, 320
    raw = quantize_array(rng.standard_normal((n_out, n_in)).astype(np.float32), ggml_type).reshape(n_out, -1)
    if ggml_type == "Q8_0":  # codes at the ends of int8 in the first row's blocks
        codes = raw[0].reshape(-1, 34)[:, 2:].view(np.int8)
        codes[:, ::3], codes[:, 1::3] = -128, 127
    xv, wv = pt.matrix("x", dtype="float32"), pt.matrix("w", dtype="uint8", shape=raw.shape)
    with_vnni = pytensor.function(
        [xv, wv], QuantizedMatmul(ggml_type, n_out, n_in, numerics="ggml")(xv, wv), mode=get_mode("c")
    )
    without = pytensor.function(
        [xv, wv], _WithoutVnni(ggml_type, n_out, n_in, numerics="ggml")(xv, wv), mode=get_mode("c")
    )
    for T in (2, 8, 9, 15, 40):
        x = activations_with_outliers(rng, T, n_in)
        got = np.asarray(with_vnni(x, raw))
        assert np.array_equal(got, np.asarray(without(x, raw))), f"T={T}"
        if ggml_type in ("Q8_0", "Q4_0", "Q5_0"):  # MXFP4, IQ4_NL from 2 rows: another order than vec_dot (above)
            want = [
                ggml_ref.vec_dot(ggml_type, raw[o], ggml_ref.quantize_row(ggml_type, x[T - 1]), n_in)
                for o in range(n_out)
            ]
            assert np.array_equal(got[T - 1], np.array(want, np.float32)), f"T={T}"


@pytest.mark.parametrize("ggml_type", ("Q5_0", "Q4_K", "Q6_K", "Q4_1", "IQ4_XS"))
def test_ggml_numerics_equal_dequantize_then_matmul_of_rounded_activations(compiled_ggml, compiled, ggml_type):
    """ggml numerics == the exact kernel applied to dequant(quant(x)) (float32 summation order aside), for a
    decode row, a batch and a prefill-sized product. As in llama.cpp, a row's product depends only on whether the
    batch is below the K-quants' tiled threshold: the 32-blocks give every row its one-token product at any T;
    the K-quants and IQ4_XS take ggml's vec_dot order below 8 rows and its tiled order from 8 rows on."""
    from alchemist.kernels.activations import round_rows

    rng = np.random.default_rng(5)
    n_out, n_in = 64, 512
    raw = random_blocks(rng, ggml_type, n_out, n_in)
    for T in (1, 7, 40):
        x = activations_with_outliers(rng, T, n_in)
        got = np.asarray(compiled_ggml("c", ggml_type, n_out, n_in)(x, raw))
        rounded = round_rows(x, ggml_type)
        if ggml_type in ("Q4_1", "Q5_1"):  # ggml's offset term uses Q8_1's fp16 block sum
            ref, magnitude = reference(rounded, raw, ggml_type)
            assert np.abs(got - ref).max() <= 2e-3 * np.abs(magnitude).max()
        else:
            assert_close(got, rounded, raw, ggml_type)
        f = compiled_ggml("c", ggml_type, n_out, n_in)
        if BLOCK_SIZES[ggml_type][0] == 256 and T >= 8:  # any batch of 8 or more: the same tiled arithmetic per row
            assert np.array_equal(np.concatenate([np.asarray(f(x[i : i + 8], raw)) for i in range(0, 32, 8)]), got[:32])
        elif T > 1:
            assert np.array_equal(np.stack([np.asarray(f(x[t : t + 1], raw))[0] for t in range(T)]), got)


@pytest.mark.parametrize("backend", ("jax", "mlx"))
@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES)
def test_ggml_numerics_on_jax_and_mlx_are_the_c_kernels(compiled_ggml, c_kernels_on, ggml_type, backend):
    """JAX (an XLA custom call) and MLX (a call from its eager graph) multiply with the C kernels
    (alchemist.kernels.jax_ffi, mlx_host): the C backend's products bit for bit, one row and a batch (the
    K-quants' tiled path), the Op kept in the graph."""
    c_kernels_on(backend)
    n_out, n_in = 32, 256
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, ggml_type, n_out, n_in)
    x = activations_with_outliers(rng, 9, n_in)
    fn, c_fn = compiled_ggml(backend, ggml_type, n_out, n_in), compiled_ggml("c", ggml_type, n_out, n_in)
    assert any(isinstance(n.op, QuantizedMatmul) for n in fn.maker.fgraph.apply_nodes)
    for rows in (x[:1], x):
        got, want = np.asarray(fn(rows, raw)), np.asarray(c_fn(rows, raw))
        assert np.array_equal(got, want), f"{np.sum(got != want)} of {want.size} differ"


@pytest.mark.parametrize("backend", ("jax", "mlx"))
def test_ggml_numerics_without_the_c_kernels_round_in_the_graph(compiled_ggml, backend):
    """Without the C kernels (ALCHEMIST_JAX_FFI=0, ALCHEMIST_MLX_KERNELS=0, or no compiler) JAX and MLX expand
    the ggml Op into the in-graph rounding followed by dequantize-then-matmul."""
    pytest.importorskip(backend)
    from alchemist.kernels.activations import round_rows

    rng = np.random.default_rng(6)
    raw = random_blocks(rng, "Q4_K", 32, 256)
    x = activations_with_outliers(rng, 3, 256)
    fn = compiled_ggml(f"{backend}-formula", "Q4_K", 32, 256)
    assert not any(isinstance(n.op, QuantizedMatmul) for n in fn.maker.fgraph.apply_nodes)
    assert_close(np.asarray(fn(x, raw)), round_rows(x, "Q4_K"), raw, "Q4_K")


def test_ggml_numerics_rejects_unknown_mode():
    with pytest.raises(ValueError, match="numerics must be one of exact, ggml"):
        quantized_linear(
            pt.matrix("x", dtype="float32"), pt.matrix("w", dtype="uint8"), "Q8_0", 32, 32, numerics="fast"
        )


@pytest.mark.parametrize("backend", ("c", "numba"))
def test_gelu_table_equals_ggml_table(ggml_ref, backend):
    """Every fp16 input in (-10, 10) reads llama.cpp's own ggml_table_gelu_f16; outside, 0 or x."""
    from alchemist.kernels.gelu import gelu_table

    table = ggml_ref.gelu_table()
    x16 = np.arange(65536, dtype=np.uint16).view(np.float16)
    inside = np.isfinite(x16) & (x16 > -10) & (x16 < 10)
    x = np.concatenate([x16[inside].astype(np.float32), np.float32([-10, -11.5, 10, 12.25, 3.00001, -0.3333])])
    want = np.where(x <= -10, 0, np.where(x >= 10, x, table[x.astype(np.float16).view(np.uint16)])).astype(np.float32)
    v = pt.vector("x", dtype="float32")
    got = np.asarray(pytensor.function([v], gelu_table(v), mode=get_mode(backend))(x))
    assert np.array_equal(got, want)


def ggml_rms_norm_reference(x: np.ndarray, eps: float, weight=None) -> np.ndarray:
    """ggml_compute_forward_rms_norm_f32 in Python: float32 squares summed in order in double (Python float), then
    ggml_mul by the weight."""
    eps = np.float32(eps)
    out = np.empty_like(x)
    for r, row in enumerate(x.reshape(-1, x.shape[-1])):
        total = 0.0
        for v in row:
            total += float(np.float32(v * v))
        scale = np.float32(1) / np.sqrt(np.float32(np.float32(total / row.size) + eps))
        out.reshape(-1, x.shape[-1])[r] = row * scale if weight is None else (row * scale) * weight
    return out


@pytest.mark.parametrize("weighted", (False, True), ids=("plain", "weighted"))
@pytest.mark.parametrize("backend", ("c", "numba", "py"))
def test_rms_norm_ggml_is_ggmls_bit_for_bit(backend, weighted):
    """The ggml numerics' RMS norm equals ggml's loops exactly, also when a scale on x sits just before it (the
    case PyTensor's canonicalizer folds into one division when the norm is written as graph ops)."""
    from alchemist.kernels.rms_norm import rms_norm_formula, rms_norm_ggml

    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 5, 640)) * rng.uniform(0.01, 30, (3, 5, 1))).astype(np.float32)
    x[0, 0, :32] *= 1000  # a massive activation
    weight = rng.uniform(-2, 3, 640).astype(np.float32) if weighted else None
    v = pt.tensor3("x", dtype="float32")
    mode = "FAST_COMPILE" if backend == "py" else get_mode(backend)
    scaled = v * np.float32(25.298222)
    got = pytensor.function([v], rms_norm_ggml(scaled, 1e-6, weight), mode=mode)(x)
    want = ggml_rms_norm_reference(x * np.float32(25.298222), 1e-6, weight)
    assert np.array_equal(np.asarray(got), want)
    # the same norm as graph ops (JAX and MLX compute it this way) agrees to float32 rounding only
    formula = np.asarray(pytensor.function([v], rms_norm_formula(scaled, 1e-6, weight), mode=get_mode("c"))(x))
    np.testing.assert_allclose(formula, want, rtol=6e-7, atol=0)


_RMS_NORM = """
import numpy as np, pytensor, pytensor.tensor as pt
from alchemist.kernels.rms_norm import rms_norm_ggml
from alchemist.runtime.backends import get_mode
rng = np.random.default_rng(0)
x, w = (rng.standard_normal((14, 64)) * 3).astype(np.float32), rng.standard_normal(64).astype(np.float32)
v, wv = pt.matrix("x", dtype="float32"), pt.vector("w", dtype="float32")
c, numba = (pytensor.function([v, wv], rms_norm_ggml(v, 1e-6, wv), mode=get_mode(b))(x, w) for b in ("c", "numba"))
print(int((np.asarray(numba) != np.asarray(c)).sum()))
"""


def test_rms_norm_ggml_on_numba_is_not_fast_math(tmp_path):
    """The Numba graph of the weighted norm, compiled in one process and loaded from PyTensor's cache in the next:
    under PyTensor's default fastmath the cached wrapper, which inlines the loops, computed 1 / sqrtf with a
    reciprocal-square-root estimate on an AVX-512 CPU (331 of 896 values an ulp off in the second process). The
    wrapper is compiled without fastmath: C's bits in both processes, on every CPU."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTENSOR_FLAGS=f"base_compiledir={tmp_path}")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _RMS_NORM], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == "0"


def test_rms_norm_ggml_checks_its_weight():
    from alchemist.kernels.rms_norm import RmsNormGgml, rms_norm_ggml

    v = pt.matrix("x", dtype="float32")
    with pytest.raises(TypeError, match="must be a float32 vector"):
        rms_norm_ggml(v, 1e-6, pt.matrix("w", dtype="float32"))
    with pytest.raises(TypeError, match="called without a weight"):
        RmsNormGgml(1e-6, weighted=True)(v)
    fn = pytensor.function([v, w := pt.vector("w", dtype="float32")], rms_norm_ggml(v, 1e-6, w), mode=get_mode("c"))
    with pytest.raises(ValueError, match="weight of 3 for rows of 4"):
        fn(np.ones((2, 4), np.float32), np.ones(3, np.float32))


@pytest.mark.parametrize("backend", ("jax", "mlx"))
@pytest.mark.parametrize("kernels", (True, False), ids=("kernels", "formula"))
def test_rms_norm_ggml_on_jax_and_mlx(c_kernels_on, backend, kernels):
    """JAX and MLX: ggml's loops through the C kernels (bit for bit); without them the float32 formula."""
    from alchemist.kernels.rms_norm import rms_norm_ggml

    c_kernels_on(backend, kernels)
    x = np.random.default_rng(12).standard_normal((4, 64)).astype(np.float32)
    weight = np.linspace(-1, 2, 64, dtype=np.float32)
    v = pt.matrix("x", dtype="float32")
    for w in (weight, None):
        got = np.asarray(pytensor.function([v], rms_norm_ggml(v, 1e-5, w), mode=get_mode(backend))(x))
        want = ggml_rms_norm_reference(x, 1e-5, w)
        if kernels:
            assert np.array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=6e-7, atol=0)


@pytest.mark.parametrize("backend", ("jax", "mlx"))
def test_silu_and_gelu_ggml_on_jax_and_mlx_are_the_c_loops(c_kernels_on, backend):
    """JAX and MLX call the C loops of ggml's SiLU and table GELU: the C backend's bits."""
    from alchemist.kernels.gelu import gelu_table
    from alchemist.kernels.silu import silu_ggml

    c_kernels_on(backend)
    x = (np.random.default_rng(13).standard_normal((3, 29)) * 6).astype(np.float32)  # 29: the scalar tail
    v = pt.matrix("x", dtype="float32")
    for fn in (silu_ggml, gelu_table):
        got = np.asarray(pytensor.function([v], fn(v), mode=get_mode(backend))(x))
        assert np.array_equal(got, pytensor.function([v], fn(v), mode=get_mode("c"))(x)), fn.__name__


@pytest.mark.parametrize("n", (64, 4864, 29))  # 29: ggml's scalar tail (expf) after three vectors of 8
def test_silu_ggml_is_ggml_vec_silu(ggml_ref, n):
    """numerics="ggml"'s SiLU (C loops, and the numpy transcription `perform` runs) equals libggml-cpu's
    ggml_vec_silu_f32 to the bit, row by row; times the up projection it is ggml_vec_swiglu_f32."""
    from alchemist.kernels.silu import SiluGgml, silu_reference

    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, n)) * np.exp(2 * rng.standard_normal((3, n)))).astype(np.float32)
    x[0, :6] = [0.0, -0.0, 88.0, -88.0, -103.0, 1e-30]  # v_expf's overflow / underflow branches
    g = rng.standard_normal((3, n)).astype(np.float32)
    want = np.stack([ggml_ref.vec_swiglu(row) for row in x])
    xv = pt.matrix("x", dtype="float32")
    got = np.asarray(pytensor.function([xv], SiluGgml()(xv), mode=get_mode("c"))(x))
    assert np.array_equal(got, want) and np.array_equal(silu_reference(x), want)
    assert np.array_equal(np.stack([ggml_ref.vec_swiglu(a, b) for a, b in zip(x, g)]), got * g)


def test_native_kernels_build_once_per_machine_and_fall_back_with_a_warning(tmp_path, monkeypatch):
    """The C kernels' shared library (Numba's matmul) is built once into the cache and reused; a build that
    fails warns and leaves Numba its own kernels, as ALCHEMIST_NUMBA_NATIVE=0 does."""
    import functools

    monkeypatch.setenv("ALCHEMIST_CACHE", str(tmp_path / "cache"))
    cxx = pytensor.config.cxx
    _, version = native._load(cxx)
    assert len(list((tmp_path / "cache" / "native").glob("*.so"))) == 1
    calls, run = [], native.subprocess.run
    monkeypatch.setattr(native.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or run(cmd, **kw))
    assert native._load(cxx)[1] == version
    assert calls and all(cmd[1:] == ["--version"] for cmd in calls)  # asked the compiler's version, built nothing

    monkeypatch.setattr(native, "_source", lambda name: "this is not C++")
    monkeypatch.setattr(native, "_built", functools.lru_cache(maxsize=1)(native._built.__wrapped__))
    with pytest.warns(UserWarning, match="own matmul kernels: the C kernel library did not build"):
        assert native.matmul_kernel() is None
    monkeypatch.setenv("ALCHEMIST_NUMBA_NATIVE", "0")
    assert native.matmul_kernel() is None
