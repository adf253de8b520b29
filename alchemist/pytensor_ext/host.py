"""What alchemist changes in PyTensor while it builds and compiles its graphs, and only then.

Importing alchemist changes nothing in the process: no PyTensor flag, class or `sys.modules` entry. alchemist's
own graph building and compiling run inside `activated()`, which, in this fixed order:

1. sets two PyTensor flags: `floatX=float32` (a Python float in a graph is float32, not float64) and
   `blas__ldflags` pointing at the system OpenBLAS (pip-installed PyTensor finds none) unless the user set one
   (pytensor_internals.flag_for_block: a flag never read stays unread, so PyTensor's own BLAS probe never runs
   for alchemist);
2. gives PyTensor's compiler its remembered `-march` flags (restore_gcc_march_flags: 0.3 s of g++ per
   process otherwise);
3. installs the compile speed-ups over PyTensor's internals (alchemist.pytensor_ext.pytensor_internals lists every
   private symbol; each is tested against the pinned PyTensor series), in the order they wrap one another:
   fast_link (CLinker.cthunk_factory, COp.make_c_thunk), parallel_build (CLinker.compile_cmodule),
   compile_progress (FunctionMaker.prepare_fgraph / create, around the two before), fast_supervisor
   (Supervisor.on_validate), fast_cycles (the destroy handler's cycle check, destroyhandler._contains_cycle).

On leaving the outermost block every patched attribute gets its original back and the flags their values, so a
PyMC model compiled next to an alchemist model compiles as if alchemist were absent. The block is re-entrant and
held by one thread at a time (PyTensor's flags and classes are process-wide: two threads compiling at once would
see each other's settings), so a user's compile in another thread waits for alchemist's to finish.
"""

from __future__ import annotations

import ctypes.util
import os
import threading
from contextlib import ExitStack, contextmanager
from functools import cache
from pathlib import Path

from alchemist.pytensor_ext import pytensor_internals

_OPENBLAS_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")

_lock = threading.RLock()
_depth = 0
_exit: ExitStack | None = None
# (owner class, attribute) -> (PyTensor's own raw attribute, alchemist's), filled on the first activation
_patched: dict[tuple[type, str], tuple[object, object]] = {}


def _patch_points() -> list[tuple[type, str]]:
    from alchemist.pytensor_ext.fast_cycles import destroyhandler_module
    from alchemist.pytensor_ext.pytensor_internals import CLinker, COp, FunctionMaker, Supervisor

    return [
        (CLinker, "cthunk_factory"),
        (COp, "make_c_thunk"),
        (CLinker, "compile_cmodule"),
        (FunctionMaker, "prepare_fgraph"),
        (FunctionMaker, "create"),
        (Supervisor, "on_validate"),
        (destroyhandler_module(), "_contains_cycle"),
    ]


def _install_once() -> None:
    """Run each speed-up's installer once (in order), remembering PyTensor's attributes before and after."""
    from alchemist.pytensor_ext import compile_progress, fast_cycles, fast_link, fast_supervisor, parallel_build

    if _patched or not pytensor_internals.tested():
        return
    points = _patch_points()
    before = {(cls, name): cls.__dict__[name] for cls, name in points}  # raw: keeps a staticmethod a staticmethod
    fast_link.enable()
    parallel_build.install()
    compile_progress.install()  # after the two above: its wrappers go around theirs
    fast_supervisor.install()
    fast_cycles.install()
    for cls, name in points:
        _patched[cls, name] = (before[cls, name], cls.__dict__[name])
        setattr(cls, name, before[cls, name])  # applied only inside activated()


def _apply(which: int) -> None:
    for (cls, name), values in _patched.items():
        setattr(cls, name, values[which])


@contextmanager
def activated():
    """alchemist's PyTensor settings and compile speed-ups for the duration of the block (see the module doc)."""
    global _depth, _exit
    with _lock:
        if _depth == 0:
            import pytensor

            with ExitStack() as stack:  # closed right away if setting up fails half-way
                stack.enter_context(pytensor.config.change_flags(floatX="float32"))
                ldflags = system_blas_ldflags()
                if ldflags and not pytensor_internals.user_set_flag("blas__ldflags"):
                    stack.enter_context(pytensor_internals.flag_for_block("blas__ldflags", ldflags))
                march = pytensor_internals.GCC_compiler.march_flags
                stack.callback(setattr, pytensor_internals.GCC_compiler, "march_flags", march)
                restore_gcc_march_flags()
                stack.callback(_apply, 0)
                _install_once()
                _apply(1)
                _exit = stack.pop_all()
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                stack, _exit = _exit, None
                stack.close()


def active() -> bool:
    """Whether this thread is inside activated()."""
    return _depth > 0 and _lock._is_owned()  # noqa: SLF001 - RLock's own check for the owning thread


def activating(function):
    """`function` run inside activated() (a decorator for the entry points that build or compile graphs)."""
    import functools

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with activated():
            return function(*args, **kwargs)

    return wrapper


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
    alchemist itself (alchemist.pytensor_ext.host sets them around its own compiles): set PyTensor's flags before
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
    directory gets its own entry. activated() calls this on every entry and puts PyTensor's value back on exit,
    so the flags are looked up (or detected) once per process and only set again after that.
    """
    import pytensor

    from alchemist.pytensor_ext.pytensor_internals import GCC_compiler

    if GCC_compiler.march_flags is not None or not pytensor.config.cxx:
        return
    flags = _remembered_march_flags(pytensor.config.cxx, pytensor.config.gcc__cxxflags)
    if flags is not None:
        GCC_compiler.march_flags = list(flags)


@cache
def _remembered_march_flags(cxx: str, cxxflags: str) -> tuple[str, ...] | None:
    """The -march flags for this compiler and CPU: from alchemist's memo file, else detected by PyTensor and
    remembered there (None when the compiler or /proc/cpuinfo cannot be read, or detection gives nothing)."""
    import hashlib
    import json
    import shutil

    import pytensor

    from alchemist.paths import cache_subdir, remember
    from alchemist.pytensor_ext.pytensor_internals import GCC_compiler

    compiler = shutil.which(cxx) or cxx
    try:
        st = os.stat(compiler)
        cpu = [
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "model name"))
        ]
    except OSError:
        return None
    identity = [os.path.realpath(compiler), st.st_size, st.st_mtime_ns, sorted(set(cpu)), pytensor.__version__]
    identity.append(cxxflags)
    memo = cache_subdir("march") / (hashlib.sha256(json.dumps(identity).encode()).hexdigest() + ".json")
    try:
        flags = json.loads(memo.read_text())
        if isinstance(flags, list) and all(isinstance(f, str) and f and f.split() == [f] for f in flags):
            return tuple(flags)
    except (OSError, ValueError):
        pass
    GCC_compiler.compile_args()  # detects and sets GCC_compiler.march_flags
    if GCC_compiler.march_flags is None:
        return None
    remember(memo, json.dumps(GCC_compiler.march_flags))
    return tuple(GCC_compiler.march_flags)
