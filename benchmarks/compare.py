"""alchemist vs llama.cpp on the same GGUF, same machine, same threads, measured in one run.

    python benchmarks/compare.py MODEL [--backends c,numba,jax,mlx] [--numerics ggml,exact] [--reps 3]
                                 [--slow-reps 1] [--prompt-tokens 128] [--gen-tokens 128] [--threads N]

Every measurement runs in a fresh subprocess (so peak RSS is per engine), alternating llama.cpp and
alchemist, and the markdown table shows medians and the alchemist / llama.cpp ratio; one row per backend and
numerics mode (`--numerics` passes numerics= to load_llm; a load_llm without that keyword gets one row per
backend). JAX and MLX run `--slow-reps` repetitions (their compiles are slow). The same prompt token ids and
greedy decoding are used on both sides; decoding never stops early (no EOS check). alchemist's compile time
is reported separately and excluded from prefill/decode rates; its compiled functions are cached on disk
(PyTensor's compiledir, alchemist's graph cache), so repetitions after the first measure a warm start.

"decode % of BW" is each engine's decode speed as a fraction of this machine's memory-bandwidth limit:
decoding one token reads every weight once, so it cannot be faster than (bytes of weights read per token) /
(memory read bandwidth). Bytes per token sum the tensors a decode step reads, as that engine stores them:
GGUF block bytes for llama.cpp and wherever alchemist multiplies GGUF blocks (c, numba; jax and mlx with ggml
numerics, which call the same C kernels); float32 where it holds dequantized weights (jax and mlx, exact). A token-embedding (or position-embedding) table counts one row, except a tied
output's table, which the output projection reads in full; MoE expert tensors count n_expert_used of
n_expert. The bandwidth is measured here, with numpy: a buffer of exactly that many bytes (filled, so its
pages are resident) is cut into --threads slices, each summed as uint64 by its own thread (numpy releases
the GIL), after one warm-up pass; the best of 5 passes gives bytes / second. Same size and thread count as
the decode, so a model small enough for the caches is compared with cache bandwidth, as its decode sees.
column = decode tok/s x bytes per token / bandwidth (1.0 = at the limit).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
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


def worker_alchemist(path: str, prompt: list[int], n_gen: int, backend: str, numerics: str | None) -> dict:
    import resource

    import numpy as np

    from alchemist import load_llm

    kwargs = {"numerics": numerics} if numerics else {}
    t0 = time.perf_counter()
    model = load_llm(
        path, backend=backend, context=len(prompt) + n_gen + 8, progress=False, compile_now=False, **kwargs
    )
    load_s = time.perf_counter() - t0
    engine = model.engine
    # compile (or fetch from the on-disk caches) the two functions used below
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


def load_llm_takes_numerics() -> bool:
    """Whether this alchemist's load_llm has the numerics= keyword (older ones compute one way only)."""
    from alchemist.runtime.api import load_llm

    return "numerics" in inspect.signature(load_llm).parameters


def weight_bytes_per_token(path: str, float32: bool) -> int:
    """Bytes of weights one decode step reads (see the module docstring): GGUF block bytes, or float32 bytes."""
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf

    ir = build_model_ir(read_gguf(path))
    routers = [lay.mlp.router for lay in ir.layers if getattr(getattr(lay, "mlp", None), "router", None)]
    expert_share = routers[0].n_expert_used / routers[0].n_expert if routers else 1.0
    total = 0.0
    for t in ir.tensors:
        nbytes = 4 * math.prod(t.shape) if float32 else t.nbytes
        if t.role in ("embedding", "position_embedding") and not (ir.output.tied and t.name == ir.output.weight):
            total += nbytes / t.shape[0]  # the rows of this token (or position) only
        elif t.role == "experts":
            total += nbytes * expert_share
        else:
            total += nbytes
    return int(total)


def read_bandwidth(nbytes: int, threads: int, passes: int = 5) -> float:
    """Sequential read bandwidth (bytes/s) over an nbytes buffer, read by `threads` threads (module docstring)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    words = np.ones(max(nbytes // 8, threads), dtype=np.uint64)  # written once: every page is resident
    slices = np.array_split(words, threads)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(np.add.reduce, slices))  # warm-up
        best = math.inf
        for _ in range(passes):
            t0 = time.perf_counter()
            list(pool.map(np.add.reduce, slices))
            best = min(best, time.perf_counter() - t0)
    return words.nbytes / best


def run_worker(kind: str, path: str, prompt: list[int], n_gen: int, backend: str, threads: int,
               numerics: str | None = None) -> dict:
    payload = json.dumps({"kind": kind, "path": path, "prompt": prompt, "n_gen": n_gen, "backend": backend,
                          "threads": threads, "numerics": numerics})
    proc = subprocess.run([sys.executable, __file__, "--worker", payload], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind}/{backend} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


SLOW_BACKENDS = ("jax", "mlx")  # compiles of minutes: --slow-reps repetitions


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a GGUF path or a reference-model name (gemma-3-270m, qwen2.5-coder-0.5b)")
    ap.add_argument("--backends", default="c,numba", help="any of c,numba,jax,mlx (comma-separated)")
    ap.add_argument("--numerics", default=None,
                    help="ggml,exact or one of them: a row per backend and mode (default: load_llm's default)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slow-reps", type=int, default=1, help="repetitions for jax and mlx (at most --reps)")
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
            out = worker_alchemist(job["path"], job["prompt"], job["n_gen"], job["backend"], job.get("numerics"))
        print(json.dumps(out))
        return 0

    if args.model is None:
        ap.error("MODEL is required")
    from alchemist.models import resolve_model
    from alchemist.runtime.backends import BACKENDS, require_backend

    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"--backends: unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
        require_backend(b)  # a missing package is a clear error now, not a failed worker later
    modes: list[str | None] = [None]
    if args.numerics:
        modes = [m for m in args.numerics.split(",") if m]
        bad = [m for m in modes if m not in ("ggml", "exact")]
        if bad:
            ap.error(f"--numerics: unknown mode(s) {bad} (choose from ggml, exact)")
        if not load_llm_takes_numerics():
            print("note: this alchemist's load_llm has no numerics= keyword: one row per backend", file=sys.stderr)
            modes = [None]

    path = resolve_model(args.model)
    prompt = _prompt_ids(path, args.prompt_tokens)
    engines = [(b, m) for b in backends for m in modes]
    name = {(b, m): b if m is None else f"{b} {m}" for b, m in engines}
    runs: dict[str, list[dict]] = {"llama.cpp": [], **{name[e]: [] for e in engines}}
    for rep in range(args.reps):
        for kind in ["llama.cpp", *engines]:
            if kind != "llama.cpp" and kind[0] in SLOW_BACKENDS and rep >= args.slow_reps:
                continue
            if kind == "llama.cpp":
                res = run_worker("llama.cpp", path, prompt, args.gen_tokens, "llama.cpp", args.threads)
            else:
                res = run_worker("alchemist", path, prompt, args.gen_tokens, kind[0], args.threads, kind[1])
            label = "llama.cpp" if kind == "llama.cpp" else name[kind]
            runs[label].append(res)
            print(f"rep {rep + 1}/{args.reps} {label:11}: decode {res['decode_tok_s']:.2f} tok/s, "
                  f"prefill {res['prefill_tok_s']:.1f} tok/s", file=sys.stderr)

    # the memory-bandwidth limit, measured once per distinct weight size (GGUF blocks, float32)
    from alchemist.runtime.backends import uses_quantized_kernels

    from alchemist.runtime.numerics import DEFAULT as DEFAULT_NUMERICS

    def stores_blocks(label: str) -> bool:
        if label == "llama.cpp":
            return True
        backend, *mode = label.split()  # "jax ggml": JAX multiplies GGUF blocks with the C kernels
        return uses_quantized_kernels(backend, numerics=mode[0] if mode else DEFAULT_NUMERICS)

    per_token = {blocks: weight_bytes_per_token(path, float32=not blocks) for blocks in {stores_blocks(k) for k in runs}}
    bandwidth = {blocks: read_bandwidth(n, args.threads) for blocks, n in per_token.items()}

    metrics = ["load_s", "compile_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mb"]
    med = {k: {m: statistics.median(r[m] for r in v) for m in metrics} for k, v in runs.items() if v}
    ref = med["llama.cpp"]
    reps_of = sorted({len(v) for v in runs.values()})
    print(f"\n{os.path.basename(path)}: {len(prompt)}-token prompt, {args.gen_tokens} greedy tokens, "
          f"{args.threads} threads, median of {'/'.join(map(str, reps_of))}; memory bandwidth "
          + ", ".join(f"{bandwidth[b] / 1e9:.1f} GB/s over {per_token[b] / 1e6:.0f} MB "
                      f"({'GGUF blocks' if b else 'float32'} read per token)" for b in sorted(per_token, reverse=True)))
    cols = ["engine", "load s", "compile s", "prefill tok/s", "decode tok/s", "peak RSS MB", "decode ratio",
            "prefill ratio", "decode % of BW", "same first 16 ids"]
    rows = []
    for kind, m in med.items():
        same = runs[kind][0]["ids"] == runs["llama.cpp"][0]["ids"]
        blocks = stores_blocks(kind)
        bw_share = m["decode_tok_s"] * per_token[blocks] / bandwidth[blocks]
        rows.append([kind, f"{m['load_s']:.2f}", f"{m['compile_s']:.2f}", f"{m['prefill_tok_s']:.1f}",
                     f"{m['decode_tok_s']:.2f}", f"{m['peak_rss_mb']:.0f}", f"{m['decode_tok_s'] / ref['decode_tok_s']:.3f}",
                     f"{m['prefill_tok_s'] / ref['prefill_tok_s']:.3f}", f"{100 * bw_share:.1f}%", str(same)])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|")
    for r in rows:
        print("| " + " | ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
