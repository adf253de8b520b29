"""What alchemist changes in PyTensor while it builds and compiles its graphs, and only then.

Importing alchemist changes nothing in the process: no PyTensor flag, class or `sys.modules` entry. alchemist's
own graph building and compiling run inside `activated()`, which, in this fixed order:

1. sets two PyTensor flags: `floatX=float32` (a Python float in a graph is float32, not float64) and
   `blas__ldflags` pointing at the system OpenBLAS (pip-installed PyTensor finds none) unless the user set one
   (pytensor_internals.flag_for_block: a flag never read stays unread, so PyTensor's own BLAS probe never runs
   for alchemist);
2. gives PyTensor's compiler its remembered `-march` flags (backends.restore_gcc_march_flags: 0.3 s of g++ per
   process otherwise);
3. installs the compile speed-ups over PyTensor's internals (alchemist.runtime.pytensor_internals lists every
   private symbol; each is tested against the pinned PyTensor series), in the order they wrap one another:
   fast_link (CLinker.cthunk_factory, COp.make_c_thunk), parallel_build (CLinker.compile_cmodule),
   compile_progress (FunctionMaker.prepare_fgraph / create, around the two before), fast_supervisor
   (Supervisor.on_validate).

On leaving the outermost block every patched attribute gets its original back and the flags their values, so a
PyMC model compiled next to an alchemist model compiles as if alchemist were absent. The block is re-entrant and
held by one thread at a time (PyTensor's flags and classes are process-wide: two threads compiling at once would
see each other's settings), so a user's compile in another thread waits for alchemist's to finish.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager

from alchemist.runtime import pytensor_internals

_lock = threading.RLock()
_depth = 0
_exit: ExitStack | None = None
# (owner class, attribute) -> (PyTensor's own raw attribute, alchemist's), filled on the first activation
_patched: dict[tuple[type, str], tuple[object, object]] = {}


def _patch_points() -> list[tuple[type, str]]:
    from alchemist.runtime.pytensor_internals import CLinker, COp, FunctionMaker, Supervisor

    return [
        (CLinker, "cthunk_factory"),
        (COp, "make_c_thunk"),
        (CLinker, "compile_cmodule"),
        (FunctionMaker, "prepare_fgraph"),
        (FunctionMaker, "create"),
        (Supervisor, "on_validate"),
    ]


def _install_once() -> None:
    """Run each speed-up's installer once (in order), remembering PyTensor's attributes before and after."""
    from alchemist.runtime import compile_progress, fast_link, fast_supervisor, parallel_build

    if _patched or not pytensor_internals.tested():
        return
    points = _patch_points()
    before = {(cls, name): cls.__dict__[name] for cls, name in points}  # raw: keeps a staticmethod a staticmethod
    fast_link.enable()
    parallel_build.install()
    compile_progress.install()  # after the two above: its wrappers go around theirs
    fast_supervisor.install()
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

            from alchemist.runtime.backends import restore_gcc_march_flags, system_blas_ldflags

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
