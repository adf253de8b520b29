"""PyTensor compilation modes for the four backends, configured explicitly.

- "c": PyTensor's C backend run by the CVM linker (the "cvm" linker with the fast_run rewrites). Its
  BLAS ops need `blas__ldflags`; pip-installed PyTensor finds none, so we point it at a system OpenBLAS
  (Debian `libopenblas-dev`) when one is present. Without one, PyTensor falls back to Python
  implementations of the BLAS ops that call numpy's own (OpenBLAS) dot: slower per op, still correct;
  `blas_info()` reports which one is in use.
- "numba": PyTensor's Numba backend (`NUMBA` mode; the default FAST_RUN in PyTensor 3.3).
- "jax", "mlx": PyTensor's JAX / MLX backends.
"""

from __future__ import annotations

import importlib.util

from alchemist.errors import AlchemistError, BackendUnavailableError

BACKENDS = ("c", "numba", "jax", "mlx")
_REQUIRED_PACKAGE = {"numba": "numba", "jax": "jax", "mlx": "mlx"}


def blas_info() -> str:
    """The BLAS alchemist's C graphs link: PyTensor's flag as alchemist sets it around its own compiles (read
    outside them, the host's own setting would make PyTensor probe for a BLAS and warn)."""
    import pytensor

    from alchemist.pytensor_ext.host import activated

    with activated():
        ldflags = pytensor.config.blas__ldflags
    return ldflags if ldflags else "none (numpy dot through Python fallbacks)"


def require_backend(name: str) -> None:
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    package = _REQUIRED_PACKAGE.get(name)
    if package and importlib.util.find_spec(package) is None:
        extra = "mlx[cpu]" if package == "mlx" else package
        raise BackendUnavailableError(f"backend {name!r} needs the {package!r} package: pip install '{extra}'")


def get_mode(name: str):
    """The pytensor Mode for a backend name."""
    require_backend(name)
    from pytensor.compile.mode import Mode, get_mode as pytensor_mode

    from alchemist.runtime import rewrites

    rewrites.register()
    if name == "c":
        mode = Mode(linker="cvm", optimizer="fast_run").including(rewrites.TAG)
    else:
        mode = pytensor_mode({"numba": "NUMBA", "jax": "JAX", "mlx": "MLX"}[name])
        if name == "jax":  # the ggml Ops as custom calls (used where the library built: kernels.jax_ffi.handles)
            from alchemist.kernels import jax_ffi

            jax_ffi.register()
        if name == "mlx":  # the ggml Ops as calls into C, run uncompiled (kernels.mlx_host)
            from alchemist.kernels import mlx_host

            mlx_host.register()
            mode = Mode(linker=mlx_host.linker_class()(), optimizer=mode.provided_optimizer)
        # Numba compiles each distinct fused Composite too; JAX and MLX fuse on their own
        mode = mode.including(rewrites.TAG) if name == "numba" else mode
    return mode.excluding(*UNUSED_REWRITES)


# PyTensor's linear-algebra rewrites that ask, for every matrix product, whether an operand is diagonal, symmetric
# or a row selection: a model's products never are, and the asking (PyTensor's AssumptionFeature walking the
# graph after each change) was a sixth of rewriting a large graph. Excluding them leaves the rewritten graph as it was.
UNUSED_REWRITES = ("dot_diag_to_elemwise", "selection_dot_to_indexing", "useless_symmetric_transpose")


def static_shapes(name: str) -> bool:
    """JAX and MLX trace with static shapes: attention must read the whole cache, masked."""
    return name in ("jax", "mlx")


# Backends that multiply quantized weights in their GGUF blocks (alchemist.kernels' C and Numba kernels).
KERNEL_BACKENDS = ("c", "numba")
# How load_llm holds the KERNEL_WEIGHTS: "quantized" (GGUF blocks: on C and Numba read-only views of the file's
# memory map, on JAX and MLX a copy in the framework's memory) or "float32" (dequantized once at load time, ~4-7x
# the bytes).
WEIGHT_FORMATS = ("quantized", "float32")


def default_weights(name: str, numerics: str = "exact", mlx_packed: bool = False) -> str:
    """The weight format a backend gets unless asked: "quantized" where kernels multiply GGUF blocks (C, Numba;
    JAX and MLX with numerics="ggml", which call the C kernels: alchemist.kernels.jax_ffi, mlx_host); "float32"
    elsewhere, where the graph would dequantize every weight on every step: on gemma-3-270m (benchmarks/memory.py)
    decoding was 2-5x (JAX) and 10-12x (MLX) slower, and peak RSS hardly lower (the dequantized temporaries of a
    prefill step are float32 weights again: JAX 1.9 GB vs 2.2, MLX 2.3 GB vs 2.2), though steady RSS is lower.
    mlx_packed: the model is a snapshot with MLX-quantized projections, which MLX multiplies packed with its own
    mx.quantized_matmul (kernels.mlx_affine): "quantized" on MLX too."""
    if name in KERNEL_BACKENDS or name == "mlx" and mlx_packed:
        return "quantized"
    if name == "jax" and numerics == "ggml":
        from alchemist.kernels import jax_ffi

        return "quantized" if jax_ffi.available() else "float32"
    if name == "mlx" and numerics == "ggml":
        from alchemist.kernels import mlx_host

        return "quantized" if mlx_host.available() else "float32"
    return "float32"


def check_weights(weights: str | None, backend: str, numerics: str = "exact", mlx_packed: bool = False) -> str:
    """`weights` ("quantized", "float32", or None for the backend's default with `numerics`), checked."""
    if weights is None:
        return default_weights(backend, numerics, mlx_packed)
    if weights not in WEIGHT_FORMATS:
        raise AlchemistError(f"unknown weights {weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    return weights


def uses_quantized_kernels(
    name: str, weights: str | None = None, numerics: str = "exact", mlx_packed: bool = False
) -> bool:
    """True when `name` should load weights with load_weights(..., quantized=True) (for `weights`, or the
    backend's default format with `numerics`; mlx_packed: see default_weights)."""
    return check_weights(weights, name, numerics, mlx_packed) == "quantized"


def mlx_packed(ir) -> bool:
    """Whether the IR's projections include MLX-quantized ones its kernels multiply packed (a snapshot's)."""
    return any(t.kernel and t.ggml_type == "MLX_AFFINE" for t in ir.tensors)
