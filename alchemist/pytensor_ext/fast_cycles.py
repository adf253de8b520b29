"""PyTensor's in-place cycle check with the same answers, over apply nodes only.

Every in-place candidate an in-place rewrite tries is validated by the DestroyHandler, which asks
`destroyhandler._contains_cycle(fgraph, orderings)` whether the graph plus the orderings that protect destroyed
inputs still has a topological order. PyTensor's version walks every variable and every apply node (Kahn's
algorithm over both); on the 22-layer Gemma 3n fixture's graphs (3,000 nodes) each call took 36 ms and the
2,000-odd calls of one compile 80 s, most of that compile.

`contains_cycle` runs the same algorithm over the apply nodes alone: node a waits for the owner of each of its
inputs (a variable is visited right after its owner, so waiting for the variable is waiting for its owner) and for
each of its orderings, counted with multiplicity as PyTensor counts them (a FunctionGraph's inputs have no owner).
An ordering on an apply node outside the graph never becomes visitable there, so PyTensor reports a cycle; here
such a parent is never visited either. Same question, same answer (tests/test_pytensor_internals.py compares both
on graphs with and without cycles); `install()` makes it the one DestroyHandler.validate calls, inside alchemist's
activated() only (alchemist.pytensor_ext.host installs it once, under the tested PyTensor series).
"""

from __future__ import annotations

from alchemist.pytensor_ext import pytensor_internals


def contains_cycle(fgraph, orderings) -> bool:
    """Whether fgraph's apply nodes, with `orderings` (apply -> the applies that must run before it), have no
    topological order."""
    nodes = fgraph.apply_nodes
    waiting: dict = {}
    children: dict = {}
    ready = []
    for node in nodes:
        parents = [v.owner for v in node.inputs if v.owner is not None]
        extra = orderings.get(node)
        if extra:
            parents.extend(extra)
        waiting[node] = len(parents)
        if not parents:
            ready.append(node)
        for parent in parents:
            if parent in children:
                children[parent].append(node)
            else:
                children[parent] = [node]
    visited = 0
    while ready:
        node = ready.pop()
        visited += 1
        for child in children.get(node, ()):
            left = waiting[child] - 1
            waiting[child] = left
            if not left:
                ready.append(child)
    return visited != len(waiting)


def destroyhandler_module():
    """The module whose global `_contains_cycle` DestroyHandler.validate calls."""
    import sys

    return sys.modules[pytensor_internals.DestroyHandler.__module__]


def install() -> None:
    """Make destroyhandler._contains_cycle this one (host._install_once records PyTensor's and swaps them)."""
    contains_cycle.pytensor_contains_cycle = pytensor_internals.contains_cycle
    destroyhandler_module()._contains_cycle = contains_cycle
