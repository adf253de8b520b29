"""Per-token sampling cost on one vocabulary-sized row: the 0.1.0 full-sort sampler against `Sampler` now.

    python benchmarks/sampler.py [--vocab 262144] [--reps 30]

Rows are random N(0, s^2) float32 logits: s=3 is flat (top-p 0.95 keeps tens of thousands of tokens), s=6 is
peaked like a confident model (top-p keeps tens)."""

from __future__ import annotations

import argparse
import time

import numpy as np

from alchemist.runtime.sampling import Sampler, SamplingParams


def full_sort_sample(row, p: SamplingParams, rng) -> int:
    logits = np.asarray(row, dtype=np.float64).reshape(-1).copy()
    if p.temperature == 0.0:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")
    if p.top_k:
        order = order[: p.top_k]
    cand = logits[order] / p.temperature
    probs = np.exp(cand - cand.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])


def ms_per_call(f, reps: int) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    settings = [
        SamplingParams(),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=40),
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95),
    ]
    print(f"{'logits':8s} {'temperature/top_k/top_p':24s} {'full sort ms':>12s} {'now ms':>8s} {'candidates':>10s}")
    for scale in (3.0, 6.0):
        row = (np.random.default_rng(0).standard_normal(args.vocab) * scale).astype(np.float32)
        for p in settings:
            s, rng = Sampler(p), np.random.default_rng(0)
            before = ms_per_call(lambda: full_sort_sample(row, p, rng), args.reps)
            after = ms_per_call(lambda: s(row, []), args.reps)
            n = len(s.candidates(row, [])[0])
            name = f"{p.temperature}/{p.top_k}/{p.top_p}"
            print(f"N(0,{scale:.0f}²) {name:24s} {before:12.2f} {after:8.2f} {n:10d}")


if __name__ == "__main__":
    main()
