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
  per-node FunctionGraph clone and CLinker set-up too (the C VM calls the instantiated struct; the
  thunk's task lists, used only to name a failing task, come from the first node of that signature);
- `CLinker.cthunk_factory`, for any other single-node linker: a seen signature skips the key.

Anything else takes PyTensor's own path. Set ALCHEMIST_FAST_LINK=0 to turn it off.
"""

from __future__ import annotations

import os

_enabled = False
_modules: dict = {}
_thunks: dict = {}
stats = {"reused": 0, "keyed": 0, "instantiated": 0}


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
    """Install the wrapper once per process (a no-op when ALCHEMIST_FAST_LINK=0)."""
    global _enabled
    if _enabled or os.environ.get("ALCHEMIST_FAST_LINK", "1") in ("0", "false", "no", "off"):
        return
    from pytensor.graph.basic import Constant
    from pytensor.link.c.basic import CLinker

    original = CLinker.cthunk_factory

    def cthunk_factory(self, error_storage, in_storage, out_storage, storage_map=None, cache=None):
        try:
            sig = _signature(self)
        except Exception:  # noqa: BLE001 - an unusual node: PyTensor's own path handles it
            sig = None
        module = _modules.get(sig) if sig is not None else None
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
    from pytensor.link.c.basic import _CThunk
    from pytensor.link.c.op import COp

    original = COp.make_c_thunk

    def make_c_thunk(self, node, storage_map, compute_map, no_recycling):
        try:
            sig, params_storage = _node_signature(node, no_recycling) or (None, None)
        except Exception:  # noqa: BLE001 - an unusual node: PyTensor's own path handles it
            sig = None
        known = _thunks.get(sig) if sig is not None else None
        if known is None:
            rval = original(self, node, storage_map, compute_map, no_recycling)
            if sig is not None:
                _thunks[sig] = (rval.thunk.module, rval.thunk.init_tasks, rval.thunk.tasks)
            return rval
        module, init_tasks, tasks = known
        stats["instantiated"] += 1
        # what CLinker.__compile__ + cthunk_factory do for one node with distinct, non-constant inputs
        # (no duplicate storages; the only orphan is the params constant): instantiate the module on the
        # node's own storage cells
        node_input_storage = [storage_map[r] for r in node.inputs]
        node_output_storage = [storage_map[r] for r in node.outputs]
        node.op.prepare_node(node, storage_map, None, "c")
        error_storage = [None, None, None]
        cthunk = module.instantiate(error_storage, *(node_input_storage + node_output_storage + params_storage))
        thunk = _CThunk(cthunk, init_tasks, tasks, error_storage, module)
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
