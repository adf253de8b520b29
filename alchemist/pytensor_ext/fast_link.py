"""Faster linking of C thunks for graphs that repeat the same ops many times (one per layer).

PyTensor's CVM linker builds one C thunk per node. For each it computes the node's module key (the
node's compile flags, its op, input/output types and constants, PyTensor's C config hash), then looks the
key up in the compiledir index and instantiates the module. A transformer step repeats each op once per
layer, so of gemma-3-270m's 1258 decode nodes only ~205 have distinct keys; computing the other ~1050
keys is ~0.7 ms each of pure Python, a quarter of linking a cached graph.

`enable()` remembers each compiled module under a signature made of exactly what that key is made of
for a single node: the op, each input's type (or, for a constant, its signature) and repeated-input
pattern, each output's type and no-recycling flag, and the C config hash. Two wrappers use it:

- `COp.make_c_thunk`, for a node whose inputs are distinct non-constant variables (1092 of gemma's
  1258): a seen signature instantiates the module directly on the node's storage, skipping the
  per-node FunctionGraph clone and CLinker set-up too (the C VM calls the instantiated struct; a
  failure in it is reported as this node's);
- `CLinker.cthunk_factory`, for any other single-node linker: a seen signature skips the key.

The first node of each signature still needs its module. PyTensor finds it through the compiledir index,
whose first use in a process unpickles every entry's key (~0.5 s, growing with every graph ever compiled).
`preferred_modules({node: path})` names the module file each node was linked with last time (the graph
cache records it): such a node imports that file directly and never opens the index.

Anything else takes PyTensor's own path. Set ALCHEMIST_FAST_LINK=0 to turn it off.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from contextlib import contextmanager

from alchemist.pytensor_ext import pytensor_internals

_enabled = False
_modules: dict = {}
_thunks: dict = {}
_preferred: dict = {}  # id(node) -> the module file it was linked with last time (while linking a cached graph)
_current_preferred: list = [None]  # that file for the node COp.make_c_thunk is handing to a CLinker
_imported: dict = {}
stats = {"reused": 0, "keyed": 0, "instantiated": 0, "preferred": 0}


@contextmanager
def preferred_modules(modules: dict):
    """While linking: each node in `modules` (node -> absolute path of a compiled module) is linked with that
    module when its signature has not been seen yet, instead of looking it up in the compiledir index."""
    _preferred.update({id(node): path for node, path in modules.items()})
    try:
        yield
    finally:
        _preferred.clear()


def _import_module(path: str):
    """Import a compiled module file under the name PyTensor's `dlimport` gives it (so a later dlimport of the
    same file finds it in sys.modules), without putting its directory on sys.path or rescanning the
    compiledir (`dlimport` invalidates the import caches each time, ~1 ms per module)."""
    module = _imported.get(path)
    if module is None:
        directory, filename = os.path.split(path)
        name = f"{os.path.basename(directory)}.{filename.split('.', 1)[0]}"
        module = sys.modules.get(name)
        if module is None:
            loader = importlib.machinery.ExtensionFileLoader(name, path)
            spec = importlib.util.spec_from_file_location(name, path, loader=loader)
            module = importlib.util.module_from_spec(spec)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="numpy.ndarray size changed")
                loader.exec_module(module)
            sys.modules[name] = module
        _imported[path] = module
    return module


def _preferred_module(path: str | None):
    """The module at `path` (None when there is none or it will not import: PyTensor's own path then)."""
    if path is None:
        return None
    try:
        module = _import_module(path)
    except Exception:  # noqa: BLE001 - a removed or damaged compiledir entry: look it up the usual way
        return None
    stats["preferred"] += 1
    return module


def _node_signature(node, no_recycling):
    """(signature, params argument) of a node whose inputs are distinct non-constant variables, else None.

    The params argument mirrors `CLinker.fetch_variables`: an op's `get_params(node)` becomes a hidden
    Constant input, passed to `instantiate` unless its type has a C literal for it."""
    from pytensor import config
    from pytensor.graph.basic import Constant
    from pytensor.graph.utils import MethodNotDefined
    from pytensor.link.c.type import CLinkerType

    inputs = node.inputs
    if any(isinstance(v, Constant) for v in inputs) or len(set(inputs)) != len(inputs):
        return None
    try:
        params = node.op.get_params(node)
    except MethodNotDefined:
        params = None
        extra: list = []
    else:
        var = Constant(node.params_type, params)
        literal = isinstance(var.type, CLinkerType) and var.type.c_literal(var.data)
        extra = [] if literal else [[var.data]]
        hash(params)  # part of the signature below (a TypeError takes PyTensor's own path)
    outputs = tuple((out.type, out in no_recycling) for out in node.outputs)
    return (node.op, tuple(v.type for v in inputs), outputs, params, config.get_config_hash()), extra


def _signature(linker):
    """The signature of a single-node CLinker (constants by their signature), else None."""
    from pytensor import config
    from pytensor.graph.basic import Constant

    nodes = linker.node_order
    if len(nodes) != 1 or not all(isinstance(o, Constant) for o in linker.orphans):
        return None
    (node,) = nodes
    inputs = []
    for var in node.inputs:
        if isinstance(var, Constant):
            sig = var.signature()
            hash(sig)  # an unhashable constant (TypeError) takes PyTensor's own path
            inputs.append(("constant", sig))
        else:
            inputs.append(("input", var.type, node.inputs.index(var)))
    outputs = tuple((out.type, out in linker.no_recycling) for out in node.outputs)
    return (node.op, tuple(inputs), outputs, config.get_config_hash())


def enable() -> None:
    """Install the wrapper once per process (a no-op when ALCHEMIST_FAST_LINK=0, or under a PyTensor other than
    the one its internals were tested with: alchemist.pytensor_ext.pytensor_internals)."""
    global _enabled
    if _enabled or os.environ.get("ALCHEMIST_FAST_LINK", "1") in ("0", "false", "no", "off"):
        return
    if not pytensor_internals.tested():
        return
    from pytensor.graph.basic import Constant

    from alchemist.pytensor_ext.pytensor_internals import CLinker

    original = CLinker.cthunk_factory

    @functools.wraps(original)
    def cthunk_factory(self, error_storage, in_storage, out_storage, storage_map=None, cache=None):
        try:
            sig = _signature(self)
        except Exception:  # noqa: BLE001 - an unusual node: PyTensor's own path handles it
            sig = None
        module = _modules.get(sig) if sig is not None else None
        if module is None and sig is not None:
            module = _preferred_module(_current_preferred[0])
            if module is not None:
                _modules[sig] = module
        if module is None:
            thunk, module = original(self, error_storage, in_storage, out_storage, storage_map, cache)
            if sig is not None:
                _modules[sig] = module
            stats["keyed"] += 1
            return thunk, module
        stats["reused"] += 1
        # the rest of CLinker.cthunk_factory, unchanged: prepare the node, drop duplicate storages, instantiate
        for node in self.node_order:
            node.op.prepare_node(node, storage_map, None, "c")
        variables = self.inputs + self.outputs + self.orphans
        dupidx = [i for i, x in enumerate(variables) if variables.count(x) > 1 and variables.index(x) != i]
        out_storage = [x for i, x in enumerate(out_storage) if (i + len(in_storage)) not in dupidx]
        in_storage = [x for i, x in enumerate(in_storage) if i not in dupidx]
        if storage_map is None:
            orphd = [[orphan.data] if isinstance(orphan, Constant) else [] for orphan in self.orphans]
        else:
            orphd = [storage_map[orphan] for orphan in self.orphans]
        return module.instantiate(error_storage, *(in_storage + out_storage + orphd)), module

    CLinker.cthunk_factory = cthunk_factory
    _wrap_make_c_thunk()
    _enabled = True


def _wrap_make_c_thunk() -> None:
    from alchemist.pytensor_ext.pytensor_internals import COp, CThunk

    class _NodeThunk(CThunk):
        """A one-node C thunk: whatever part of the struct fails (extracting an input, the op's code), the
        failing task is this node (PyTensor would build the node's CLinker task lists just to say so)."""

        def find_task(self, failure_code):
            return self.nodes[0], "code", failure_code

    original = COp.make_c_thunk

    @functools.wraps(original)
    def make_c_thunk(self, node, storage_map, compute_map, no_recycling):
        try:
            sig, params_storage = _node_signature(node, no_recycling) or (None, None)
        except Exception:  # noqa: BLE001 - an unusual node: PyTensor's own path handles it
            sig = None
        preferred = _preferred.get(id(node))
        module = _thunks.get(sig) if sig is not None else None
        if module is None and sig is not None:
            module = _preferred_module(preferred)
            if module is not None:
                _thunks[sig] = module
        if module is None:
            _current_preferred[0] = preferred
            try:
                rval = original(self, node, storage_map, compute_map, no_recycling)
            finally:
                _current_preferred[0] = None
            if sig is not None:
                _thunks[sig] = rval.thunk.module
            return rval
        stats["instantiated"] += 1
        # what CLinker.__compile__ + cthunk_factory do for one node with distinct, non-constant inputs
        # (no duplicate storages; the only orphan is the params constant): instantiate the module on the
        # node's own storage cells
        node_input_storage = [storage_map[r] for r in node.inputs]
        node_output_storage = [storage_map[r] for r in node.outputs]
        node.op.prepare_node(node, storage_map, None, "c")
        error_storage = [None, None, None]
        cthunk = module.instantiate(error_storage, *(node_input_storage + node_output_storage + params_storage))
        thunk = _NodeThunk(cthunk, [], [], error_storage, module)
        thunk.nodes = [node]
        if compute_map is None:
            rval = thunk
        else:
            cm_entries = [compute_map[o] for o in node.outputs]

            def rval(thunk=thunk, cm_entries=cm_entries):
                thunk()
                for entry in cm_entries:
                    entry[0] = True

        rval.thunk = thunk
        rval.cthunk = thunk.cthunk
        rval.inputs = node_input_storage
        rval.outputs = node_output_storage
        rval.lazy = False
        return rval

    COp.make_c_thunk = make_c_thunk
