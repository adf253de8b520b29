"""Open-to-first-token: from opening a GGUF to the first generated token, alchemist vs llama.cpp.

    python benchmarks/open_to_first_token.py MODEL [--backend c] [--reps 5] [--prompt "..."]

Each measurement is a fresh process (imports are done before the clock starts, for both engines), so
alchemist's in-memory caches are empty and only its disk caches help: PyTensor's compiledir (C modules),
alchemist's rewritten-graph cache, and the remembered sha256 / formatted module / g++ flags. The first
repetition warms those caches if they are cold and is reported separately; the table shows the median of
the rest with alchemist's breakdown (load_llm's parts, then the prompt's prefill function and the prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker_llama(path: str, prompt: str, threads: int) -> dict:
    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    t_load = time.perf_counter()
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    llm.eval(ids)
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    first = int(np.argmax(logits))
    t_first = time.perf_counter()
    return {"open_s": t_load - t0, "first_token_s": t_first - t0, "token": first, "n_prompt": len(ids)}


def worker_alchemist(path: str, prompt: str, backend: str) -> dict:
    from alchemist import inference, load_llm

    t0 = time.perf_counter()
    model = load_llm(path, backend=backend, context=512, progress=False)
    t_load = time.perf_counter()
    result = inference(model, input=prompt, max_tokens=1, chat=False)
    t_first = time.perf_counter()
    stats = model.engine.stats
    return {
        "open_s": t_load - t0,
        "first_token_s": t_first - t0,
        "token": result.output_token_ids[0],
        "n_prompt": len(result.prompt_token_ids),
        "weights_s": model.weights_seconds,
        "decode_link_s": model.compile_seconds,
        "prefill_link_s": stats.compile_seconds - model.compile_seconds,
        "graph_cache_hits": stats.graph_cache_hits,
        "compiles": stats.compile_count,
    }


def run_worker(job: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{job['kind']} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a GGUF path or a reference-model name (gemma-3-270m, qwen2.5-coder-0.5b)")
    ap.add_argument("--backend", default="c")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", default="What is causal inference?")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        job = json.loads(args.worker)
        if job["kind"] == "llama.cpp":
            out = worker_llama(job["path"], job["prompt"], job["threads"])
        else:
            out = worker_alchemist(job["path"], job["prompt"], job["backend"])
        print(json.dumps(out))
        return 0
    if args.model is None:
        ap.error("MODEL is required")
    if args.reps < 2:
        ap.error("--reps must be at least 2 (the first one only warms the caches)")
    from alchemist.models import resolve_model

    path = resolve_model(args.model)
    runs: dict[str, list[dict]] = {"llama.cpp": [], args.backend: []}
    for rep in range(args.reps):
        for kind in runs:
            job = {"kind": kind, "path": path, "prompt": args.prompt, "backend": args.backend, "threads": args.threads}
            res = run_worker(job)
            runs[kind].append(res)
            print(f"rep {rep + 1}/{args.reps} {kind:9}: open {res['open_s']:.2f} s, first token {res['first_token_s']:.2f} s"
                  + (f", graph cache hits {res['graph_cache_hits']}" if kind != "llama.cpp" else ""), file=sys.stderr)

    warm = {k: v[1:] for k, v in runs.items()}
    ref = statistics.median(r["first_token_s"] for r in warm["llama.cpp"])
    ours = runs[args.backend]
    print(f"\n{os.path.basename(path)}: prompt {args.prompt!r} ({ours[0]['n_prompt']} tokens), {args.threads} threads, "
          f"median of {args.reps - 1} warm fresh processes")
    print(f"{'engine':10} {'open s':>8} {'first token s':>14} {'ratio':>7} {'same token':>11}")
    for kind, rs in warm.items():
        first = statistics.median(r["first_token_s"] for r in rs)
        same = all(r["token"] == runs["llama.cpp"][0]["token"] for r in rs)
        print(f"{kind:10} {statistics.median(r['open_s'] for r in rs):8.2f} {first:14.2f} {first / ref:7.2f} {str(same):>11}")
    parts = ["weights_s", "decode_link_s", "prefill_link_s"]
    print(f"{args.backend} breakdown (median): "
          + ", ".join(f"{p} {statistics.median(r[p] for r in warm[args.backend]):.2f}" for p in parts)
          + f"; graph cache hits {[r['graph_cache_hits'] for r in warm[args.backend]]}")
    print(f"first (cache-warming) run: first token {ours[0]['first_token_s']:.2f} s, "
          f"graph cache hits {ours[0]['graph_cache_hits']} of {ours[0]['compiles']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
