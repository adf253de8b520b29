"""Run by tests/test_sharding.py in a fresh process (JAX's device count is fixed when it starts): load a fixture
on `--devices` JAX devices (optionally as one of several jax.distributed processes), decode greedily, and print
one JSON line: the tokens, every step's logits, the bytes each local device holds and the bytes read."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", default="1,5,9,33,70,100,4,8")
    ap.add_argument("--coordinator")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--local-devices", type=int)
    ap.add_argument("--numerics", default="exact")
    ap.add_argument("--split", choices=["rows", "megatron"])
    ap.add_argument("--products", action="store_true", help="also compare each split product with the unsharded")
    ap.add_argument("--collectives", action="store_true", help="also list the decode step's collective ops")
    args = ap.parse_args()

    from alchemist.runtime import sharding

    if args.coordinator:
        sharding.init_distributed(args.coordinator, args.num_processes, args.process_id, args.local_devices)
    from alchemist.runtime.api import load_llm

    stats = sharding.ReadStats()
    original = sharding.load_sharded
    sharding.load_sharded = lambda *a, **k: original(*a, stats=stats, **k)  # count the bytes this process reads
    model = load_llm(
        args.model,
        backend="jax",
        numerics=args.numerics,
        progress=False,
        context=64,
        devices=args.devices,
        split=args.split,
    )
    engine = model.engine
    ids = [int(t) for t in args.prompt.split(",")]
    logits = [engine.run(ids, 0)]
    tokens = []
    for _ in range(args.steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(engine.run([tokens[-1]], len(ids) + len(tokens) - 1))
    out = {
        "tokens": tokens,
        "logits": [np.asarray(x, np.float64).tolist() for x in logits],
        "device_bytes": sharding.device_memory(engine),
        "bytes_read": stats.bytes_read,
        "file_tensor_bytes": sum(nbytes for _, _, _, nbytes in model.module.TENSORS.values()),
    }
    if args.collectives:
        out["collectives"] = decode_collectives(engine)
    if args.products:
        out["products"] = split_products(engine)
    print("RESULT " + json.dumps(out))
    return 0


def split_products(engine) -> dict:
    """Each split quantized weight's product on 3 random rows, sharded (kernels.sharded) vs the one-device
    kernel call on the same (gathered) weight: {name: [split, bit-identical, max |difference| / max |value|]}."""
    import jax
    import pytensor
    import pytensor.tensor as pt

    from alchemist.kernels.op import QuantizedMatmul
    from alchemist.kernels.sharded import ShardedQuantizedMatmul

    lay, out = engine.placement.layout, {}
    rng = np.random.default_rng(1)
    for name, sv in engine.weights.items():
        w = sv.container.storage[0]
        split = {("tp", None): "rows", (None, "tp"): "cols"}.get(lay.spec(name))
        if split is None or str(w.dtype) != "uint8":
            continue
        ggml_type, shape = engine.module.TENSORS[name][:2]
        base = QuantizedMatmul(ggml_type, shape[0], shape[1], numerics="ggml")
        x = rng.standard_normal((3, shape[1])).astype(np.float32)
        xv = pt.matrix("x", dtype="float32", shape=(3, shape[1]))
        wv = pt.matrix("w", dtype="uint8", shape=w.shape)
        with engine._on_mesh():
            f = pytensor.function([xv, wv], [ShardedQuantizedMatmul(base, split, lay.n)(xv, wv)], mode=engine.mode)
            sharded = np.asarray(f(x, w)[0])
        whole = jax.device_put(np.asarray(w), jax.devices()[0])
        g = pytensor.function([xv, wv], [base(xv, wv)], mode=engine.mode)
        one = np.asarray(g(x, whole)[0])
        out[name] = [split, bool(np.array_equal(sharded, one)), float(np.abs(sharded - one).max() / np.abs(one).max())]
    return out


def decode_collectives(engine) -> list[str]:
    """The collective ops (kind and result shape) of the decode step as XLA partitions it: the step's graph
    through PyTensor's JAX dispatch, jitted on the engine's sharded arrays and compiled."""
    import re

    import jax
    from pytensor.link.jax.dispatch import jax_funcify

    fn = engine.step_function(1)
    # the step's inputs by name (a step linked from the graph cache names its shared inputs as the engine does)
    values = {"tokens": np.array([1], np.int64), "start_pos": np.int64(0), "n_valid": np.int64(1)}
    values.update((name, sv.container.storage[0]) for name, sv in engine.weights.items())
    values.update((sv.name, sv.container.storage[0]) for caches in engine.cache for sv in caches)
    args = [values[i.variable.name] for i in fn.maker.inputs]
    with engine._on_mesh():
        hlo = jax.jit(jax_funcify(fn.maker.fgraph)).lower(*args).compile().as_text()
    ops = r"all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
    found = re.findall(rf"= ([a-z0-9]+\[[0-9,]*\])[^ ]* ({ops})(?:-start)?\(", hlo)
    return [f"{kind} {shape}" for shape, kind in found]


if __name__ == "__main__":
    sys.exit(main())
