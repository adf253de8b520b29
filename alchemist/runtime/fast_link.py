"""Faster linking of C thunks for graphs that repeat the same ops many times (one per layer).

PyTensor's CVM linker builds one C thunk per node. For each it computes the node's module key (the
node's compile flags, its op, input/output types and constants, PyTensor's C config hash), then looks the
key up in the compiledir index and instantiates the module. A transformer step repeats each op once per
layer, so of gemma-3-270m's 1258 decode nodes only ~205 have distinct keys; computing the other ~1050
keys is ~0.7 ms each of pure Python, a quarter of linking a cached graph.

`enable()` wraps `CLinker.cthunk_factory`: for a single-node linker (what the CVM builds) it remembers
the compiled module under a signature made of exactly what that key is made of for a single node: the
op, each input's type (or, for a constant, its signature) and repeated-input pattern, each output's type
and no-recycling flag, and the C config hash. A node whose signature was seen reuses the module and
only instantiates it; anything else takes PyTensor's own path. Set ALCHEMIST_FAST_LINK=0 to turn it off.
"""

from __future__ import annotations

import os

_enabled = False
_modules: dict = {}
stats = {"reused": 0, "keyed": 0}


def _signature(linker):
    from pytensor import config
    from pytensor.graph.basic import Constant

    nodes = linker.node_order
    if len(nodes) != 1 or linker.orphans and not all(isinstance(o, Constant) for o in linker.orphans):
        return None
    (node,) = nodes
    inputs = []
    for var in node.inputs:
        if isinstance(var, Constant):
            sig = var.signature()
            try:
                hash(sig)
            except TypeError:
                return None
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
    _enabled = True
