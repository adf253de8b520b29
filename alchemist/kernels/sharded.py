"""The ggml kernels on a model split over JAX devices (alchemist.runtime.sharding): each device runs the C kernel
on its own part of a weight or of the heads, under `jax.shard_map`.

XLA cannot see into a custom call, so a kernel handed a split weight would first gather the whole weight on
every device. These Ops say how the kernel divides instead:

- `ShardedQuantizedMatmul(op, "rows", n)`: the weight's output rows are split; each device multiplies the whole
  activation by its rows (the kernel's rows are computed independently: the same bits as the unsharded call's
  rows), and the output stays split by columns.
- `ShardedQuantizedMatmul(op, "cols", n)`: the weight's input columns are split at whole blocks; each device
  multiplies its columns of the activation (rounded to the same activation blocks as unsharded) by its part of
  every row, and the partial products are summed across devices (`psum`): the same products, summed in another
  order, so float32 rounding apart.
- `ShardedAttention(op, n)`: heads and KV heads are split; each device attends with its own heads (heads are
  independent: the same bits).

The Engine puts them in a step's graph for a model on several devices (sharding.shard_kernels); JAX lowers them
(kernels.jax_ffi), with the mesh the Engine runs the step under (`jax.set_mesh`). `perform` is the unsharded
Op's, so the graph means the same on any backend.
"""

from __future__ import annotations

from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

SPLITS = ("rows", "cols")


class ShardedQuantizedMatmul(Op):
    __props__ = ("base", "split", "n_shards")

    def __init__(self, base, split: str, n_shards: int):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        n_shards = int(n_shards)
        whole = base.n_out if split == "rows" else base.n_in
        if n_shards < 1 or whole % n_shards:
            raise ValueError(f"{base}: {whole} {split} do not divide over {n_shards} devices")
        self.base, self.split, self.n_shards = base, split, n_shards
        super().__init__()

    def make_node(self, x, w):
        node = self.base.make_node(x, w)
        return Apply(self, node.inputs, [out.type() for out in node.outputs])

    def infer_shape(self, node, shapes):
        return [(shapes[0][0], self.base.n_out)]

    def perform(self, node, inputs, output_storage):
        self.base.perform(node, inputs, output_storage)


class ShardedAttention(Op):
    __props__ = ("base", "n_shards")

    def __init__(self, base, n_shards: int):
        n_shards = int(n_shards)
        if n_shards < 1 or base.n_head % n_shards or base.n_kv_head % n_shards:
            raise ValueError(f"{base}: {base.n_head} heads / {base.n_kv_head} KV heads do not divide by {n_shards}")
        self.base, self.n_shards = base, n_shards
        super().__init__()

    def make_node(self, *inputs):
        node = self.base.make_node(*inputs)
        return Apply(self, node.inputs, [out.type() for out in node.outputs])

    def perform(self, node, inputs, output_storage):
        self.base.perform(node, inputs, output_storage)
