"""MLX's affine quantization as a kernel type (alchemist.kernels.mlx_affine): weights quantized by MLX itself, the
product on every backend against dequantize-then-matmul, MLX's own mx.quantized_matmul on MLX."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from alchemist.kernels.mlx_affine import MlxAffineMatmul, dequantize_graph, dequantize_reference, mlx_affine_linear
from alchemist.runtime.backends import get_mode

mx = pytest.importorskip("mlx.core")  # the oracle extra; installed in CI

LAYOUTS = [(bits, group) for bits in (2, 3, 4, 5, 6, 8) for group in (32, 64, 128)]
N_OUT, N_IN = 48, 256


def quantized(bits: int, group: int, seed: int = 0):
    """A random (N_OUT, N_IN) weight quantized by mx.quantize: (packed, scales, biases) as numpy, and MLX's own
    dequantization of it."""
    w = np.random.default_rng(seed).standard_normal((N_OUT, N_IN)).astype(np.float32)
    packed, scales, biases = mx.quantize(mx.array(w), group_size=group, bits=bits)
    dequantized = np.array(mx.dequantize(packed, scales, biases, group_size=group, bits=bits))
    return (np.array(packed), np.array(scales), np.array(biases)), dequantized


@pytest.mark.parametrize("bits,group", LAYOUTS)
def test_dequantization_is_mlx_bit_for_bit_in_numpy_and_in_the_graph(bits, group):
    (packed, scales, biases), want = quantized(bits, group)
    assert packed.dtype == np.uint32 and packed.shape == (N_OUT, N_IN * bits // 32)
    np.testing.assert_array_equal(dequantize_reference(packed, scales, biases, bits, group), want)
    graph = dequantize_graph(pt.as_tensor(packed), pt.as_tensor(scales), pt.as_tensor(biases), bits, group, N_IN)
    np.testing.assert_array_equal(graph.eval(), want)


@pytest.mark.parametrize("backend", ["c", "numba", "jax", "mlx"])
def test_the_product_is_dequantize_then_matmul_on_every_backend(backend):
    """Every layout through one compiled function per backend and layout; C's module is compiled once for all (the
    layout and shape are run-time parameters). MLX computes with mx.quantized_matmul: its result exactly."""
    pytest.importorskip({"c": "pytensor", "numba": "numba", "jax": "jax", "mlx": "mlx"}[backend])
    x_value = np.random.default_rng(1).standard_normal((5, N_IN)).astype(np.float32)
    for bits, group in LAYOUTS if backend in ("c", "mlx") else [(4, 64), (3, 32), (6, 128)]:
        (packed, scales, biases), dequantized = quantized(bits, group, seed=bits * group)
        x = pt.matrix("x", dtype="float32", shape=(5, N_IN))
        parts = [pt.matrix(n, dtype=d) for n, d in (("w", "uint32"), ("s", "float32"), ("b", "float32"))]
        y = mlx_affine_linear(x, *parts, bits, group, N_OUT, N_IN)
        f = pytensor.function([x, *parts], y, mode=get_mode(backend))
        if backend != "jax":  # JAX gets the dequantization as ops (the rewrite tagged "jax")
            assert any(isinstance(n.op, MlxAffineMatmul) for n in f.maker.fgraph.apply_nodes)
        got = np.asarray(f(x_value, packed, scales, biases))
        want = x_value @ dequantized.T
        assert got.dtype == np.float32 and got.shape == (5, N_OUT)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        if backend == "mlx":
            native = mx.quantized_matmul(mx.array(x_value), *map(mx.array, (packed, scales, biases)), transpose=True,
                                         group_size=group, bits=bits)  # fmt: skip
            np.testing.assert_array_equal(got, np.array(native))
        if backend == "c":  # row t of a T-token product is the 1-token product of token t
            np.testing.assert_array_equal(got[2:3], f(x_value[2:3].repeat(5, 0), packed, scales, biases)[:1])


def test_the_gradient_with_respect_to_the_input_and_wrong_shapes_refused():
    (packed, scales, biases), dequantized = quantized(4, 32)
    x = pt.matrix("x", dtype="float32", shape=(3, N_IN))
    y = mlx_affine_linear(x, packed, scales, biases, 4, 32, N_OUT, N_IN)
    gx = pytensor.function([x], pt.grad(y.sum(), x), mode=get_mode("c"))
    x_value = np.ones((3, N_IN), np.float32)
    np.testing.assert_allclose(gx(x_value), np.repeat(dequantized.sum(0, keepdims=True), 3, 0), rtol=1e-5, atol=1e-4)
    with pytest.raises(TypeError, match="w must be a uint32 matrix"):
        mlx_affine_linear(x, packed[:, :-1], scales, biases, 4, 32, N_OUT, N_IN)
    with pytest.raises(ValueError, match="bits 7"):
        MlxAffineMatmul(7, 32, N_OUT, N_IN)
    f = pytensor.function([x, w := pt.matrix("w", dtype="uint32")], MlxAffineMatmul(4, 32, N_OUT, N_IN)(
        x, w, scales, biases), mode=get_mode("c"))  # fmt: skip
    with pytest.raises(ValueError, match="does not have the shape"):
        f(x_value, packed[:, :8])
