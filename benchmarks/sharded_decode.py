"""A model split over JAX devices: decode and prefill tok/s, memory per device and the logits' agreement with one
device, for each device count, in one run.

    python benchmarks/sharded_decode.py MODEL [--devices 1,2,4] [--prompt-tokens 32] [--gen-tokens 16]
        [--context 256] [--threads 2] [--numerics ggml|exact] [--json OUT]

Each device count runs in a process of its own (JAX fixes its device count when it starts), on CPU with
XLA_FLAGS=--xla_force_host_platform_device_count=N: the devices are simulated and share this machine's cores, so
tok/s shows the cost of the collectives, not a speed-up; the memory per device is what a real device would hold
(weights and KV cache, read from each array's shards).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def child(args) -> None:
    from alchemist.runtime import sharding
    from alchemist.runtime.api import load_llm, peak_rss_mb

    t0 = time.perf_counter()
    model = load_llm(args.model, backend="jax", numerics=args.numerics, progress=False, context=args.context,
                     devices=args.devices)  # fmt: skip
    load_s = time.perf_counter() - t0
    engine = model.engine
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(10, model.ir.n_vocab - 10, args.prompt_tokens)]
    engine.run(prompt, 0)  # compiles (JAX traces at the first call of each shape)
    engine.run([prompt[0]], len(prompt))
    t = time.perf_counter()
    logits = engine.run(prompt, 0)
    prefill_s = time.perf_counter() - t
    tokens, steps = [], [np.asarray(logits, np.float64).ravel()]
    t = time.perf_counter()
    for i in range(args.gen_tokens):
        tokens.append(int(np.argmax(steps[-1])))
        steps.append(np.asarray(engine.run([tokens[-1]], len(prompt) + i), np.float64).ravel())
    decode_s = time.perf_counter() - t
    held = sharding.device_memory(engine)
    print("RESULT " + json.dumps({
        "devices": args.devices, "load_s": load_s, "prefill_tok_s": len(prompt) / prefill_s,
        "decode_tok_s": args.gen_tokens / decode_s, "device_mib": {d: b / 2**20 for d, b in held.items()},
        "peak_rss_mb": peak_rss_mb(), "tokens": tokens, "logits": [x.tolist() for x in steps[:3]],
    }), flush=True)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF path or a reference-model name")
    ap.add_argument("--devices", default="1,2,4")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--numerics", default="ggml", choices=["ggml", "exact"])
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.devices = int(args.devices)
        child(args)
        return 0
    from alchemist.models import resolve_model

    model = str(resolve_model(args.model))
    rows = []
    for n in [int(x) for x in args.devices.split(",")]:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
                   OMP_NUM_THREADS=str(args.threads))  # fmt: skip
        cmd = [sys.executable, __file__, model, "--child", "--devices", str(n), "--prompt-tokens",
               str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens), "--context", str(args.context), "--numerics", args.numerics]  # fmt: skip
        print(f"[{n} device(s)] loading and compiling", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
            return 1
        rows.append(json.loads(line[len("RESULT ") :]))
    base = rows[0]
    print(
        f"\n{os.path.basename(model)}, JAX, {args.numerics} numerics, simulated CPU devices on {os.cpu_count()} cores\n"
    )
    print("| devices | decode tok/s | prefill tok/s | MiB per device (weights + cache) | vs 1 device | "
          "peak RSS MB | logits NMSE vs 1 device | same tokens |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mib = max(r["device_mib"].values())
        ratio = mib / max(base["device_mib"].values())
        nmse = max(
            float(((np.array(a) - np.array(b)) ** 2).sum() / (np.array(b) ** 2).sum())
            for a, b in zip(r["logits"], base["logits"])
        )
        print(f"| {r['devices']} | {r['decode_tok_s']:.1f} | {r['prefill_tok_s']:.1f} | {mib:.1f} | {ratio:.2f} "
              f"(1/{r['devices']} = {1 / r['devices']:.2f}) | {r['peak_rss_mb']:.0f} | {nmse:.1e} | "
              f"{r['tokens'] == base['tokens']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
