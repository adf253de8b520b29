"""Every PyTensor and Numba internal that alchemist reaches into: imported here, and nowhere else.

Everywhere else alchemist keeps to PyTensor's public API: graphs, Ops with their C and Numba implementations,
rewrites, modes, `pytensor.function`. Linking and compiling faster (alchemist.pytensor_ext.fast_link and
parallel_build), the compile progress bar (compile_progress), the graph cache, the layer views and the kernels'
build settings need more: the symbols in SYMBOLS, which PyTensor does not document and may change in any
release. pyproject pins the PyTensor series they were tested with (TESTED_PYTENSOR), and
tests/test_pytensor_internals.py checks each one (it exists, and takes the arguments alchemist passes), so
moving to a new PyTensor starts with running that file.

Under another PyTensor series `tested()` is False and one warning says so: the optional wrappers (fast_link,
parallel_build, compile_progress, fast_supervisor, fast_cycles) then stay off and PyTensor links, compiles and validates by
its own paths; what is still used (the compiler's and BLAS's flags, the graph cache's FunctionMaker, which falls
back to compiling afresh on any error) is what alchemist cannot do without.

Symbols are imported on first use (`pytensor_internals.CLinker`), so importing this module imports neither
PyTensor (alchemist.runtime.backends configures it first) nor Numba (an optional backend).
"""

from __future__ import annotations

import importlib
import warnings
from contextlib import contextmanager
from functools import lru_cache

TESTED_PYTENSOR = "3.3"  # the major.minor series; keep in step with pyproject's pin

# name here -> (module, attribute, what alchemist uses it for)
SYMBOLS: dict[str, tuple[str, str, str]] = {
    "CLinker": (
        "pytensor.link.c.basic",
        "CLinker",
        "fast_link wraps cthunk_factory; parallel_build and compile_progress wrap compile_cmodule",
    ),
    "CThunk": ("pytensor.link.c.basic", "_CThunk", "fast_link's per-node thunk is one, built without a CLinker"),
    "COp": ("pytensor.link.c.op", "COp", "fast_link and compile_progress wrap COp.make_c_thunk"),
    "get_module_cache": ("pytensor.link.c.basic", "get_module_cache", "parallel_build skips compiled modules"),
    "get_module_hash": ("pytensor.link.c.cmodule", "get_module_hash", "parallel_build: the compiledir's key"),
    "get_lib_extension": ("pytensor.link.c.cmodule", "get_lib_extension", "parallel_build names its builds"),
    "dlimport": ("pytensor.link.c.cmodule", "dlimport", "parallel_build imports a module it built"),
    "GCC_compiler": (
        "pytensor.link.c.cmodule",
        "GCC_compiler",
        "the compiler's flags (march_flags remembered per machine; compile_args, try_flags for the kernels)",
    ),
    "FunctionMaker": (
        "pytensor.compile.maker",
        "FunctionMaker",
        "the graph cache builds one from a stored graph; compile_progress wraps create and prepare_fgraph; "
        "the layer views rewrite with create_fgraph and prepare_fgraph",
    ),
    "construct_function_ins_and_outs": (
        "pytensor.compile.rebuild",
        "construct_function_ins_and_outs",
        "the engine rewrites a step before linking it (pytensor.function's first half)",
    ),
    "VMLinker": ("pytensor.link.vm", "VMLinker", "the engine tells a C-thunk linker by its c_thunks"),
    "Supervisor": ("pytensor.compile.aliasing", "Supervisor", "fast_supervisor replaces its on_validate"),
    "DestroyHandler": (
        "pytensor.graph.destroyhandler",
        "DestroyHandler",
        "fast_supervisor reads its refresh_droot_impact() maps",
    ),
    "InconsistencyError": ("pytensor.graph.utils", "InconsistencyError", "fast_supervisor refuses a graph with it"),
    "contains_cycle": (
        "pytensor.graph.destroyhandler",
        "_contains_cycle",
        "fast_cycles answers its question faster and takes its place in the module DestroyHandler.validate reads",
    ),
    "blas_ldflags": ("pytensor.tensor.blas._core", "ldflags", "the kernels link PyTensor's BLAS"),
    "blas_header_text": ("pytensor.tensor.blas.c_code.blas_headers", "blas_header_text", "the kernels' BLAS"),
    "blas_header_version": (
        "pytensor.tensor.blas.c_code.blas_headers",
        "blas_header_version",
        "the kernels' C cache version",
    ),
    "numba_njit": ("pytensor.link.numba.dispatch.basic", "numba_njit", "the Numba kernels' graph wrappers"),
    "register_funcify_default_op_cache_key": (
        "pytensor.link.numba.dispatch.basic",
        "register_funcify_default_op_cache_key",
        "registers the Numba kernels, cached on disk by the Op's props and a source version",
    ),
    "numba_launch_threads": (
        "numba.np.ufunc.parallel",
        "_launch_threads",
        "Numba's own prange kernels start its threading layer (a graph loaded from cache does not)",
    ),
    "jax_funcify": ("pytensor.link.jax.dispatch", "jax_funcify", "registers the ggml kernels' JAX custom calls"),
    "mlx_funcify": ("pytensor.link.mlx.dispatch", "mlx_funcify", "registers the ggml kernels' MLX host calls"),
    "MLXLinker": (
        "pytensor.link.mlx.linker",
        "MLXLinker",
        "kernels.mlx_host subclasses it: jit_compile skips mx.compile (use_compile) for a graph calling C",
    ),
    "ConfigParam": (
        "pytensor.configparser",
        "ConfigParam",
        "host sets blas__ldflags for a block without reading it first (a ConfigParam holds its value in `val`, "
        "computed from the default on first read: for blas__ldflags PyTensor's BLAS probe, 0.3 s)",
    ),
    "numba_external_function": (
        "numba.core.types",
        "ExternalFunction",
        "the C kernel library's entry point, called from Numba by symbol name (kernels/native.py)",
    ),
}


def __getattr__(name: str):
    if name not in SYMBOLS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute, _ = SYMBOLS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip __getattr__
    return value


@lru_cache(maxsize=1)
def tested() -> bool:
    """Whether the installed PyTensor is the series these internals were tested with (warns once if not)."""
    import pytensor

    series = pytensor.__version__.split(".")[:2]
    if series == TESTED_PYTENSOR.split("."):
        return True
    warnings.warn(
        f"alchemist was tested with PyTensor {TESTED_PYTENSOR}.x, this is {pytensor.__version__}: its faster "
        "linking, parallel compiling and compile progress stay off (alchemist/pytensor_ext/pytensor_internals.py)",
        stacklevel=2,
    )
    return False


def user_set_flag(name: str) -> bool:
    """Whether the user gave PyTensor flag `name` (PYTENSOR_FLAGS or .pytensorrc)."""
    import pytensor

    try:
        pytensor.config.fetch_val_for_key(name)
    except KeyError:
        return False
    return True


@contextmanager
def flag_for_block(name: str, value):
    """pytensor.config.change_flags(name=value), except that a flag nobody has read yet stays unread: change_flags
    reads the old value first, which for blas__ldflags runs PyTensor's BLAS probe; here the flag's value is set
    for the block and removed after it, so a later read computes PyTensor's default as it would have."""
    import pytensor

    param = pytensor.config._config_var_dict[name]  # noqa: SLF001 - the flag's ConfigParam
    if not tested() or not isinstance(param, __getattr__("ConfigParam")) or hasattr(param, "val"):
        with pytensor.config.change_flags(**{name: value}):
            yield
        return
    param.__set__(pytensor.config, value)
    try:
        yield
    finally:
        del param.val
