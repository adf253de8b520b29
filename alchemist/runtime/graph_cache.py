"""A disk cache of rewritten step graphs, so that a second process links instead of recompiling.

PyTensor caches compiled C modules (its compiledir) but not the rewritten graph, and rewriting is most of
a compile: for gemma-3-270m's decode step 51.6 s of 55.5 s is rewrites, 3.5 s is linking. After a
compile we store the graph as the rewriter left it, with every shared variable (weights, KV cache)
replaced by a plain variable of the same type, so the file holds the graph and none of the data (a few
MB). Loading it builds the FunctionMaker the way `Function.copy` does (`no_fgraph_prep=True`: no rewrites,
the DeepCopy ops are already in the graph) and points each input at this process's shared container.

Beside each entry, `<key>.modules.json` records which compiled module (a file in PyTensor's compiledir, with
its size and mtime) linked each node; `alchemist.pytensor_ext.fast_link` imports those files directly, so a new
process never opens PyTensor's compiledir index. The record is only a hint: a row whose file changed is
looked up the usual way and the record rewritten.

The key hashes everything the rewritten graph depends on: the generated module's source, alchemist's own
source files (the kernel Ops and their rewrites), the backend, the step shape, every weight's name, shape
and dtype, and the PyTensor/NumPy versions and flags. Entries are pickles written by this tool into the
user's own cache directory (the same trust as PyTensor's compiledir, whose shared objects it imports);
nothing from a GGUF file is ever unpickled except as data inside our own graph.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import stat
import sys
import warnings
from functools import lru_cache
from pathlib import Path

from alchemist.paths import cache_subdir, remember
from alchemist.pytensor_ext import fast_link

FORMAT_VERSION = 2
# A rewritten graph is a few MB; a file much larger than this would mean data leaked into it (a weight
# folded into a constant), which must not be written to disk.
MAX_ENTRY_BYTES = 256 * 1024 * 1024


def enabled() -> bool:
    return os.environ.get("ALCHEMIST_GRAPH_CACHE", "1") not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    return cache_subdir("graphs")


# alchemist's own files a step graph depends on besides the generated module: the kernel Ops with their
# rewrites, the engines that build the steps, and the backend modes.
_GRAPH_SOURCES = (
    "kernels",
    "runtime/engine.py",
    "runtime/slot_engine.py",
    "runtime/backends.py",
    "runtime/rewrites.py",
    "runtime/graph_cache.py",
    "runtime/numerics.py",  # the "ggml" primitives' roundings
)


@lru_cache(maxsize=1)
def _alchemist_source_digest() -> str:
    """sha256 over the files of _GRAPH_SOURCES (Python, and the kernels' C/C++ in kernels/csrc): any change to an Op,
    its C code, a rewrite or the engine invalidates entries."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in _GRAPH_SOURCES:
        target = root / name
        files = [p for p in target.rglob("*") if p.suffix in (".py", ".c", ".cpp", ".h")] if target.is_dir() else [target]
        for path in sorted(files):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def step_key(module_sha256: str, backend: str, mode, shared: dict, spec: dict) -> str:
    """The cache key of one step function: a sha256 over everything its rewritten graph depends on."""
    import numpy
    import pytensor

    cfg = pytensor.config
    facts = {
        "format": FORMAT_VERSION,
        "alchemist": _alchemist_source_digest(),
        "module": module_sha256,
        "backend": backend,
        "mode": _describe_mode(mode),
        "pytensor": pytensor.__version__,
        "numpy": numpy.__version__,
        "python": sys.version_info[:2],
        "flags": [cfg.floatX, cfg.blas__ldflags, cfg.cxx, cfg.gcc__cxxflags],
        "shared": sorted((name, str(sv.type)) for name, sv in shared.items()),
        "spec": spec,
    }
    if backend == "numba":  # whether Numba calls the ops library or got their formulas (kernels.numba_ops)
        from alchemist.kernels.native import ops_kernels

        facts["numba_ops_library"] = ops_kernels() is not None
    if backend == "jax":  # whether JAX calls the ggml kernels or got their formulas (kernels.jax_ffi)
        from alchemist.kernels import jax_ffi

        facts["jax_ffi"] = jax_ffi.available()
    if backend == "mlx":  # whether MLX calls the ggml kernels or got their formulas (kernels.mlx_host)
        from alchemist.kernels import mlx_host

        facts["mlx_kernels"] = mlx_host.available()
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def _describe_mode(mode) -> list:
    """The linker and rewrite query of a Mode, without object addresses (a repr would change per process)."""
    query = mode.provided_optimizer
    if hasattr(query, "include"):
        query = {part: sorted(map(str, getattr(query, part))) for part in ("include", "require", "exclude")}
    return [type(mode.linker).__name__, str(mode.linker), query]


def _path(key: str) -> Path:
    return cache_dir() / f"{key}.pkl"


def _modules_path(key: str) -> Path:
    return cache_dir() / f"{key}.modules.json"


def _record_modules(key: str, fn, nodes: list) -> None:
    """Remember which compiled module linked each node of `fn` (`nodes`: the entry's node list, in `fn`'s
    order or cloned), so the next process imports it directly: [node index, module file relative to the
    compiledir, its size, its mtime_ns]."""
    from pytensor import config

    root = os.path.realpath(config.compiledir)
    position = {id(node): i for i, node in enumerate(nodes)}
    row_of: dict = {}  # module file -> [relative path, size, mtime_ns], or None outside the compiledir
    found = []
    for node, thunk in zip(getattr(fn.vm, "nodes", ()), getattr(fn.vm, "thunks", ()), strict=True):
        file = getattr(getattr(getattr(thunk, "thunk", None), "module", None), "__file__", None)
        index = position.get(id(node))
        if file is None or index is None:
            continue
        if file not in row_of:
            real = os.path.realpath(file)
            try:
                st = os.stat(real)
            except OSError:  # removed meanwhile: that node is looked up the usual way next time
                st = None
            inside = os.path.dirname(os.path.dirname(real)) == root  # not PyTensor's own helper modules
            row_of[file] = (
                ["/".join(os.path.relpath(real, root).split(os.sep)), st.st_size, st.st_mtime_ns]
                if inside and st is not None
                else None
            )
        if row_of[file] is not None:
            found.append([index, *row_of[file]])
    if found:
        remember(_modules_path(key), json.dumps({"format": FORMAT_VERSION, "modules": found}))


def _preferred_modules(key: str, nodes: list) -> tuple[dict, int]:
    """({node: module file} recorded for this entry that still exist unchanged, number recorded).

    The record is a hint: a path outside the compiledir, a missing file or one whose size or mtime differs
    (the compiledir was cleaned and rebuilt) is skipped, and PyTensor looks that node's module up itself."""
    from pytensor import config

    try:
        record = json.loads(_modules_path(key).read_text())
        rows = record["modules"] if record.get("format") == FORMAT_VERSION else []
    except (OSError, ValueError, TypeError, KeyError):
        return {}, 0
    root = os.path.realpath(config.compiledir)
    file_of: dict = {}  # (entry directory/module file, size, mtime_ns) -> its path, or None if it changed
    preferred = {}
    for row in rows:
        try:
            index, rel, size, mtime_ns = row
            if (rel, size, mtime_ns) not in file_of:
                file_of[rel, size, mtime_ns] = _compiledir_file(root, rel, size, mtime_ns)
            file = file_of[rel, size, mtime_ns]
            if file is not None and 0 <= index < len(nodes):
                preferred[nodes[index]] = file
        except (ValueError, TypeError):
            continue
    return preferred, len(rows)


def _compiledir_file(root: str, rel: str, size: int, mtime_ns: int) -> str | None:
    """root/rel when rel names a module file inside a compiledir entry ("tmpXXXX/mHASH.so") and that file
    is still the one recorded (same size and mtime), else None."""
    parts = rel.split("/")
    if len(parts) != 2 or any(part in ("", ".", "..") or os.sep in part for part in parts):
        return None
    file = os.path.join(root, *parts)
    try:
        st = os.lstat(file)
    except OSError:
        return None
    return file if stat.S_ISREG(st.st_mode) and (st.st_size, st.st_mtime_ns) == (size, mtime_ns) else None


def save(key: str, fn) -> Path | None:
    """Store `fn`'s rewritten graph under `key`, with its shared variables replaced by placeholders."""
    from pytensor.graph.basic import clone_get_equiv
    from pytensor.compile.io import SymbolicOutput

    maker = fn.maker
    fgraph = maker.fgraph
    memo: dict = {}
    shared_names = []
    for spec, var in zip(maker.inputs, fgraph.inputs, strict=True):
        if getattr(spec, "shared", False):
            memo[var] = var.type(name=var.name)
            shared_names.append(spec.variable.name)
        else:
            shared_names.append(None)
    memo = clone_get_equiv(fgraph.inputs, fgraph.outputs, memo=memo)
    outputs = [memo[o] for o in fgraph.outputs]
    specs = []
    for spec, var in zip(maker.inputs, fgraph.inputs, strict=True):
        spec = copy.copy(spec)
        spec.variable = memo[var]
        spec.value = None
        spec.update = None
        specs.append(spec)
    for out_idx, in_idx in fgraph.update_mapping.items():
        specs[in_idx].update = outputs[out_idx]
    borrow = [o.borrow for o in maker.outputs] + [False] * (len(outputs) - len(maker.outputs))
    linked_nodes = getattr(fn.vm, "nodes", None) or []
    entry = {
        "nodes": [memo[node] for node in linked_nodes],
        "inputs": [memo[i] for i in fgraph.inputs],
        "outputs": outputs,
        "specs": specs,
        "shared_names": shared_names,
        "update_mapping": dict(fgraph.update_mapping),
        "out_specs": [SymbolicOutput(o, borrow=b) for o, b in zip(outputs, borrow, strict=True)],
        "unpack_single": maker.unpack_single,
        "return_none": maker.return_none,
    }
    with _deep_recursion():
        data = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_ENTRY_BYTES:
        warnings.warn(f"graph cache: rewritten graph is {len(data) / 2**20:.0f} MB, not cached", stacklevel=2)
        return None
    try:
        target = _path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # the cache directory cannot be created: compile every time, say so
        warnings.warn(f"graph cache: cannot use {exc.filename} ({exc.strerror}); not cached", stacklevel=2)
        return None
    if not remember(target, data):
        return None
    _record_modules(key, fn, linked_nodes)  # the entry's nodes are these, cloned, in the same order
    return target


def load(key: str, shared: dict, mode):
    """The compiled function stored under `key`, linked to `shared` (name -> SharedVariable), or None.

    A missing entry is a miss; an unreadable or mismatching one is a miss with a warning (it is then
    overwritten by the recompiled function).
    """
    from pytensor.graph.fg import FunctionGraph

    from alchemist.pytensor_ext.pytensor_internals import FunctionMaker

    try:
        path = _path(key)
    except OSError:
        return None  # save() reports it
    if not path.exists():
        return None
    try:
        with _deep_recursion():
            entry = pickle.loads(path.read_bytes())
        specs = entry["specs"]
        for spec, name in zip(specs, entry["shared_names"], strict=True):
            if name is None:
                continue
            sv = shared[name]
            if sv.type != spec.variable.type:
                raise ValueError(f"{name} is {sv.type}, the cached graph expects {spec.variable.type}")
            spec.value = sv.container
        fgraph = FunctionGraph(entry["inputs"], entry["outputs"], clone=False, update_mapping=entry["update_mapping"])
        maker = FunctionMaker(
            specs,
            entry["out_specs"],
            mode=mode,
            fgraph=fgraph,
            accept_inplace=True,
            no_fgraph_prep=True,
            on_unused_input="ignore",
        )
        maker.unpack_single = entry["unpack_single"]
        maker.return_none = entry["return_none"]
        nodes = entry["nodes"]
        preferred, recorded = _preferred_modules(key, nodes)
        with fast_link.preferred_modules(preferred):
            fn = maker.create([spec.value for spec in specs])
        if len(preferred) != recorded or not recorded:
            _record_modules(key, fn, nodes)  # first load, or the compiledir changed: record what linked now
        return fn
    except Exception as exc:  # a stale or damaged entry must never stop a model from loading
        warnings.warn(f"graph cache: {path} unusable ({type(exc).__name__}: {exc}); recompiling", stacklevel=2)
        return None


class _deep_recursion:
    """Pickling a graph recurses through every variable's owner: allow deep graphs (many layers)."""

    def __enter__(self):
        self.old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(self.old, 200_000))

    def __exit__(self, *exc):
        sys.setrecursionlimit(self.old)
