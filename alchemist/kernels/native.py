"""The C kernels as one shared library, for a backend that calls native code itself (Numba).

The C backend compiles `c_kernels.C_SOURCE` into the PyTensor module of each QuantizedMatmul. The Numba backend
calls the very same kernels: `matmul_kernel()` builds C_SOURCE once per machine into a shared library with one
exported entry point (`alchemist_matmul_<digest>(type index, ggml?, W, n_out, n_in, X, T, Y)`, dispatching to
`run<Q>` / `run_ggml<Q>`), kept in alchemist's cache under a key made of the source, the compiler and its flags.
The library is loaded with llvmlite's `load_library_permanently` and the entry point is returned as a Numba
external function, bound by its symbol name, so Numba code calling it can still be cached on disk.

None when there is no C++ compiler, or the build fails (with a warning): Numba then uses its own kernels
(alchemist.kernels.numba_kernels). ALCHEMIST_NUMBA_NATIVE=0 asks for those too.
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

# the `type_index` argument (also the type index of Numba's own kernels, alchemist.kernels.numba_kernels.KINDS)
TYPE_INDEX = {name: i for i, name in enumerate(formats.SUPPORTED_TYPES)}

_ENTRY = """
extern "C" __attribute__((visibility("default"))) int {name}(int type_index, int ggml, uintptr_t W, long long n_out,
                                                          long long n_in, uintptr_t X, long long T, uintptr_t Y) {{
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
    return kernel_source() + _ENTRY.format(name=name, cases=cases)


def _command(cxx: str) -> list[str]:
    """The compiler command, run in the build folder: PyTensor's own g++ flags (-march=..., -fPIC) and the kernel
    Ops' flags and libraries."""
    from alchemist.kernels.op import _blas_flags, kernel_compile_args, kernel_libraries
    from alchemist.runtime.pytensor_internals import GCC_compiler

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
    if os.environ.get("ALCHEMIST_NUMBA_NATIVE", "1") == "0":  # read at each Op's Numba compile
        return None
    return _built()


@lru_cache(maxsize=1)
def _built():
    import pytensor

    cxx = pytensor.config.cxx
    if not cxx:
        return None
    try:
        return _load(cxx)
    except Exception as exc:  # noqa: BLE001 - any failure to build or load: Numba's own kernels still work
        warnings.warn(f"Numba falls back to its own matmul kernels: the C kernel library did not build ({exc})")
        return None


def _load(cxx: str):
    from llvmlite import binding
    from numba import types

    from alchemist.paths import cache_subdir
    from alchemist.runtime.pytensor_internals import numba_external_function

    probe = hashlib.sha256(C_SOURCE.encode() + _ENTRY.encode()).hexdigest()[:16]
    name = f"alchemist_matmul_{probe}"
    source = _source(name)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    command = _command(cxx)
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
    binding.load_library_permanently(str(library))
    sig = types.int32(
        types.int32, types.int32, types.uintp, types.int64, types.int64, types.uintp, types.int64, types.uintp
    )
    return numba_external_function(name, sig), int(key[:12], 16)
