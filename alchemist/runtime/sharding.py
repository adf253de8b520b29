"""A model across JAX devices: tensor parallelism decided from the IR, and the sharded weights and caches.

`layout(ir, n, policy)` is data, computed from the IR's components (never per family), as Megatron splits a
block: attention by heads (q, k, v and their biases by output rows) with the KV cache by KV heads; a gated or
plain MLP by hidden units (gate and up by rows); the token embedding and the output projection by vocabulary
rows; the attention output and MLP down by input columns ("megatron") or by output rows ("rows"). A split needs
even parts (and, for a column split of a block-quantized tensor, whole blocks per part); what cannot be split is
replicated, and `Layout.reasons` says why.

The placement is JAX's: the step function is the same PyTensor graph, its shared variables hold sharded
`jax.Array`s, and `jax.jit` follows them (XLA's SPMD partitioner inserts the collectives); the ggml kernels,
which it cannot partition, become their sharded forms (`shard_kernels`). A row split computes every row as one
device does; a column split sums its partial products in another order (float32 rounding), which ggml's
activation rounding can carry on, hence `default_policy`. `load_sharded` reads each device's part of a tensor
from the GGUF file's memory map, so a process touches only the bytes of the shards it holds (with several
processes, `init_distributed` first). The layout is pure Python; JAX is imported only by the functions that
place arrays.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from alchemist.errors import AlchemistError
from alchemist.ir import MLPKind, ModelIR

AXIS = "tp"  # the mesh axis every split uses


@dataclass(frozen=True)
class Layout:
    """Per weight (GGUF name) its split over `n` devices, as a PartitionSpec tuple in the stored array's numpy
    order: (AXIS, None) rows, (None, AXIS) columns; a weight not named is replicated. `cache_split[i]`: whether
    the i-th cache-owning layer's K and V caches (capacity, n_kv_head, head_dim) are split by KV heads."""

    n: int
    specs: dict = field(default_factory=dict)
    cache_split: tuple[bool, ...] = ()
    reasons: tuple[str, ...] = ()
    policy: str = "megatron"

    def spec(self, name: str) -> tuple:
        return self.specs.get(name, ())

    def cache_spec(self, cache_layer: int, kind: str) -> tuple:
        split = kind in ("k", "v") and self.cache_split[cache_layer]
        return (None, AXIS, None) if split else ()

    @property
    def digest(self) -> str:
        text = json.dumps([self.n, sorted(self.specs.items()), self.cache_split, self.policy], default=list)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self, ir: ModelIR) -> str:
        """A few lines: how many weights and bytes are split, and why the rest is replicated."""
        sizes = {t.name: t.nbytes for t in ir.tensors}
        split = sum(sizes[name] for name in self.specs)
        total = sum(sizes.values())
        lines = [
            f"tensor parallel over {self.n} devices ({self.policy}): {len(self.specs)} of {len(sizes)} tensors split "
            f"({split / 2**20:.1f} of {total / 2**20:.1f} MiB), KV caches split in "
            f"{sum(self.cache_split)} of {len(self.cache_split)} layers"
        ]
        lines += [f"  replicated: {why}" for why in self.reasons]
        return "\n".join(lines)


def _block(ggml_type: str) -> int:
    """Weights per block of a GGUF type (1 for F32/F16/BF16)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]][0]


POLICIES = ("megatron", "rows")


def default_policy(numerics: str) -> str:
    """ "rows" for ggml numerics: every product is then the one-device kernel's rows, so the logits are one
    device's bit for bit (and llama.cpp's); "megatron" for exact numerics: one all-reduce per block, the sums
    in another order (float32 rounding, which exact numerics carry without amplifying it)."""
    return "rows" if numerics == "ggml" else "megatron"


def layout(ir: ModelIR, n: int, policy: str = "megatron") -> Layout:
    """The tensor-parallel layout of `ir` over n devices (n = 1: everything replicated).

    policy "megatron": the attention output and MLP down projections split by input columns (their inputs are
    already split; one all-reduce of a partial sum each). "rows": those split by output rows too (XLA gathers
    their input row first and the output row after): no partial sums, every product's rows as one device's."""
    if n < 1:
        raise AlchemistError(f"devices must be at least 1, got {n}")
    if policy not in POLICIES:
        raise AlchemistError(f"unknown split policy {policy!r}: choose one of {', '.join(POLICIES)}")
    tensors = {t.name: t for t in ir.tensors}
    specs: dict[str, tuple] = {}
    reasons: list[str] = []

    def rows_ok(name: str) -> bool:
        t = tensors[name]
        # a 1-D tensor's rows are its elements: only unblocked types split there
        return t.shape[0] % n == 0 and (len(t.shape) > 1 or _block(t.ggml_type) == 1)

    def cols_ok(name: str) -> bool:
        t = tensors[name]
        return len(t.shape) == 2 and t.shape[1] % n == 0 and (t.shape[1] // n) % _block(t.ggml_type) == 0

    def by_rows(*names: str) -> None:
        for name in names:
            specs[name] = (AXIS,) + (None,) * (len(tensors[name].shape) - 1)

    def back_to_embedding(name: str, where: str) -> None:
        """The projection back to the embedding: by columns (its input is split), else by rows (XLA gathers the
        small activation first), else replicated."""
        if policy == "megatron" and cols_ok(name):
            specs[name] = (None, AXIS)
        elif policy == "rows" and rows_ok(name):
            by_rows(name)
        elif rows_ok(name):
            by_rows(name)
            reasons.append(f"{where}: {name} split by rows, not columns (parts are not whole blocks)")
        else:
            reasons.append(f"{where}: {name} (shape {tensors[name].shape} does not divide by {n})")

    for lay in ir.layers if n > 1 else ():
        where = f"blk.{lay.index}"

        def block(*suffixes):  # the components name a block's tensors by suffix
            return [f"{where}.{x}" for x in suffixes if x]

        att = lay.attention
        if att is not None:
            why = _attention_unsplittable(att, lay.index, n)
            if why is None and not all(map(rows_ok, block(att.q, att.k, att.v))):
                why = "q, k or v rows do not divide"
            if why:
                reasons.append(f"{where} attention: {why}")
            else:
                by_rows(*block(att.q, att.k, att.v, att.q_bias, att.k_bias, att.v_bias, att.sinks))
                back_to_embedding(*block(att.out), f"{where} attention")
        mlp = lay.mlp
        if mlp is not None:
            plain = mlp.kind in (MLPKind.GATED, MLPKind.PLAIN) and mlp.router is None and not mlp.gate_up_fused
            if not plain:
                reasons.append(f"{where} mlp: {mlp.kind.value} MLPs are not split")
            elif mlp.n_ff % n or not all(map(rows_ok, block(mlp.gate, mlp.up))):
                reasons.append(f"{where} mlp: {mlp.n_ff} hidden units do not divide by {n}")
            else:
                by_rows(*block(mlp.gate, mlp.up, mlp.gate_bias, mlp.up_bias))
                back_to_embedding(*block(mlp.down), f"{where} mlp")
    for name in dict.fromkeys((ir.embedding.weight, ir.output.weight)) if n > 1 else ():
        if rows_ok(name):
            by_rows(name)
        else:
            reasons.append(f"{name}: {ir.n_vocab} vocabulary rows do not divide by {n}")
    owners = {lay.index: lay.attention for lay in ir.layers}
    cache_split = tuple(owners[i] is not None and f"blk.{i}.{owners[i].q}" in specs for i in ir.kv_cache_layers)
    return Layout(n=n, specs=specs, cache_split=cache_split, reasons=tuple(reasons), policy=policy)


def _attention_unsplittable(att, index: int, n: int) -> str | None:
    if att.qkv is not None:
        return "fused qkv"
    if att.latent is not None:
        return "latent attention"
    if att.kv_layer not in (None, index):
        return f"reads layer {att.kv_layer}'s cache"
    if att.output_gate:
        return "gated output"
    if att.n_head % n or att.n_kv_head % n:
        return f"{att.n_head} heads / {att.n_kv_head} KV heads do not divide by {n}"
    return None


# ---------------------------------------------------------------------------------------------- placement (JAX)
def init_distributed(coordinator: str, num_processes: int, process_id: int, local_devices: int | None = None):
    """Join a multi-process JAX run (before any JAX device is used): CPU collectives over gloo. Every process
    then runs the same steps in lockstep and holds only its devices' shards."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The processes' collectives meet only when their programs are the same, source locations included, and
    # PyTensor compiles each step's Python from a temporary file of a random name: drop the file names.
    jax.config.update("jax_hlo_source_file_canonicalization_regex", ".*")
    if local_devices:
        jax.config.update("jax_num_cpu_devices", int(local_devices))
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(num_processes),
        process_id=int(process_id),
        initialization_timeout=120,
    )


def make_mesh(n: int):
    """A one-axis mesh over the first n devices (all processes'). On CPU, when JAX has not started its backend
    yet, asks for n host devices; otherwise the process must have been started with enough of them."""
    import jax

    asked = jax.config.jax_num_cpu_devices >= 0 or "host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if not asked:
        try:  # refused once JAX's backends have started: then XLA_FLAGS must have asked for the devices
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            pass
    devices = jax.devices()
    if len(devices) < n:
        raise AlchemistError(
            f"devices={n}: JAX sees {len(devices)} {devices[0].platform} device(s). On CPU, start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} (or call "
            f"jax.config.update('jax_num_cpu_devices', {n}) before JAX is first used)"
        )
    from jax.sharding import AxisType, Mesh

    # Auto axes: the partitioner decides the intermediates (Explicit axes would reject PyTensor's plain dots)
    return Mesh(np.array(devices[:n]), (AXIS,), axis_types=(AxisType.Auto,))


def named(mesh, spec: tuple):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(*spec))


def place(value: np.ndarray, sharding):
    """A global jax.Array of `value` (the same on every process) cut as `sharding`: each process puts only its
    devices' parts."""
    import jax

    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


@dataclass
class ReadStats:
    """What load_sharded read from the file: the bytes of this process's distinct parts."""

    bytes_read: int = 0


def load_sharded(module, path, lay: Layout, mesh, quantized: bool = False, progress=None, stats=None) -> dict:
    """Every tensor of the generated module's GGUF file as a global jax.Array cut as the layout says, each
    device's part read from the memory map on its own (float32, or with quantized=True the KERNEL_WEIGHTS as
    uint8 blocks (n_out, bytes per row), as module.load_weights gives them)."""
    import jax

    data = np.memmap(path, dtype=np.uint8, mode="r")
    expected = module.PROVENANCE["source_size"]
    if data.size != expected:
        raise AlchemistError(f"{path}: {data.size} bytes, but this module was generated for a {expected}-byte file")
    stats = stats if stats is not None else ReadStats()
    out = {}
    for name, (ggml_type, shape, offset, nbytes) in module.TENSORS.items():
        start = module.DATA_OFFSET + offset
        raw = data[start : start + nbytes]
        blocks = quantized and name in module.KERNEL_WEIGHTS
        spec = lay.spec(name)
        if blocks:
            global_shape, dtype = (shape[0], nbytes // shape[0]), np.uint8
        else:
            global_shape, dtype = tuple(shape), np.float32
        read = _part_reader(module, raw, ggml_type, tuple(shape), blocks, stats)
        out[name] = jax.make_array_from_callback(global_shape, named(mesh, spec), read, dtype=dtype)
        if progress is not None:
            progress(name, nbytes)
    return out


def _part_reader(module, raw, ggml_type, shape, blocks, stats):
    """The callback giving one device's part (an index: a slice per dimension) of a tensor: only its rows'
    bytes, and of a column split only its blocks' bytes of each row. Parts asked twice (replicas) are read once."""
    qk = _block(ggml_type)
    per_row = raw.reshape(shape[0], -1)  # the bytes of each row (of a 1-D tensor: of each element)
    memo: dict = {}

    def read(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        key = tuple((s.start, s.stop) for s in index)
        if key not in memo:
            r0, r1, _ = index[0].indices(shape[0])
            part, part_shape = per_row[r0:r1], (r1 - r0,) + tuple(shape[1:])
            if len(shape) >= 2 and index[-1] != slice(None):
                c0, c1, _ = index[-1].indices(per_row.shape[1] if blocks else shape[-1])
                if not blocks:  # columns of weights -> the bytes of their whole blocks
                    part_shape = part_shape[:-1] + (c1 - c0,)
                    block_bytes = per_row.shape[1] * qk // shape[-1]
                    c0, c1 = c0 // qk * block_bytes, c1 // qk * block_bytes
                part = part[:, c0:c1]
            part = np.ascontiguousarray(part)
            stats.bytes_read += part.nbytes
            memo[key] = part if blocks else module.dequantize_tensor(part.reshape(-1), ggml_type, part_shape)
        return memo[key]

    return read


def device_memory(engine) -> dict:
    """{device name: bytes of the engine's weights and caches it holds} over this process's devices."""
    arrays = [sv.container.storage[0] for sv in engine.weights.values()]
    arrays += [sv.container.storage[0] for caches in engine.cache for sv in caches]
    held: dict = {}
    for arr in arrays:
        for shard in getattr(arr, "addressable_shards", ()):
            held[str(shard.device)] = held.get(str(shard.device), 0) + shard.data.nbytes
    return held


def host(value) -> np.ndarray:
    """A step's output as numpy on every process (gathered when other processes hold parts of it)."""
    if getattr(value, "is_fully_addressable", True):
        return np.asarray(value)
    if value.sharding.is_fully_replicated:  # every process has all of it
        return np.asarray(value.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


@dataclass(frozen=True)
class Placement:
    """Where an Engine's arrays live: the layout's specs on a mesh."""

    layout: Layout
    mesh: object

    @classmethod
    def of(cls, ir: ModelIR, n: int, policy: str) -> "Placement":
        """The layout of `ir` over the first n devices."""
        return cls(layout(ir, n, policy), make_mesh(n))

    def weight(self, name: str):
        return named(self.mesh, self.layout.spec(name))

    def cache(self, cache_layer: int, kind: str):
        return named(self.mesh, self.layout.cache_spec(cache_layer, kind))


def shard_kernels(outputs: list, weights: dict, lay: Layout) -> list:
    """The step's outputs with every ggml kernel whose weight (or heads) the layout splits replaced by its sharded
    Op (alchemist.kernels.sharded): a quantized product of a row- or column-split weight, and, where every
    attention layer is split by heads, the attention kernel."""
    from pytensor.graph.fg import FunctionGraph

    from alchemist.kernels.attention import CausalAttentionGgml
    from alchemist.kernels.op import QuantizedMatmul
    from alchemist.kernels.sharded import ShardedAttention, ShardedQuantizedMatmul

    split_of = {sv: {(AXIS, None): "rows", (None, AXIS): "cols"}.get(lay.spec(name)) for name, sv in weights.items()}
    heads_split = bool(lay.cache_split) and all(lay.cache_split)
    fgraph = FunctionGraph(outputs=outputs, clone=False)
    for node in fgraph.toposort():
        op, new = node.op, None
        if isinstance(op, QuantizedMatmul) and op.numerics == "ggml" and split_of.get(node.inputs[1]):
            new = ShardedQuantizedMatmul(op, split_of[node.inputs[1]], lay.n)(*node.inputs)
        elif type(op) is CausalAttentionGgml and heads_split:
            new = ShardedAttention(op, lay.n)(*node.inputs)
        if new is not None:
            fgraph.replace(node.outputs[0], new, reason="shard_kernels", import_missing=True)
    return list(fgraph.outputs)
