"""What each engine holds in memory for one GGUF: peak RSS of alchemist's backends beside llama.cpp's.

    python benchmarks/memory.py MODEL [--engines llama.cpp,c,numba,jax,mlx] [--weights default,quantized,float32]
                                      [--context 1024] [--prompt-tokens 32] [--gen-tokens 32] [--json OUT]

Every engine runs in a fresh subprocess (peak RSS is per process): load, compile (alchemist; PyTensor's and
our graph caches make that a warm start after the first run), prefill the prompt, decode greedily. Columns:
  peak RSS     ru_maxrss of the whole run
  base         RSS after importing the engine's libraries, before any weight is read
  weights      quantized tensors mapped from the file (views of its memory map: page cache, shared by every
               process that maps the file) / held in private memory (copies, float32, framework arrays)
  KV           the KV cache alchemist allocates (context positions, float32); llama.cpp's is f16
  compile      RSS added by compiling (or loading from the caches) the decode and prefill functions
  end anon/file  RSS at the end split into anonymous (private) and file-backed (mapped) pages
  decode       greedy decode tok/s (noisy on a loaded machine; see benchmarks/compare.py for speed)
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import subprocess
import sys
import time

TEXT = "Causal inference is the process of determining the independent, actual effect of a particular phenomenon. "


def _status() -> dict:
    """RSS and its anonymous / file-backed parts now, in MB (Linux /proc)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _mapped(arr) -> bool:
    """True when a numpy array is a view of a memory map (its pages belong to the file, not to the process)."""
    import numpy as np

    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, mmap.mmap)


def worker_llama(path: str, prompt: list[int], n_gen: int, context: int) -> dict:
    import llama_cpp
    import numpy as np

    base = _status()["VmRSS"]
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=context, n_threads=os.cpu_count(), n_batch=512, verbose=False)
    load_s = time.perf_counter() - t0
    loaded = _status()["VmRSS"]
    n_vocab = llm.n_vocab()

    def greedy() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))

    llm.eval(prompt)
    ids = [greedy()]
    t1 = time.perf_counter()
    for _ in range(n_gen - 1):
        llm.eval([ids[-1]])
        ids.append(greedy())
    end = _status()
    return {
        "engine": "llama.cpp",
        "weights": "mmap",
        "peak_mb": _peak_mb(),
        "base_mb": base,
        "loaded_mb": loaded,
        "end_anon_mb": end["RssAnon"],
        "end_file_mb": end["RssFile"],
        "load_s": load_s,
        "decode_tok_s": (n_gen - 1) / (time.perf_counter() - t1),
        "ids": ids[:8],
    }


def worker_alchemist(
    path: str, prompt: list[int], n_gen: int, context: int, backend: str, weights: str, copy_blocks: bool = False
) -> dict:
    import numpy as np

    if copy_blocks:  # the behaviour before zero-copy: every quantized tensor copied out of the map
        import alchemist.kernels

        as_blocks = alchemist.kernels.as_blocks
        alchemist.kernels.as_blocks = lambda raw, ggml_type, shape, copy=True: as_blocks(raw, ggml_type, shape, copy)

    from alchemist import load_llm
    from alchemist.runtime.backends import check_weights

    if backend in ("jax", "mlx"):
        __import__("jax" if backend == "jax" else "mlx.core")  # the framework counts in the base
    import alchemist.runtime.engine  # noqa: F401  (pytensor, the kernels)

    base = _status()["VmRSS"]
    fmt = check_weights(None if weights == "default" else weights, backend)
    t0 = time.perf_counter()
    model = load_llm(path, backend=backend, context=context, progress=False, compile_now=False, weights=fmt)
    load_s = time.perf_counter() - t0
    loaded = _status()["VmRSS"]
    engine = model.engine
    held = [sv.get_value(borrow=True) for sv in engine.weights.values()]
    mapped = sum(a.nbytes for a in held if isinstance(a, np.ndarray) and _mapped(a))
    private = sum(int(a.nbytes) for a in held) - mapped
    quantized = sum(int(a.nbytes) for a in held if str(a.dtype).endswith("uint8"))
    kv = sum(int(np.prod(sv.type.shape)) * 4 for caches in engine.cache for sv in caches)
    del held
    t1 = time.perf_counter()
    engine.step_function(engine.bucket(len(prompt), 0))
    engine.step_function(1)
    compile_s = time.perf_counter() - t1
    compiled = _status()["VmRSS"]
    logits = engine.run(prompt, 0)
    ids = [int(np.argmax(logits))]
    t2 = time.perf_counter()
    for i in range(n_gen - 1):
        ids.append(int(np.argmax(engine.run([ids[-1]], len(prompt) + i))))
    decode_s = time.perf_counter() - t2
    end = _status()
    return {
        "engine": backend,
        "weights": fmt + (" (copied)" if copy_blocks else ""),
        "peak_mb": _peak_mb(),
        "base_mb": base,
        "loaded_mb": loaded,
        "weights_mapped_mb": mapped / 2**20,
        "weights_private_mb": private / 2**20,
        "weights_quantized_mb": quantized / 2**20,
        "kv_mb": kv / 2**20,
        "compile_mb": compiled - loaded,
        "end_anon_mb": end["RssAnon"],
        "end_file_mb": end["RssFile"],
        "load_s": load_s,
        "compile_s": compile_s,
        "decode_tok_s": (n_gen - 1) / decode_s,
        "ids": ids[:8],
    }


def run_worker(job: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{job['engine']} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cell(row: dict, key: str, fmt: str = "{:.0f}") -> str:
    return fmt.format(row[key]) if key in row else "-"


def table(rows: list[dict]) -> str:
    head = (
        "| engine | weights | peak RSS MB | base MB | weights mapped / private MB | KV MB | compile MB "
        "| end anon / file MB | decode tok/s |"
    )
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        w = f"{_cell(r, 'weights_mapped_mb')} / {_cell(r, 'weights_private_mb')}" if "kv_mb" in r else "mmap"
        lines.append(
            f"| {r['engine']} | {r['weights']} | {r['peak_mb']:.0f} | {r['base_mb']:.0f} | {w} "
            f"| {_cell(r, 'kv_mb', '{:.1f}')} | {_cell(r, 'compile_mb')} | {r['end_anon_mb']:.0f} / {r['end_file_mb']:.0f} "
            f"| {r['decode_tok_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a GGUF path or a reference-model name (gemma-3-270m, qwen2.5-coder-0.5b)")
    ap.add_argument("--engines", default="llama.cpp,c,numba,jax,mlx")
    ap.add_argument("--weights", default="default", help="comma-separated: default, quantized, float32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument(
        "--copy-blocks",
        action="store_true",
        help="copy quantized tensors out of the file's map (the old behaviour), to compare",
    )
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        job = json.loads(args.worker)
        if job["engine"] == "llama.cpp":
            out = worker_llama(job["path"], job["prompt"], job["n_gen"], job["context"])
        else:
            out = worker_alchemist(
                job["path"], job["prompt"], job["n_gen"], job["context"], job["engine"], job["weights"], job["copy"]
            )
        print(json.dumps(out))
        return 0

    if args.model is None:
        ap.error("MODEL is required")
    from alchemist.models import resolve_model
    from alchemist.tokenizer import load_tokenizer

    path = str(resolve_model(args.model))
    prompt = load_tokenizer(path).encode(TEXT * 8)[: args.prompt_tokens]
    rows = []
    for engine in args.engines.split(","):
        for weights in ["mmap"] if engine == "llama.cpp" else args.weights.split(","):
            job = {
                "engine": engine,
                "weights": weights,
                "path": path,
                "prompt": prompt,
                "n_gen": args.gen_tokens,
                "context": args.context,
                "copy": args.copy_blocks,
            }
            rows.append(run_worker(job))
            r = rows[-1]
            print(
                f"{engine:9} {r['weights']:9}: peak RSS {r['peak_mb']:.0f} MB, decode {r['decode_tok_s']:.2f} tok/s",
                file=sys.stderr,
            )
    print(
        f"\n{os.path.basename(path)}: context {args.context}, {len(prompt)}-token prompt, {args.gen_tokens} greedy tokens\n"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
