"""Quantized matvec kernels vs float32: `python benchmarks/kernels.py [--threads N] [--reps R] [--no-sweep]`.

Times a decode-shaped product (T=1) y = x @ W.T per GGUF type on the reference models' real shapes (real
tensors where the models have the type, random blocks with sane scales elsewhere), through compiled
PyTensor functions on the C backend and the Numba backend (alchemist.kernels.quantized_linear), against a
float32 numpy dot with the dequantized weights (what the generated modules do today). Prints per case the
best-of-R time in ms and the weight bytes read per second (quantized bytes for the kernels, float32 bytes for
the baseline). Then, unless --no-sweep, a "decode sweep": every linear weight of gemma-3-270m once (all 18
layers' q/k/v/o/gate/up/down plus the tied 262144x640 logits projection), i.e. the matvec work of one
decode step, C kernels vs float32 numpy. Ends with a one-line summary.

Threads: --threads sets OMP_NUM_THREADS, NUMBA_NUM_THREADS and OPENBLAS_NUM_THREADS before anything loads
(default: leave them as they are). Best-of-R timing is used because the machine may be shared.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-sweep", action="store_true", help="skip the whole-model decode sweep")
    ap.add_argument("--no-numba", action="store_true")
    ap.add_argument("--e2e", action="store_true", help="only the end-to-end demo of the proposed template change")
    ap.add_argument("--e2e-backend", default="c")
    ap.add_argument("--e2e-tokens", type=int, default=16)
    return ap.parse_args(argv)


# The proposed template change, applied to a generated module's text (see kernel_module()).
KERNEL_HELPERS = '''

# Quantized weights of these types stay in GGUF blocks (uint8 (n_out, row_bytes)) when load_weights is asked
# to; the graph then multiplies them with alchemist.kernels (C / Numba kernels; JAX / MLX dequantize per call).
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def project(x, w, name):
    """x @ W.T for the weight `name`: the quantized kernel when it stayed in GGUF blocks, else linear()."""
    if w[name].dtype == "uint8":
        ggml_type, (n_out, n_in) = TENSORS[name][0], TENSORS[name][1]
        return quantized_linear(x, w[name], ggml_type, n_out, n_in)
    return linear(x, w[name])


def embed(w, tokens):
    """Token embedding rows (dequantized exactly when token_embd stayed in GGUF blocks)."""
    if w["token_embd.weight"].dtype == "uint8":
        ggml_type = TENSORS["token_embd.weight"][0]
        return quantized_embedding(w["token_embd.weight"], tokens, ggml_type, N_VOCAB, N_EMBD)
    return w["token_embd.weight"][tokens]
'''


def kernel_module(text: str) -> str:
    """The generated module with the proposed change: load_weights(path, progress, quantized=True) keeps
    KERNEL_TYPES matrices as GGUF blocks; projections go through project(), the embedding through embed()."""
    import re

    def sub(old, new, count=1):
        nonlocal text
        assert old in text, old
        text = text.replace(old, new, count)

    sub(
        "from gguf.quants import dequantize\n",
        "from gguf.quants import dequantize\n\nfrom alchemist.kernels import as_blocks, quantized_embedding, quantized_linear\n",
    )
    sub(
        "def load_weights(path, progress=None) -> dict:",
        "def load_weights(path, progress=None, quantized=False) -> dict:",
    )
    sub(
        "        weights[name] = dequantize_tensor(data[start : start + nbytes], ggml_type, shape)\n",
        "        if quantized and ggml_type in KERNEL_TYPES and len(shape) == 2:\n"
        "            weights[name] = as_blocks(data[start : start + nbytes], ggml_type, shape)\n"
        "        else:\n"
        "            weights[name] = dequantize_tensor(data[start : start + nbytes], ggml_type, shape)\n",
    )
    sub('x = w["token_embd.weight"][tokens]', "x = embed(w, tokens)")
    text, n = re.subn(r"linear\((\w+(?:\(\w+\) \* \w+)?), w\[([^\]]+)\]\)", r"project(\1, w, \2)", text)
    assert n >= 8, n
    sub("\n\ndef rms_norm(", KERNEL_HELPERS + "\n\ndef rms_norm(")
    return text


def e2e(args) -> None:
    """Generated gemma module, float32 weights vs the proposed kernel path, on one backend: logits agreement
    and decode time per token (prefill 8 tokens, then greedy decode steps)."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from alchemist.models import reference_model_path
    from alchemist.runtime.engine import Engine, import_generated

    src = Path(__file__).resolve().parent.parent / "generated" / "gemma_3_270m_q4_k_m.py"
    gguf = reference_model_path("gemma-3-270m")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "gemma_kernels.py").write_text(kernel_module(src.read_text()))
    results = {}
    prompt = [2, 818, 5279, 529, 7001, 563, 496, 7217]  # 8 token ids
    reference_tokens = None
    for label, path, quantized in (("float32", src, False), ("kernels", tmp / "gemma_kernels.py", True)):
        module = import_generated(path)
        t0 = time.perf_counter()
        weights = module.load_weights(gguf, quantized=True) if quantized else module.load_weights(gguf)
        t_load = time.perf_counter() - t0
        n_bytes = sum(w.nbytes for w in weights.values())
        engine = Engine(module, weights, args.e2e_backend, capacity=64)
        t0 = time.perf_counter()
        logits = [engine.run(prompt, 0)]
        engine.run([prompt[-1]], len(prompt) - 1)  # compiles the 1-token step (result unused)
        engine.reset()
        logits = [engine.run(prompt, 0)]
        t_compile = time.perf_counter() - t0
        tokens = reference_tokens or []
        steps = []
        for i in range(args.e2e_tokens):
            nxt = int(np.argmax(logits[-1])) if reference_tokens is None else reference_tokens[i]
            if reference_tokens is None:
                tokens.append(nxt)
            t0 = time.perf_counter()
            logits.append(engine.run([nxt], len(prompt) + i))
            steps.append(time.perf_counter() - t0)
        reference_tokens = tokens
        results[label] = (
            np.stack([np.asarray(l).reshape(-1) for l in logits]),
            sorted(steps)[len(steps) // 2],
            t_load,
            t_compile,
            n_bytes,
        )
        del engine, weights
    (ref, t_ref, load_ref, comp_ref, b_ref), (got, t_k, load_k, comp_k, b_k) = results["float32"], results["kernels"]
    rel = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    agree = np.mean(np.argmax(got, axis=1) == np.argmax(ref, axis=1))
    print(
        f"e2e gemma-3-270m on {args.e2e_backend}: weights {b_ref / 1e6:.0f} MB -> {b_k / 1e6:.0f} MB, load "
        f"{load_ref:.1f} s -> {load_k:.1f} s, compile {comp_ref:.1f} s / {comp_k:.1f} s; decode median "
        f"{t_ref * 1e3:.1f} ms -> {t_k * 1e3:.1f} ms per token ({t_ref / t_k:.2f}x); logits max |diff| / max |ref| "
        f"{rel:.2e}, argmax agreement {agree:.0%} over {len(ref)} positions"
    )


# (label, model or None for random blocks, tensor name, ggml type, (n_out, n_in))
CASES = [
    ("gemma ffn_gate", "gemma-3-270m", "blk.0.ffn_gate.weight", "Q5_0", (2048, 640)),
    ("gemma attn_v", "gemma-3-270m", "blk.0.attn_v.weight", "Q8_0", (256, 640)),
    ("gemma logits (token_embd)", "gemma-3-270m", "token_embd.weight", "Q8_0", (262144, 640)),
    ("gemma attn_output", "gemma-3-270m", "blk.0.attn_output.weight", "Q4_K", (640, 1024)),
    ("gemma ffn_down", "gemma-3-270m", "blk.0.ffn_down.weight", "Q6_K", (640, 2048)),
    ("qwen ffn_up", "qwen2.5-coder-0.5b", "blk.0.ffn_up.weight", "Q5_0", (4864, 896)),
    ("qwen ffn_down", "qwen2.5-coder-0.5b", "blk.0.ffn_down.weight", "Q6_K", (896, 4864)),
    ("qwen logits (output)", "qwen2.5-coder-0.5b", "output.weight", "Q8_0", (151936, 896)),
    ("random", None, None, "Q4_0", (2048, 640)),
    ("random", None, None, "Q4_1", (2048, 640)),
    ("random", None, None, "Q5_1", (2048, 640)),
    ("random", None, None, "Q2_K", (640, 2048)),
    ("random", None, None, "Q3_K", (640, 2048)),
    ("random", None, None, "Q5_K", (640, 2048)),
]
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q5_K": (0, 2)}


def random_blocks(rng, ggml_type, n_out, n_in):
    import numpy as np

    from alchemist.kernels import BLOCK_SIZES

    qk, bs = BLOCK_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(n_out, n_in // qk, bs), dtype=np.uint8)
    for off in SCALE_FIELDS[ggml_type]:
        d = (rng.standard_normal(blocks.shape[:2]) * 0.01).astype(np.float16)
        blocks[:, :, off : off + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(n_out, -1)


def best_of(fn, reps):
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    from alchemist.runtime.backends import blas_info, get_mode
    from alchemist.pytensor_ext.host import configure_pytensor

    configure_pytensor()
    if args.e2e:
        e2e(args)
        return 0
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    from alchemist.gguf_io import read_gguf
    from alchemist.kernels import as_blocks, quantized_linear, row_bytes
    from alchemist.kernels.formats import reference_dequantize
    from alchemist.models import reference_model_path

    backends = ["c"] + ([] if args.no_numba else ["numba"])
    facts = {}
    rng = np.random.default_rng(0)
    functions = {}

    def kernel_fn(backend, ggml_type, n_out, n_in):
        key = (backend, ggml_type, n_out, n_in)
        if key not in functions:
            x = pt.matrix("x", dtype="float32", shape=(1, n_in))
            w = pt.matrix("w", dtype="uint8", shape=(n_out, row_bytes(ggml_type, n_in)))
            functions[key] = pytensor.function(
                [x, w], quantized_linear(x, w, ggml_type, n_out, n_in), mode=get_mode(backend)
            )
        return functions[key]

    threads = {v: os.environ.get(v, "-") for v in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    print(f"# {os.cpu_count()} CPUs, threads {threads}, BLAS {blas_info()}, best of {args.reps}")
    print(
        f"{'case':27} {'type':5} {'n_out x n_in':>13} {'MB q':>7} "
        + " ".join(f"{b + ' ms':>9} {b + ' GB/s':>10}" for b in backends)
        + f" {'f32 ms':>9} {'f32 GB/s':>9} "
        + " ".join(f"{'x f32 ' + b:>10}" for b in backends)
    )
    ratios = {b: [] for b in backends}
    for label, model, name, ggml_type, (n_out, n_in) in CASES:
        if model is not None:
            if model not in facts:
                facts[model] = read_gguf(reference_model_path(model))
            info = facts[model].tensors[name]
            assert info.ggml_type == ggml_type and tuple(info.shape) == (n_out, n_in), (name, info)
            raw = np.array(as_blocks(facts[model].tensor_bytes(name), ggml_type, info.shape))
        else:
            raw = random_blocks(rng, ggml_type, n_out, n_in)
        weights = reference_dequantize(raw, ggml_type)
        x = rng.standard_normal((1, n_in)).astype(np.float32)
        ref = x @ weights.T
        cells, times = [], {}
        for b in backends:
            f = kernel_fn(b, ggml_type, n_out, n_in)
            y = f(x, raw)
            err = float(np.max(np.abs(y - ref)) / (np.max(np.abs(x) @ np.abs(weights).T) + 1e-30))
            assert err < 1e-5, (b, ggml_type, err)
            times[b] = best_of(lambda: f(x, raw), args.reps)
            cells.append(f"{times[b] * 1e3:9.3f} {raw.nbytes / times[b] / 1e9:10.2f}")
        t32 = best_of(lambda: x @ weights.T, args.reps)
        for b in backends:
            ratios[b].append(t32 / times[b])
        print(
            f"{label:27} {ggml_type:5} {f'{n_out}x{n_in}':>13} {raw.nbytes / 1e6:7.2f} "
            + " ".join(cells)
            + f" {t32 * 1e3:9.3f} {weights.nbytes / t32 / 1e9:9.2f} "
            + " ".join(f"{t32 / times[b]:9.2f}x" for b in backends)
        )
        del weights
    geo = {b: math.exp(sum(map(math.log, r)) / len(r)) for b, r in ratios.items()}

    sweep = ""
    if not args.no_sweep:
        gemma = facts.get("gemma-3-270m") or read_gguf(reference_model_path("gemma-3-270m"))
        linear = [(n, i) for n, i in gemma.tensors.items() if i.ggml_type != "F32" and len(i.shape) == 2]
        raws = {n: np.array(as_blocks(gemma.tensor_bytes(n), i.ggml_type, i.shape)) for n, i in linear}
        xs = {n_in: rng.standard_normal((1, n_in)).astype(np.float32) for n_in in {i.shape[1] for _, i in linear}}
        fns = [(kernel_fn("c", i.ggml_type, *i.shape), xs[i.shape[1]], raws[n]) for n, i in linear]

        def run_c():
            for f, x, w in fns:
                f(x, w)

        t_c = min(best_of(run_c, 3) for _ in range(1))
        q_bytes = sum(r.nbytes for r in raws.values())
        del raws
        f32 = [
            (
                reference_dequantize(np.array(as_blocks(gemma.tensor_bytes(n), i.ggml_type, i.shape)), i.ggml_type),
                xs[i.shape[1]],
            )
            for n, i in linear
        ]

        def run_f32():
            for w, x in f32:
                x @ w.T

        t_f = best_of(run_f32, 3)
        f_bytes = sum(w.nbytes for w, _ in f32)
        del f32
        print(
            f"decode sweep, gemma-3-270m, {len(linear)} weights: C kernels {t_c * 1e3:.1f} ms ({q_bytes / 1e6:.0f} MB, "
            f"{q_bytes / t_c / 1e9:.1f} GB/s) vs float32 numpy {t_f * 1e3:.1f} ms ({f_bytes / 1e6:.0f} MB, "
            f"{f_bytes / t_f / 1e9:.1f} GB/s): {t_f / t_c:.2f}x"
        )
        sweep = f"; gemma decode-step matvecs C {t_c * 1e3:.1f} ms vs float32 {t_f * 1e3:.1f} ms ({t_f / t_c:.2f}x)"
    print(
        "summary: T=1 speed vs float32 numpy, geometric mean over cases: "
        + ", ".join(f"{b} {g:.2f}x" for b, g in geo.items())
        + sweep
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
