"""A decode step's cost and cache size by position, recurrent layers (Mamba-2, delta-net) against attention layers,
beside llama.cpp: `python benchmarks/recurrent_state.py [--positions 10,1000,10000] [--reps 20] [--threads 2]`.

Writes three random-weight fixtures of 8 layers each (alchemist.fixtures): "mamba2" (granitehybrid: 7 Mamba-2
layers, 1 attention layer), "deltanet" (qwen35: 7 gated delta-net layers, 1 attention layer) and "attention"
(granite: the same sizes, attention in every layer), prefills each to every position with random tokens, and times the best
of --reps one-token decode steps from there (alchemist's C backend, ggml numerics; llama.cpp through the
oracle's context with --threads threads, F32 KV cache). A recurrent layer's cache is one sequence's state, the
same size at every position; an attention layer's grows by a K and a V row per position. Prints ms per step
and the ratio to llama.cpp's at each position (above 1: alchemist is faster), and the cache of one sequence.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

MODELS = {  # name: (family, metadata of its 8-layer fixture)
    "mamba2": ("granitehybrid", (("attention.head_count_kv", (0, 0, 0, 0, 0, 0, 0, 2)),)),
    "deltanet": ("qwen35", (("full_attention_interval", 8),)),
    "attention": ("granite", ()),  # the same block with attention in every layer
}


def timed_steps(step, first: int, reps: int) -> float:
    """Best ms of step(position) over reps consecutive positions from `first` (a recurrent state only goes on)."""
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        step(first + i)
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def cache_bytes(engine) -> tuple[int, int]:
    """(state bytes of one sequence, bytes per position) of an Engine's caches."""
    state = per_position = 0
    for layer in engine.cache:
        for sv in layer:
            kind = sv.name.split("_cache.")[0]
            size = int(np.prod(sv.type.shape)) * 4
            if kind in engine.states:
                state += size
            else:
                per_position += size // engine.capacity
    return state, per_position


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", default="10,1000,10000")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    positions = sorted(int(p) for p in args.positions.split(","))
    context = positions[-1] + args.reps + 8

    from alchemist import load_llm
    from alchemist.fixtures import FixtureConfig, write_fixture
    from alchemist.harness.oracle import LlamaCppOracle

    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp())
    print(
        f"decode step by position, C backend (ggml numerics) vs llama.cpp ({args.threads} threads), best of {args.reps}"
    )
    print(
        f"{'model':>9} {'position':>8} {'ours ms':>8} {'llama.cpp ms':>12} {'ratio':>6} {'cache of one sequence':>30}"
    )
    for name, (family, metadata) in MODELS.items():
        cfg = FixtureConfig(family, n_layer=8, n_ctx=context, metadata=metadata)
        path = write_fixture(tmp / f"{name}.gguf", family, config=cfg)
        model = load_llm(path, backend="c", context=context, progress=False)
        engine = model.engine
        state, per_position = cache_bytes(engine)
        prompt = [int(t) for t in rng.integers(3, engine.module.N_VOCAB, positions[-1])]
        with LlamaCppOracle(path, n_ctx=context, n_threads=args.threads) as oracle:
            for pos in positions:
                engine.run(prompt[:pos], 0)
                ours = timed_steps(lambda p: engine.run([7], p), pos, args.reps)
                oracle._reset(oracle._ctx)
                oracle._decode(oracle._ctx, prompt[:pos], 0, want_logits=False)
                theirs = timed_steps(lambda p: oracle._decode(oracle._ctx, [7], p), pos, args.reps)
                size = state + per_position * pos
                print(
                    f"{name:>9} {pos:8d} {ours:8.2f} {theirs:12.2f} {theirs / ours:5.2f}x "
                    f"{size / 2**10:9.0f} KiB (state {state / 2**10:.0f} KiB)"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
