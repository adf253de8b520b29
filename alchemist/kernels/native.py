"""The C kernels as shared libraries, for the backends that call native code themselves (Numba; JAX and MLX for
numerics="ggml": alchemist.kernels.jax_ffi, mlx_host).

The C backend compiles `c_kernels.C_SOURCE` into the PyTensor module of each QuantizedMatmul. The Numba backend
calls the very same kernels: `matmul_kernel()` builds C_SOURCE once per machine into a shared library with one
exported entry point (`alchemist_matmul_<digest>(type index, ggml?, W, n_out, n_in, X, T, Y)`, dispatching to
`run<Q>` / `run_ggml<Q>`), kept in alchemist's cache under a key made of the source, the compiler and its flags.
The library is loaded with llvmlite's `load_library_permanently` and the entry point is returned as a Numba
external function, bound by its symbol name, so Numba code calling it can still be cached on disk.

None when there is no C++ compiler, or the build fails (with a warning): Numba then uses its own kernels
(alchemist.kernels.numba_kernels). ALCHEMIST_NUMBA_NATIVE=0 asks for those too.

`ops_kernels()` does the same for the other ops numerics="ggml" computes in C, ggml's RoPE (cache and rotation),
causal attention, SiLU and table GELU (alchemist.kernels.rope, attention, silu, gelu): one more library, so that
Numba computes them bit for bit as the C backend (and llama.cpp) do. Without it, Numba gets their float32
formulas as PyTensor ops (the rewrite registered by `register_numba_expansion`), equal up to rounding.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

from alchemist.kernels import formats
from alchemist.kernels.c_kernels import C_SOURCE
from alchemist.kernels.signatures import c_declaration, numba_signature
from alchemist.kernels.sources import source
from alchemist.pytensor_ext.host import activating

# the `type_index` argument (also the type index of Numba's own kernels, alchemist.kernels.numba_kernels.KINDS)
TYPE_INDEX = {name: i for i, name in enumerate(formats.SUPPORTED_TYPES)}

_ENTRY = """
extern "C" __attribute__((visibility("default"))) {declaration} {{
    using namespace alchemist_q;
    const uint8_t *w = (const uint8_t *)W;
    const float *x = (const float *)X;
    float *y = (float *)Y;
    switch (type_index) {{
{cases}
    }}
    return -2; /* an unknown type index */
}}
"""


def _source(name: str) -> str:
    from alchemist.kernels.op import kernel_source

    cases = "\n".join(
        f"    case {i}: return ggml ? run_ggml<{t}>(w, n_out, n_in, x, T, y) : run<{t}>(w, n_out, n_in, x, T, y);"
        for t, i in TYPE_INDEX.items()
    )
    return kernel_source() + _ENTRY.format(declaration=c_declaration("matmul", name), cases=cases)


def _command(cxx: str) -> list[str]:
    """The compiler command, run in the build folder: PyTensor's own g++ flags (-march=..., -fPIC) and the kernel
    Ops' flags and libraries."""
    from alchemist.kernels.op import _blas_flags, kernel_compile_args, kernel_libraries
    from alchemist.pytensor_ext.pytensor_internals import GCC_compiler

    includes = [f"-I{d}" for d in _blas_flags(include_dir=True)]
    links = [f"-L{d}" for d in _blas_flags(libs_dir=True)] + [f"-l{lib}" for lib in kernel_libraries()]
    return [
        cxx,
        "-shared",
        *GCC_compiler.compile_args(),
        *kernel_compile_args(),
        *includes,
        "-o",
        "k.so",
        "k.cpp",
        *links,
    ]


def matmul_kernel():
    """(Numba external function, digest) for the kernels' entry point, or None (see the module docstring)."""
    return _built() if _wanted() else None


def _wanted() -> bool:
    return os.environ.get("ALCHEMIST_NUMBA_NATIVE", "1") != "0"  # read at each Op's Numba compile


def _build_or_warn(load, fallback: str):
    """load(cxx) with PyTensor's C++ compiler; None without one, or with a warning `fallback` naming what Numba
    does instead when the build or the load fails."""
    import pytensor

    cxx = pytensor.config.cxx
    if not cxx:
        return None
    try:
        return load(cxx)
    except Exception as exc:  # noqa: BLE001 - any failure to build or load: Numba has a fallback
        warnings.warn(f"{fallback}: the C kernel library did not build ({exc})")
        return None


@lru_cache(maxsize=1)
def _built():
    return _build_or_warn(_load, "Numba falls back to its own matmul kernels")


def _library(source: str, command: list[str], version: str) -> tuple[Path, str]:
    """(path, key) of `source` built by `command` (run in a folder holding it as k.cpp, writing k.so), kept in
    alchemist's cache under a key made of the source, the compiler's version and the command."""
    from alchemist.paths import cache_subdir

    key = hashlib.sha256("\0".join([source, version, *command]).encode()).hexdigest()
    library = cache_subdir("native") / f"{key}.so"
    if not library.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.cpp").write_text(source)
            done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command[:2])} ... exited {done.returncode}: {done.stderr[-2000:]}")
            staged = library.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(Path(tmp) / "k.so", staged)
            os.replace(staged, library)
    return library, key


def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout


@activating
def matmul_library(cxx: str) -> tuple[Path, str, str]:
    """(path, entry point's symbol, key) of the matmul library, built with `cxx` unless it is in the cache."""
    probe = hashlib.sha256(C_SOURCE.encode() + _ENTRY.encode()).hexdigest()[:16]
    name = f"alchemist_matmul_{probe}"
    library, key = _library(_source(name), _command(cxx), _compiler_version(cxx))
    return library, name, key


@activating
def _load(cxx: str):
    from llvmlite import binding

    from alchemist.pytensor_ext.pytensor_internals import numba_external_function

    library, name, key = matmul_library(cxx)
    binding.load_library_permanently(str(library))
    return numba_external_function(name, numba_signature("matmul")), int(key[:12], 16)


# -- RoPE, attention, SiLU and GELU as ggml computes them (the C backend's Ops' own C code) ---------------------
_OPS_BODIES = {  # entry point -> the call it makes (its arguments: kernels.signatures.ENTRY_POINTS)
    "rope_cache": "alchemist_rope::cache((const int64_t *)pos, n_pos, (const float *)ff, ff_stride, n_dims, freq_base, "
    "freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig, (float *)out);",
    "rope": "alchemist_rope::rotate((const float *)x, (const float *)cache, (float *)y, n_pos, n_head, head_dim, n_dims, "
    "neox);",
    "attention": "return alchemist_attn::attend((const float *)q, (const float *)k, (const float *)v, "
    "(const int64_t *)qpos, (const int64_t *)kpos, (const float *)sinks, (float *)out, B, T, S, H, KVH, D, window, "
    "scale, softcap);",
    "silu": "alchemist_silu::apply((const float *)x, (float *)y, rows, n);",
    # the table, once per process (the C Op builds it in its module's init)
    "gelu": "alchemist_gelu::build();\n    alchemist_gelu::apply((const float *)x, (float *)y, n);",
}


def _ops_entries(prefix: str) -> str:
    """The exported wrappers `<prefix>_<entry point>` of the ops library."""
    export = 'extern "C" __attribute__((visibility("default")))'
    return "".join(
        f"{export} {c_declaration(name, f'{prefix}_{name}')} {{\n    {body}\n}}\n" for name, body in _OPS_BODIES.items()
    )


def _ops_source() -> str:
    """The RoPE, attention, SiLU and GELU Ops' C code in one translation unit (each in its own namespace)."""
    parts = (source(name) for name in ("rope.cpp", "attention.cpp", "silu.cpp", "gelu.cpp"))
    return "\n".join(["#include <stdint.h>", *parts])


def ops_kernels():
    """(entry points, digest) of the ops library: a dict of Numba external functions ("rope_cache", "rope",
    "attention", "silu", "gelu": each Op's C code as alchemist.kernels.rope, attention, silu and gelu build it for
    the C backend) and an integer digest of the library; or None: no C++ compiler, ALCHEMIST_NUMBA_NATIVE=0, or a
    failed build (with a warning)."""
    return _ops_built() if _wanted() else None


@lru_cache(maxsize=1)
def _ops_built():
    return _build_or_warn(_ops_load, "Numba computes RoPE, attention, SiLU and GELU as PyTensor ops")


def ops_flags() -> list[str]:
    """The flags the C backend builds these Ops with: PyTensor's (-march=...), OpenMP, no FMA contraction."""
    from alchemist.kernels.op import _openmp_flags
    from alchemist.pytensor_ext.pytensor_internals import GCC_compiler

    return [*GCC_compiler.compile_args(), *_openmp_flags(), "-O3", "-ffp-contract=off", "-fno-fast-math"]


@activating
def ops_library(cxx: str) -> tuple[Path, str, str]:
    """(path, the entry points' symbol prefix, key) of the ops library, built with `cxx` unless it is cached."""
    from alchemist.kernels.op import _openmp_flags

    body = _ops_source()
    prefix = f"alchemist_ops_{hashlib.sha256((body + _ops_entries('')).encode()).hexdigest()[:16]}"
    source = body + "\n" + _ops_entries(prefix)
    libs = ["-lgomp"] if _openmp_flags() else []
    command = [cxx, "-shared", *ops_flags(), "-o", "k.so", "k.cpp", *libs]
    library, key = _library(source, command, _compiler_version(cxx))
    return library, prefix, key


@activating
def _ops_load(cxx: str):
    from llvmlite import binding

    from alchemist.pytensor_ext.pytensor_internals import numba_external_function

    library, prefix, key = ops_library(cxx)
    binding.load_library_permanently(str(library))
    functions = {name: numba_external_function(f"{prefix}_{name}", numba_signature(name)) for name in _OPS_BODIES}
    return functions, int(key[:12], 16)


_RMS_NORM_ENTRY = """
extern "C" __attribute__((visibility("default"))) {declaration} {{
    alchemist_rms_norm::apply((const float *)x, (const float *)w, (float *)y, rows, n, eps);
}}
"""


@activating
def rms_norm_library(cxx: str) -> tuple[Path, str, str]:
    """(path, entry point's symbol, key) of ggml's RMS norm loops (alchemist.kernels.rms_norm, the C Op's code) as a
    library of their own, with the ops' flags, for a backend calling C from Python (MLX)."""
    rms_norm = source("rms_norm.cpp")
    name = f"alchemist_rms_norm_{hashlib.sha256((rms_norm + _RMS_NORM_ENTRY).encode()).hexdigest()[:16]}"
    text = "#include <stdint.h>\n" + rms_norm + _RMS_NORM_ENTRY.format(declaration=c_declaration("rms_norm", name))
    command = [cxx, "-shared", *ops_flags(), "-o", "k.so", "k.cpp"]
    library, key = _library(text, command, _compiler_version(cxx))
    return library, name, key


def entry_points(cxx: str) -> dict[str, tuple[Path, str]]:
    """Each kernel entry point (kernels.signatures.ENTRY_POINTS) -> (the library exporting it, its symbol), the three
    libraries built with `cxx` unless cached: what a backend calling C from outside Numba (JAX, MLX) links."""
    matmul_path, matmul_name, _ = matmul_library(cxx)
    ops_path, ops_prefix, _ = ops_library(cxx)
    rms_path, rms_name, _ = rms_norm_library(cxx)
    ops = {name: (ops_path, f"{ops_prefix}_{name}") for name in _OPS_BODIES}
    return {"matmul": (matmul_path, matmul_name), "rms_norm": (rms_path, rms_name), **ops}


def register_numba_expansion(name: str, rewriter) -> None:
    """Register `rewriter` (a node rewriter expanding a C Op into PyTensor ops) for Numba, applied only when the
    ops library is unavailable (ops_kernels() is None); with it, Numba calls the Op's C code (idempotent)."""
    from pytensor.compile.mode import optdb
    from pytensor.graph.rewriting.basic import in2out, node_rewriter

    if name in optdb:
        return

    @node_rewriter(rewriter.tracks())
    def expand_without_library(fgraph, node):
        return None if ops_kernels() is not None else rewriter.transform(fgraph, node)

    optdb.register(name, in2out(expand_without_library), "numba", position=0.9)
