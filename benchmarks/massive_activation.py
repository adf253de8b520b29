"""Which numerics is closer to the model's own F32 arithmetic when the residual stream has a massive activation?

    python benchmarks/massive_activation.py [--factor 1000] [--types Q8_0,Q4_K] [--backend c]

A tiny qwen2 fixture (alchemist.fixtures), and the same fixture with one massive channel at position 0 (the
first token's embedding carries one channel `factor` times the others: add_massive_activation), quantized by
llama.cpp to each type. The reference is llama.cpp on the F32 file: F32 weights multiply exact activations, so
no activation rounding applies there. Against it: alchemist on the quantized file with numerics "exact"
(dequantized weights x exact activations) and "ggml" (activations rounded as llama.cpp's CPU backend does), and
llama.cpp itself on the quantized file. Weight quantization is common to all three; what differs is what each
does to the activations. Prints a table: logits NMSE and mean KL against the F32 reference over the prompt, the
KL at position 0 alone, and the NMSE against llama.cpp on the quantized file.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]  # token 1 stands only at position 0
CHANNEL = 7


def _ours(path: str, numerics: str, backend: str) -> tuple[np.ndarray, float]:
    """Our logits of PROMPT, and the ratio of the largest |value| of layer 0's output at position 0 to its median."""
    from alchemist.harness.validate import load_for_validation, tap_values
    from alchemist.runtime.engine import Engine

    loaded = load_for_validation(path, numerics=numerics)
    engine = Engine(loaded.module, loaded.weights_for(backend), backend, 64)
    logits = engine.run(PROMPT, 0, all_logits=True)
    row = np.abs(tap_values(engine, PROMPT)["l_out-0"].reshape(len(PROMPT), -1)[0])
    return logits, float(row.max() / np.median(row))


def _llama(path: str) -> np.ndarray:
    from alchemist.harness import LlamaCppOracle

    with LlamaCppOracle(path, n_ctx=64, n_threads=1) as oracle:
        return oracle.logits(PROMPT)


def run(factor: float, types: list[str], backend: str, workdir: Path) -> list[dict]:
    from alchemist.fixtures import add_massive_activation, write_fixture
    from alchemist.harness import kl_divergence, nmse, quantize_fixture

    rows = []
    for case in ("control", "massive"):
        f32 = write_fixture(workdir / f"qwen2-{case}-F32.gguf", "qwen2")
        if case == "massive":
            add_massive_activation(f32, PROMPT[0], CHANNEL, factor)
        reference = _llama(str(f32))
        for wtype in types:
            path = workdir / f"qwen2-{case}-{wtype}.gguf"
            quantize_fixture(f32, path, wtype, nthread=1)
            theirs = _llama(str(path))
            candidates = {"llama.cpp": (theirs, None)}
            for numerics in ("exact", "ggml"):
                candidates[f"alchemist {numerics}"] = _ours(str(path), numerics, backend)
            for who, (logits, spike) in candidates.items():
                kl = kl_divergence(reference, logits)
                rows.append(
                    {
                        "fixture": case,
                        "type": wtype,
                        "who": who,
                        "nmse_vs_f32": nmse(logits, reference),
                        "kl_vs_f32": float(np.mean(kl)),
                        "kl_pos0_vs_f32": float(kl[0]),
                        "nmse_vs_llamacpp": nmse(logits, theirs),
                        "spike": spike,
                    }
                )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| fixture | weights | computed by | logits NMSE vs F32 | mean KL vs F32 | KL at position 0 | NMSE vs llama.cpp (same file) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['fixture']} | {r['type']} | {r['who']} | {r['nmse_vs_f32']:.3e} | {r['kl_vs_f32']:.3e} | "
            f"{r['kl_pos0_vs_f32']:.3e} | {r['nmse_vs_llamacpp']:.3e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=float, default=1000.0, help="the massive channel over the row's RMS")
    parser.add_argument("--types", default="Q8_0,Q4_K")
    parser.add_argument("--backend", default="c")
    parser.add_argument("--workdir", default=None, help="keep the fixture files here (default: a temporary dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        rows = run(args.factor, args.types.split(","), args.backend, workdir)
    spikes = {r["fixture"]: r["spike"] for r in rows if r["spike"] is not None}
    print(
        f"layer 0's output at position 0, max |x| / median |x|: control {spikes['control']:.0f}, "
        f"massive {spikes['massive']:.0f} (factor {args.factor:g}, channel {CHANNEL})"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
