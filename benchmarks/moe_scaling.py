"""Mixture-of-experts decode cost as the expert count grows, at a fixed top-k: C backend, Q4_K experts kept in
their GGUF blocks and multiplied by the gathered-experts kernel (alchemist.kernels.QuantizedExpertMatmul).

    python benchmarks/moe_scaling.py [--experts 4,8,16,32,64] [--top-k 2] [--steps 64] [--n-embd 512] [--n-ff 512]
                                     [--threads N]

For each expert count a qwen3moe fixture (2 layers, random weights) is written, quantized to Q4_K by
llama.cpp, loaded on the C backend with quantized weights, and decoded greedily; the table gives the median
decode step. A step reads K experts per layer, so its time should stay flat while the experts' bytes grow
with the expert count. --threads sets OMP_NUM_THREADS (on a busy shared machine, 1 avoids OpenMP threads
spinning against other processes, which otherwise dominates a sub-millisecond step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def measure(n_expert: int, top_k: int, steps: int, n_embd: int, n_ff: int, workdir: Path) -> dict:
    import numpy as np

    from alchemist.arch import build_model_ir
    from alchemist.fixtures import FixtureConfig, write_fixture
    from alchemist.gguf_io import read_gguf
    from alchemist.harness.quantize import quantize_fixture
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import Engine, import_generated

    meta = (("expert_count", n_expert), ("expert_used_count", top_k), ("expert_feed_forward_length", n_ff))
    cfg = FixtureConfig("qwen3moe", n_embd=n_embd, n_head=8, n_kv_head=4, head_dim=64, n_ff=n_ff, metadata=meta)
    f32 = write_fixture(workdir / f"moe{n_expert}-F32.gguf", "qwen3moe", config=cfg)
    path = quantize_fixture(f32, workdir / f"moe{n_expert}-Q4_K.gguf", "Q4_K").path
    f32.unlink()
    ir = build_model_ir(read_gguf(path))
    module = import_generated(write_generated(ir, workdir / "generated"))
    engine = Engine(module, module.load_weights(str(path), quantized=True), "c", steps + 16)
    expert_bytes = sum(t.nbytes for t in ir.tensors if t.role == "experts")
    prompt = [1, 40, 300, 7, 99, 260, 45, 45]
    t0 = time.perf_counter()
    logits = engine.run(prompt, 0)
    engine.run([int(np.argmax(logits))], len(prompt))  # compiles the decode step
    compile_s = time.perf_counter() - t0
    times = []
    for rep in range(2):  # the first pass warms caches; the second is measured
        engine.reset()
        logits = engine.run(prompt, 0)
        token, rep_times = int(np.argmax(logits)), []
        for i in range(steps):
            t1 = time.perf_counter()
            logits = engine.run([token], len(prompt) + i)
            rep_times.append(time.perf_counter() - t1)
            token = int(np.argmax(logits))
        times = rep_times
    return {
        "n_expert": n_expert,
        "expert_mb": expert_bytes / 2**20,
        "read_mb": expert_bytes * top_k / n_expert / 2**20,
        "step_ms": 1000 * statistics.median(times),
        "compile_s": compile_s,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", default="4,8,16,32,64")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-ff", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the kernels (default: as set)")
    args = ap.parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before the compiled kernels load OpenMP
    counts = [int(c) for c in args.experts.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="alchemist-moe-") as tmp:
        for n in counts:
            rows.append(measure(n, args.top_k, args.steps, args.n_embd, args.n_ff, Path(tmp)))
            r = rows[-1]
            print(f"# {n} experts: {r['step_ms']:.2f} ms/step (compile {r['compile_s']:.0f} s)", flush=True)
    base = rows[0]["step_ms"]
    print(
        f"\nqwen3moe fixture, 2 layers, n_embd {args.n_embd}, experts of width {args.n_ff}, top-{args.top_k}, "
        f"Q4_K experts (llama.cpp Q4_K_M mixture) in GGUF blocks, C backend, "
        f"{os.environ.get('OMP_NUM_THREADS', 'default')} OpenMP threads, median of {args.steps} decode steps\n"
    )
    print("| experts | expert weights (MB) | expert bytes read per token (MB) | decode step (ms) | vs fewest |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['n_expert']} | {r['expert_mb']:.1f} | {r['read_mb']:.2f} | {r['step_ms']:.2f} | "
            f"{r['step_ms'] / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
