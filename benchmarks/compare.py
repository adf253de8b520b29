"""alchemist vs llama.cpp on the same GGUF, same machine, same threads, measured in one run.

    python benchmarks/compare.py MODEL [--backends c,numba] [--reps 3] [--prompt-tokens 128] [--gen-tokens 128]

Every measurement runs in a fresh subprocess (so peak RSS is per engine), alternating llama.cpp and
alchemist, and the table shows medians and the alchemist / llama.cpp ratio. The same 128 prompt token ids
and greedy decoding are used on both sides; decoding never stops early (no EOS check). alchemist's
compile time is reported separately and excluded from prefill/decode rates; its compiled functions are
cached on disk by PyTensor, so repetitions after the first measure a warm start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TEXT = (
    "Causal inference is the process of determining the independent, actual effect of a particular phenomenon "
    "that is a component of a larger system. The main difference between causal inference and inference of "
    "association is that causal inference analyzes the response of an effect variable when a cause of the "
    "effect variable is changed. "
)


def _prompt_ids(path: str, n: int) -> list[int]:
    from alchemist.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    ids = tok.encode(TEXT * 8)
    return ids[:n]


def worker_llama(path: str, prompt: list[int], n_gen: int, threads: int) -> dict:
    import resource

    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=len(prompt) + n_gen + 8, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    t1 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t1
    ids = [int(np.argmax(last_logits()))]
    t2 = time.perf_counter()
    for _ in range(n_gen - 1):
        llm.eval([ids[-1]])
        ids.append(int(np.argmax(last_logits())))
    decode_s = time.perf_counter() - t2
    return {
        "load_s": load_s,
        "compile_s": 0.0,
        "prefill_tok_s": len(prompt) / prefill_s,
        "decode_tok_s": (n_gen - 1) / decode_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ids": ids[:16],
    }


def worker_alchemist(path: str, prompt: list[int], n_gen: int, backend: str) -> dict:
    import resource

    import numpy as np

    from alchemist import load_llm

    t0 = time.perf_counter()
    model = load_llm(path, backend=backend, context=len(prompt) + n_gen + 8, progress=False, compile_now=False)
    load_s = time.perf_counter() - t0
    engine = model.engine
    # compile (or fetch from PyTensor's on-disk cache) the two functions used below
    t1 = time.perf_counter()
    engine.step_function(engine.bucket(len(prompt), 0))
    engine.step_function(1)
    compile_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    logits = engine.run(prompt, 0)
    prefill_s = time.perf_counter() - t2
    ids = [int(np.argmax(logits))]
    t3 = time.perf_counter()
    for i in range(n_gen - 1):
        logits = engine.run([ids[-1]], len(prompt) + i)
        ids.append(int(np.argmax(logits)))
    decode_s = time.perf_counter() - t3
    return {
        "load_s": load_s,
        "compile_s": compile_s,
        "prefill_tok_s": len(prompt) / prefill_s,
        "decode_tok_s": (n_gen - 1) / decode_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ids": ids[:16],
        "recompiles": engine.stats.compile_count - 2,
    }


def run_worker(kind: str, path: str, prompt: list[int], n_gen: int, backend: str, threads: int) -> dict:
    payload = json.dumps({"kind": kind, "path": path, "prompt": prompt, "n_gen": n_gen, "backend": backend,
                          "threads": threads})
    proc = subprocess.run([sys.executable, __file__, "--worker", payload], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind}/{backend} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a GGUF path or a reference-model name (gemma-3-270m, qwen2.5-coder-0.5b)")
    ap.add_argument("--backends", default="c,numba")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        job = json.loads(args.worker)
        if job["kind"] == "llama.cpp":
            out = worker_llama(job["path"], job["prompt"], job["n_gen"], job["threads"])
        else:
            out = worker_alchemist(job["path"], job["prompt"], job["n_gen"], job["backend"])
        print(json.dumps(out))
        return 0

    if args.model is None:
        ap.error("MODEL is required")
    from alchemist.models import resolve_model

    path = resolve_model(args.model)
    prompt = _prompt_ids(path, args.prompt_tokens)
    backends = args.backends.split(",")
    runs: dict[str, list[dict]] = {"llama.cpp": [], **{b: [] for b in backends}}
    for rep in range(args.reps):
        for kind in ["llama.cpp", *backends]:
            res = run_worker("llama.cpp" if kind == "llama.cpp" else "alchemist", path, prompt, args.gen_tokens, kind,
                             args.threads)
            runs[kind].append(res)
            print(f"rep {rep + 1}/{args.reps} {kind:9}: decode {res['decode_tok_s']:.2f} tok/s, "
                  f"prefill {res['prefill_tok_s']:.1f} tok/s", file=sys.stderr)

    metrics = ["load_s", "compile_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mb"]
    med = {k: {m: statistics.median(r[m] for r in v) for m in metrics} for k, v in runs.items()}
    ref = med["llama.cpp"]
    print(f"\n{os.path.basename(path)}: {len(prompt)}-token prompt, {args.gen_tokens} greedy tokens, "
          f"{args.threads} threads, median of {args.reps}")
    header = f"{'engine':10} {'load s':>8} {'compile s':>10} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak RSS MB':>12} " \
             f"{'decode ratio':>13} {'prefill ratio':>14} {'same first 16 ids':>18}"
    print(header)
    for kind, m in med.items():
        same = runs[kind][0]["ids"] == runs["llama.cpp"][0]["ids"]
        print(f"{kind:10} {m['load_s']:8.2f} {m['compile_s']:10.2f} {m['prefill_tok_s']:14.1f} {m['decode_tok_s']:13.2f} "
              f"{m['peak_rss_mb']:12.0f} {m['decode_tok_s'] / ref['decode_tok_s']:13.3f} "
              f"{m['prefill_tok_s'] / ref['prefill_tok_s']:14.3f} {str(same):>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
