"""Build a step function's missing C modules with several g++ processes at once, before PyTensor links them.

PyTensor links a graph one node at a time and builds each missing C module when it reaches it, holding its
compiledir lock: one g++ at a time (~1-1.7 s each, mostly parsing the Python and NumPy headers, so each g++
uses one core). On a cold compiledir that serial g++ queue was most of gemma-3-270m's cold start (58 modules
for decode, 32 for a prefill bucket).

`prebuild(fgraph)`, called once a graph is rewritten, generates each distinct C node's source (as
COp.make_c_thunk would: a CLinker over that one node), skips those already in the compiledir, and starts g++
for the rest on a pool of `jobs` threads (g++ runs outside the GIL), into private directories beside the
compiledir. The caller may rewrite another graph meanwhile. Linking then goes on as usual; when PyTensor would run g++ for
a source that was prebuilt, CLinker.compile_cmodule instead waits for that build and moves its files into the
directory PyTensor chose, so PyTensor's own cache bookkeeping (key.pkl, its index) is unchanged. A source that
was not prebuilt, or whose build failed, is compiled by PyTensor as before (and reports its own error).

ALCHEMIST_COMPILE_JOBS sets `jobs` (default: the number of CPUs; 1 turns the prebuild off).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from alchemist.pytensor_ext import pytensor_internals

_prebuilt: dict[str, Future] = {}  # sha256 of a module's source -> future of (directory, .so file name)
_prebuilt_lock = threading.Lock()
_installed = False
stats = {"prebuilt": 0, "used": 0, "skipped_cached": 0}


def default_jobs() -> int:
    value = os.environ.get("ALCHEMIST_COMPILE_JOBS")
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            pass
    return max(1, os.cpu_count() or 1)


def discard_unused(digests: list) -> None:
    """Remove the prebuilds of `digests` PyTensor did not ask for (it found the module some other way: another
    process built it meanwhile), once they are finished."""
    for digest in digests:
        with _prebuilt_lock:
            future = _prebuilt.pop(digest, None)
        if future is None:
            continue
        try:
            built_dir, _ = future.result()
        except Exception:  # noqa: BLE001 - nothing was left behind
            continue
        shutil.rmtree(built_dir, ignore_errors=True)


def _digest(src_code: str) -> str:
    return hashlib.sha256(src_code.encode()).hexdigest()


def prebuild(fgraph, jobs: int | None = None) -> list[str]:
    """Start g++ in the background for every distinct C node of the rewritten `fgraph` whose module the compiledir
    lacks, in toposort order (the order linking needs them); returns their digests (for discard_unused)."""
    jobs = default_jobs() if jobs is None else int(jobs)
    if jobs <= 1 or not _installed:  # installed by alchemist.pytensor_ext.host.activated() (not under another PyTensor)
        return []
    from pytensor import config
    from pytensor.graph.fg import FunctionGraph

    from alchemist.pytensor_ext.pytensor_internals import CLinker, COp, get_module_cache, get_module_hash

    if not config.cxx:
        return []
    cache = get_module_cache()
    root = os.path.join(os.path.dirname(os.path.realpath(config.compiledir)), "alchemist-prebuild")
    os.makedirs(root, exist_ok=True)
    seen: set = set()
    work = []
    for node in fgraph.toposort():
        if not isinstance(node.op, COp):
            continue
        try:
            sig = (node.op, tuple(v.type for v in node.inputs), tuple(v.type for v in node.outputs))
            if sig in seen:
                continue
            seen.add(sig)
            node.op.prepare_node(node, storage_map=None, compute_map=None, impl="c")
            linker = CLinker().accept(FunctionGraph(node.inputs, node.outputs))
            key = linker.cmodule_key()
            if key in cache.entry_from_key:
                stats["skipped_cached"] += 1
                continue
            mod = linker.get_dynamic_module()
            src_code = mod.code()
            if get_module_hash(src_code, key) in cache.module_hash_to_key_data:
                stats["skipped_cached"] += 1
                continue
            args = dict(
                module_name=mod.code_hash,
                src_code=src_code,
                include_dirs=linker.header_dirs(),
                lib_dirs=linker.lib_dirs(),
                libs=linker.libraries(),
                preargs=linker.compile_args(),
            )
            work.append((_digest(src_code), linker.c_compiler(), args))
        except Exception:  # noqa: BLE001 - no C code, or an unusual node: PyTensor's own path handles it
            continue
    if not work:
        return []
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="alchemist-g++")
    started = []
    with _prebuilt_lock:
        for digest, compiler, args in work:
            if digest not in _prebuilt:
                _prebuilt[digest] = pool.submit(_build, root, compiler, args)
                started.append(digest)
    pool.shutdown(wait=False)  # its threads end when their builds do
    stats["prebuilt"] += len(started)
    return started


def _build(root: str, compiler, args: dict) -> tuple[str, str]:
    from alchemist.pytensor_ext.pytensor_internals import get_lib_extension

    location = tempfile.mkdtemp(dir=root)
    try:
        compiler.compile_str(location=location, py_module=False, **args)
    except BaseException:
        shutil.rmtree(location, ignore_errors=True)
        raise
    return location, f"{args['module_name']}.{get_lib_extension()}"


def _take_prebuilt(linker, location: str):
    """The module PyTensor is about to compile, moved in from its finished prebuild, else None."""
    from alchemist.pytensor_ext.pytensor_internals import dlimport

    if not _prebuilt:
        return None
    src_code = linker.get_dynamic_module().code()
    with _prebuilt_lock:
        future = _prebuilt.pop(_digest(src_code), None)
    if future is None:
        return None
    try:
        built_dir, so_name = future.result()
    except Exception:  # noqa: BLE001 - PyTensor compiles it again and reports the error itself
        return None
    try:
        for name in (so_name, "mod.cpp"):
            os.replace(os.path.join(built_dir, name), os.path.join(location, name))
    except OSError:
        return None
    finally:
        shutil.rmtree(built_dir, ignore_errors=True)
    stats["used"] += 1
    return dlimport(os.path.join(location, so_name))


def install() -> bool:
    """Make CLinker.compile_cmodule take a prebuilt module when there is one (once per process). False, and
    nothing installed, under a PyTensor other than the one its internals were tested with."""
    global _installed
    if _installed:
        return True
    if not pytensor_internals.tested():
        return False
    from alchemist.pytensor_ext.pytensor_internals import CLinker

    compile_cmodule = CLinker.compile_cmodule

    @functools.wraps(compile_cmodule)
    def compile_cmodule_wrapper(self, location=None):
        if location is not None:
            module = _take_prebuilt(self, location)
            if module is not None:
                return module
        return compile_cmodule(self, location)

    CLinker.compile_cmodule = compile_cmodule_wrapper
    _installed = True
    return True
