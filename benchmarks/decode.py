"""Decode throughput per backend: `python benchmarks/decode.py MODEL [--backends c,numba,jax,mlx]`.

Loads the model once per backend, prefills a fixed prompt, then times greedy decoding of --tokens
tokens (compilation excluded and reported separately). Prints one row per backend.
"""

from __future__ import annotations

import argparse
import sys
import time

from alchemist import inference, load_llm
from alchemist.models import resolve_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--backends", default="c,numba,jax,mlx")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", default="What's causal inference?")
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args(argv)
    path = resolve_model(args.model)
    rows = []
    for backend in args.backends.split(","):
        t0 = time.perf_counter()
        model = load_llm(path, backend=backend, context=args.context, progress=False)
        warm = inference(model, input=args.prompt, max_tokens=2)  # compiles the prefill bucket
        res = inference(model, input=args.prompt, max_tokens=args.tokens)
        t = res.report["timings"]
        rows.append(
            (backend, round(time.perf_counter() - t0, 1), round(model.weights_seconds, 2), round(res.report["timings"]["compile_s_total"], 1),
             t["prefill_tok_per_s"], t["decode_tok_per_s"], res.report["compilations"]["during_decode"],
             round(res.report["memory"]["peak_rss_mb"]), res.output_token_ids[:8])
        )
        print(f"{backend}: {res.output!r}", file=sys.stderr)
        del model, warm
    print(f"{'backend':8} {'total s':>8} {'weights s':>9} {'compile s':>9} {'prefill t/s':>11} {'decode t/s':>10} {'recompiles':>10} {'RSS MB':>7}  first ids")
    for r in rows:
        print(f"{r[0]:8} {r[1]:8} {r[2]:9} {r[3]:9} {r[4]!s:>11} {r[5]!s:>10} {r[6]:10} {r[7]:7}  {r[8]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
