"""Graph rewrites alchemist adds to PyTensor's C and Numba modes.

`reuse_partial_sums`: PyTensor's add canonicalizer flattens nested additions whatever their other clients,
so a transformer's residual stream h_k = h_{k-1} + m_k becomes add(x, m_1, ..., m_k) at every sublayer:
gemma-3-270m's decode step had 36 such sums of 4 to 38 inputs. Each fused into its own distinct Composite,
so each was its own C module (37 of the decode step's 92 g++ compiles, 77 s cold), and the in-place
rewriter tried every input of every sum (54 s of a 70 s rewrite, profiled). This rewrite, placed after
canonicalization and before fusion, writes a sum whose leading inputs are exactly another sum's inputs as
add(that sum, the rest): one Composite shape per residual add again. The sum is unchanged bit for bit: C
adds an n-ary sum left to right, so ((x + m_1) + ...) + m_k is the same float32 arithmetic either way.
"""

from __future__ import annotations

TAG = "alchemist_partial_sums"  # the tag modes include; the rewrite is registered as "reuse_partial_sums"
_registered = False


def _reuse_partial_sums(fgraph) -> int:
    """Rewrite each add whose leading inputs (two or more) are exactly another add's inputs, in the same order,
    as add(that add's output, remaining inputs). Returns how many were rewritten."""
    from pytensor.scalar import add as scalar_add
    from pytensor.tensor.elemwise import Elemwise

    adds = [
        node
        for node in fgraph.toposort()
        if isinstance(node.op, Elemwise) and node.op.scalar_op == scalar_add and len(node.inputs) >= 2
    ]
    # an add's inputs -> its output as it is now; the shorter sums are rewritten first, so a longer one always
    # finds the current output of its prefix (never a variable already replaced). The prefix's inputs come
    # before this add in the graph, so using it cannot make a cycle.
    current = {tuple(node.inputs): node.outputs[0] for node in adds}
    changed = 0
    for node in sorted(adds, key=lambda n: len(n.inputs)):
        inputs = tuple(node.inputs)
        out = node.outputs[0]
        for cut in range(len(inputs) - 1, 1, -1):  # the longest prefix first
            partial = current.get(inputs[:cut])
            if partial is None or partial.owner not in fgraph.apply_nodes:
                continue
            new = node.op(partial, *inputs[cut:])
            if new.type == out.type or out.type.is_super(new.type):
                fgraph.replace(out, new, reason="reuse_partial_sums", import_missing=True)
                current[inputs] = new
                changed += 1
                break
    return changed


def register() -> None:
    """Register the rewrite in PyTensor's optdb under TAG (once; modes include it with `.including(TAG)`)."""
    global _registered
    if _registered:
        return
    from pytensor.compile.mode import optdb
    from pytensor.graph.rewriting.basic import GraphRewriter

    class ReusePartialSums(GraphRewriter):
        def add_requirements(self, fgraph):
            pass

        def apply(self, fgraph):
            return _reuse_partial_sums(fgraph)

    if "reuse_partial_sums" not in optdb.__position__:
        # after canonicalize (1), specialize (2), uncanonicalize (3); before add_mul_fusion (48) and fusion (49)
        optdb.register("reuse_partial_sums", ReusePartialSums(), TAG, position=47)
    _registered = True
