"""Batched decode vs one sequence: `python benchmarks/slot_decode.py [MODEL] [--context 1024] [--reps 20]`.

Loads MODEL (default gemma-3-270m) on the C backend, builds a SlotEngine (8 slots, chunk 32, decode buckets
1/2/4/8), times its warm_up (compiled, or linked from the rewritten-graph cache: run twice to see both;
--graph-dir points the graph cache at a directory of its own, e.g. an empty one for a cold start), prefills
every slot with a prompt of --prompt tokens, then times best-of-R decode steps of B = 1, 2, 4, 8 sequences
against the single-sequence Engine's one-token step at the same position. Also prints the KV memory of one
slot with ring rows for the sliding-window layers and without (full_window=True), at a few context sizes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def best_ms(fn, reps: int) -> float:
    fn()  # once untimed: first-call effects
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="gemma-3-270m")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=120, help="tokens prefilled per slot before decoding")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--graph-dir", type=Path, default=None, help="a graph cache directory of this run's own")
    args = ap.parse_args(argv)

    from alchemist import load_llm
    from alchemist.runtime import graph_cache
    from alchemist.runtime.slot_engine import SlotEngine

    if args.graph_dir is not None:
        args.graph_dir.mkdir(parents=True, exist_ok=True)
        graph_cache.cache_dir = lambda: args.graph_dir
    model = load_llm(args.model, backend="c", context=args.context, progress=False)
    engine = model.engine
    print(f"{model.ir.model_name}: C backend, context {engine.capacity}, load {model.load_seconds:.1f} s")

    module = engine.module
    for context in sorted({engine.capacity, 4096}):
        # SlotEngine's rows: a row per position (whole chunks) on global layers, window + chunk on sliding ones
        context_rows = -(-context // args.chunk) * args.chunk
        ring = [min(w + args.chunk, context_rows) if w else context_rows for w in module.SLIDING_WINDOW]
        per_row = 2 * module.N_KV_HEAD * module.HEAD_DIM * 4  # K and V, float32
        print(
            f"KV per slot at context {context}, chunk {args.chunk}: ring {sum(ring) * per_row / 2**20:.1f} MiB, "
            f"full {len(ring) * context_rows * per_row / 2**20:.1f} MiB (rows per layer: {sorted(set(ring))})"
        )

    se = SlotEngine(engine, args.slots, chunk=args.chunk)
    t0 = time.perf_counter()
    se.warm_up(lambda msg: print(f"  warm_up {msg} ({time.perf_counter() - t0:.1f} s)", flush=True))
    warm_s = time.perf_counter() - t0
    print(
        f"warm_up: {warm_s:.1f} s for {len(se.stats.compiled_shapes)} steps "
        f"({se.stats.graph_cache_hits} linked from the graph cache)"
    )

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, se.n_vocab, args.prompt)] for _ in range(args.slots)]
    t0 = time.perf_counter()
    for slot, ids in enumerate(prompts):
        for a, b in se.chunk_plan(len(ids)):
            se.prefill(slot, ids[a:b], a)
    prefill_s = time.perf_counter() - t0
    print(
        f"prefill: {args.slots * args.prompt} tokens in {prefill_s:.2f} s ({args.slots * args.prompt / prefill_s:.0f} tok/s)"
    )

    chunk_ids = prompts[0][: args.chunk]
    slot_ms = best_ms(lambda: se.prefill(0, chunk_ids, 0), max(3, args.reps // 4))
    engine_ms = best_ms(lambda: engine.run(chunk_ids, 0), max(3, args.reps // 4))
    print(
        f"one prefill chunk of {args.chunk}: SlotEngine {slot_ms:.0f} ms ({1000 * args.chunk / slot_ms:.0f} tok/s), "
        f"Engine.run {engine_ms:.0f} ms ({1000 * args.chunk / engine_ms:.0f} tok/s)"
    )
    se.prefill(0, chunk_ids, 0)  # (slot 0 holds its prompt again up to here: the chunk was the same)

    pos = args.prompt
    engine.run(prompts[0], 0)  # the single-sequence engine at the same position
    single = best_ms(lambda: engine.run([7], pos), args.reps)
    print(f"\n{'B':>3} {'ms/step':>8} {'ms/token':>9} {'tok/s':>7} {'vs 1 stream':>11}")
    print(f"{'E1':>3} {single:8.1f} {single:9.1f} {1000 / single:7.1f} {1.0:10.2f}x   (Engine.run, one token)")
    for b in se.decode_buckets:
        slots = list(range(b))
        ms = best_ms(lambda: se.decode(slots, [7] * b, [pos] * b), args.reps)
        print(f"{b:3d} {ms:8.1f} {ms / b:9.1f} {1000 * b / ms:7.1f} {single * b / ms:10.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
