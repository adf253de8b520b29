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

import ctypes.util
import importlib.util
import os
from pathlib import Path

from alchemist.errors import AlchemistError, BackendUnavailableError

BACKENDS = ("c", "numba", "jax", "mlx")
_REQUIRED_PACKAGE = {"numba": "numba", "jax": "jax", "mlx": "mlx"}
_OPENBLAS_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def system_blas_ldflags() -> str | None:
    """PyTensor's blas__ldflags for the system OpenBLAS (Debian's libopenblas-dev), or None without one."""
    for d in _OPENBLAS_DIRS:
        if Path(d, "libopenblas.so").exists():
            return f"-L{d} -lopenblas"
    return "-lopenblas" if ctypes.util.find_library("openblas") else None


def one_blas_thread() -> None:
    """Run the system OpenBLAS (the one the C backend links) on one thread, unless OPENBLAS_NUM_THREADS says
    otherwise. Our kernels parallelize with OpenMP; OpenBLAS's own pthread pool spin-waits between calls and
    fights the OpenMP team for the cores, which made a prefill (OpenMP dequantization of weight panels, then
    sgemm) several times slower. numpy's bundled OpenBLAS is another library and is left alone."""
    if "OPENBLAS_NUM_THREADS" in os.environ:
        return
    try:
        ctypes.CDLL("libopenblas.so.0").openblas_set_num_threads(1)  # the soname the compiled modules load
    except (OSError, AttributeError):
        pass


def configure_pytensor() -> None:
    """For a process that wants alchemist's settings everywhere (the test suite, benchmarks), not called by
    alchemist itself (alchemist.runtime.host sets them around its own compiles): set PyTensor's flags before
    pytensor is first imported (BLAS for the C backend, float32 default) and the system OpenBLAS to one thread."""
    one_blas_thread()  # also when blas__ldflags came in PYTENSOR_FLAGS (a child of a process that set it)
    flags = os.environ.get("PYTENSOR_FLAGS", "")
    extra = []
    if "blas__ldflags" not in flags:
        ldflags = system_blas_ldflags()
        if ldflags:
            extra.append(f"blas__ldflags={ldflags}")
    if "floatX" not in flags:
        extra.append("floatX=float32")
    if extra:
        os.environ["PYTENSOR_FLAGS"] = ",".join(([flags] if flags else []) + extra)


def restore_gcc_march_flags() -> None:
    """Give PyTensor its `-march=native`-equivalent g++ flags from our cache instead of re-detecting them.

    PyTensor detects them once per process by running g++ (0.3 s of every model load). They depend on the
    compiler and the CPU only, so we remember them keyed by both; a different machine sharing the home
    directory gets its own entry. Call after pytensor is imported, before anything is compiled.
    """
    import hashlib
    import json
    import shutil

    import pytensor

    from alchemist.paths import cache_subdir, remember
    from alchemist.runtime.pytensor_internals import GCC_compiler

    if GCC_compiler.march_flags is not None or not pytensor.config.cxx:
        return
    compiler = shutil.which(pytensor.config.cxx) or pytensor.config.cxx
    try:
        st = os.stat(compiler)
        cpu = [
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "model name"))
        ]
    except OSError:
        return
    identity = [
        os.path.realpath(compiler),
        st.st_size,
        st.st_mtime_ns,
        sorted(set(cpu)),
        pytensor.__version__,
        pytensor.config.gcc__cxxflags,
    ]
    memo = cache_subdir("march") / (hashlib.sha256(json.dumps(identity).encode()).hexdigest() + ".json")
    try:
        flags = json.loads(memo.read_text())
        if isinstance(flags, list) and all(isinstance(f, str) and f and f.split() == [f] for f in flags):
            GCC_compiler.march_flags = flags
            return
    except (OSError, ValueError):
        pass
    GCC_compiler.compile_args()  # detects and sets GCC_compiler.march_flags
    if GCC_compiler.march_flags is not None:
        remember(memo, json.dumps(GCC_compiler.march_flags))


def blas_info() -> str:
    import pytensor

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


def default_weights(name: str, numerics: str = "exact") -> str:
    """The weight format a backend gets unless asked: "quantized" where kernels multiply GGUF blocks (C, Numba;
    JAX and MLX with numerics="ggml", which call the C kernels: alchemist.kernels.jax_ffi, mlx_host); "float32"
    elsewhere, where the graph would dequantize every weight on every step: on gemma-3-270m (benchmarks/memory.py)
    decoding was 2-5x (JAX) and 10-12x (MLX) slower, and peak RSS hardly lower (the dequantized temporaries of a
    prefill step are float32 weights again: JAX 1.9 GB vs 2.2, MLX 2.3 GB vs 2.2), though steady RSS is lower."""
    if name in KERNEL_BACKENDS:
        return "quantized"
    if name == "jax" and numerics == "ggml":
        from alchemist.kernels import jax_ffi

        return "quantized" if jax_ffi.available() else "float32"
    if name == "mlx" and numerics == "ggml":
        from alchemist.kernels import mlx_host

        return "quantized" if mlx_host.available() else "float32"
    return "float32"


def check_weights(weights: str | None, backend: str, numerics: str = "exact") -> str:
    """`weights` ("quantized", "float32", or None for the backend's default with `numerics`), checked."""
    if weights is None:
        return default_weights(backend, numerics)
    if weights not in WEIGHT_FORMATS:
        raise AlchemistError(f"unknown weights {weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    return weights


def uses_quantized_kernels(name: str, weights: str | None = None, numerics: str = "exact") -> bool:
    """True when `name` should load weights with load_weights(..., quantized=True) (for `weights`, or the
    backend's default format with `numerics`)."""
    return check_weights(weights, name, numerics) == "quantized"
