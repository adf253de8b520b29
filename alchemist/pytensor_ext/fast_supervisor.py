"""The same protected-variable check PyTensor's Supervisor makes after every graph rewrite, in far less time.

PyTensor validates the graph after each replacement a rewrite makes. Its Supervisor (which keeps in-place ops
from overwriting a function's inputs and outputs) asks the DestroyHandler `fgraph.destroyers(r)` once for every
protected variable: every weight of a model is a protected input, and each call goes through FunctionGraph's
feature lookup and usually raises and catches a KeyError. On the 22-layer Gemma 3n fixture's graphs (3,000
nodes, 800 weights) that was a third of all rewriting time.

`install()` replaces Supervisor.on_validate with a check that reads the DestroyHandler's maps once and looks
each protected variable up in them (nothing to do while nothing is destroyed): the same variables are refused
for the same reason, so the rewritten graph is the same (tests/test_pytensor_internals.py compares both on a
graph where the check refuses). Any other case (PyTensor's "fast" cycle detection, a destroyers feature that
is not a DestroyHandler) goes to PyTensor's own method. Only under the PyTensor series the internals were
tested with (alchemist.pytensor_ext.pytensor_internals).
"""

from __future__ import annotations

import functools
import itertools

from alchemist.pytensor_ext import pytensor_internals

_installed = False


def install() -> bool:
    """Make Supervisor.on_validate the faster equivalent (once per process); False under an untested PyTensor."""
    global _installed
    if _installed:
        return True
    if not pytensor_internals.tested():
        return False
    from pytensor import config

    Supervisor = pytensor_internals.Supervisor
    DestroyHandler = pytensor_internals.DestroyHandler
    InconsistencyError = pytensor_internals.InconsistencyError
    pytensor_on_validate = Supervisor.on_validate

    @functools.wraps(pytensor_on_validate)
    def on_validate(self, fgraph):
        handler = fgraph._feature_methods.get("destroyers")
        if config.cycle_detection == "fast" or not isinstance(handler, DestroyHandler):
            return pytensor_on_validate(self, fgraph)
        droot, _, root_destroyer = handler.refresh_droot_impact()
        if not root_destroyer:
            return None
        for r in itertools.chain(self.protected, fgraph.outputs):
            root = droot.get(r)
            if root is not None and root in root_destroyer:
                raise InconsistencyError(f"Trying to destroy a protected variable: {r}")
        return None

    on_validate.pytensor_on_validate = pytensor_on_validate
    Supervisor.on_validate = on_validate
    _installed = True
    return True
