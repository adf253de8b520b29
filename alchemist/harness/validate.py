"""`alchemist validate` and `alchemist diff`: our generated model against llama.cpp, with fixed thresholds.

Validation runs, per backend: all-position prompt logits vs the oracle; greedy generation in which every
one of our prefixes is re-scored by the oracle ("fresh-prefix decisions"); for exact-weight files (all
matrices F32/F16) the NMSE of every layer output. The thresholds below are the bar; they are not
parameters to loosen. The bar, for a model computing with numerics "ggml" or "exact" alike:
- the prompt: top-1 agrees at every position (near-ties of the oracle aside, top-2 gap < near_tie); exact
  weights: logits NMSE <= exact_nmse and every layer output too; quantized: mean KL <= mean_kl and mean
  Pearson >= mean_pearson;
- greedy: every fresh-prefix disagreement is a within-noise tie (the oracle prefers its token over ours by
  less than the largest |Δ logit| between the two implementations at that step; metrics.greedy_agreement).
A validation with numerics "exact" that fails is validated again with "ggml" (attribute_to_rounding): the report
says whether llama.cpp's activation rounding explains the difference, with per-layer evidence.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from alchemist.errors import AlchemistError
from alchemist.harness.metrics import compare_logits, first_divergence, greedy_agreement, nmse
from alchemist.harness.oracle_build import arithmetic
from alchemist.runtime.backends import mlx_packed, uses_quantized_kernels
from alchemist.runtime.numerics import resolve_numerics

THRESHOLDS = {
    "near_tie": 1e-3,  # oracle top-2 gap below which a prompt top-1 disagreement is a reported near-tie
    "exact_nmse": 1e-6,  # F32/F16 weights: logits and every layer output
    "mean_kl": 0.02,  # quantized weights: mean KL(oracle || ours) in nats
    "mean_pearson": 0.999,  # quantized weights: mean Pearson correlation of the logits
}
ROUNDING_EXPLAINED = "explained by llama.cpp's activation rounding"
ROUNDING_NOT_EXPLAINED = "not explained by llama.cpp's activation rounding"
EXACT_TYPES = {"F32", "F16"}
DIFF_QUANTIZED_TOL = 1e-2  # `alchemist diff` on quantized weights: llama.cpp's activation rounding alone is ~1e-4
DEFAULT_PROMPT = "What's causal inference? Causal inference is the study of how"


def is_exact(ir) -> bool:
    """True when every weight matrix is F32/F16: llama.cpp then multiplies without quantizing activations."""
    return all(t.ggml_type in EXACT_TYPES for t in ir.tensors)


@dataclass
class LoadedForValidation:
    path: str
    ir: object
    module: object  # the generated module
    numerics: str = "exact"  # what its engines compute with (alchemist.runtime.numerics)
    devices: int = 1  # JAX engines split over this many devices (alchemist.runtime.sharding)
    # quantized (bool) -> load_weights(path, quantized=...); ("split", quantized) -> (Placement, sharded weights)
    _weights: dict = field(default_factory=dict)

    def engine(self, backend: str, capacity: int, quantized: bool | None = None):
        """An Engine of this module on `backend` computing with this file's numerics (weights as weights_for);
        on JAX split over `devices` devices."""
        from alchemist.runtime.engine import Engine

        if backend == "jax" and self.devices > 1:
            placement, weights = self._split_weights(self._quantized(backend, quantized))
            return Engine(self.module, weights, backend, capacity, numerics=self.numerics, placement=placement)
        return Engine(self.module, self.weights_for(backend, quantized), backend, capacity, numerics=self.numerics)

    def _quantized(self, backend: str, quantized: bool | None) -> bool:
        """GGUF blocks where kernels multiply them (C, Numba; JAX and MLX with numerics="ggml"), unless
        quantized=False asks for float32."""
        packed = mlx_packed(self.ir)
        return uses_quantized_kernels(backend, numerics=self.numerics, mlx_packed=packed) and quantized is not False

    def weights_for(self, backend: str, quantized: bool | None = None) -> dict:
        """The weights as `backend` runs them with this module's numerics (_quantized says in which form)."""
        quantized = self._quantized(backend, quantized)
        if quantized not in self._weights:
            self._weights[quantized] = self.module.load_weights(self.path, quantized=quantized)
        return self._weights[quantized]

    def _split_weights(self, quantized: bool) -> tuple:
        """(Placement over `devices` JAX devices, the weights cut as it says), read once."""
        from alchemist.runtime import sharding

        key = ("split", quantized)
        if key not in self._weights:
            placement = sharding.Placement.of(self.ir, self.devices, sharding.default_policy(self.numerics))
            weights = sharding.load_sharded(self.module, self.path, placement.layout, placement.mesh, quantized)
            self._weights[key] = placement, weights
        return self._weights[key]


def load_for_validation(
    path: str, generated_dir=None, llamacpp_rounding: bool = False, numerics: str = "exact"
) -> LoadedForValidation:
    """The generated module and weights for `path`, computing with `numerics` (alchemist.runtime.numerics;
    llamacpp_rounding=True is numerics="ggml"). "exact" by default here, the harness's building block: one
    exact engine can be shared by a fixture's files of every weight type (validate_backend(engine=...)), a
    "ggml" one rounds as its own file's weight types say. validate_model and diff_model default to "ggml"."""
    from alchemist.arch import build_model_ir
    from alchemist.reading import read_model
    from alchemist.runtime.api import generated_cache_dir, write_generated
    from alchemist.runtime.engine import import_generated

    numerics = resolve_numerics(None if llamacpp_rounding else numerics, llamacpp_rounding)
    ir = build_model_ir(read_model(path))  # a GGUF file or a snapshot directory
    module = import_generated(write_generated(ir, generated_dir or generated_cache_dir()))
    return LoadedForValidation(str(path), ir, module, numerics)


def _greedy(engine, prompt: list[int], n: int, rows: list | None = None) -> list[int]:
    """n greedy tokens after `prompt`; the logits behind each choice are appended to `rows` when given.

    The prompt goes through the all-logits function the prompt comparison already compiled (its last row is
    the same position's logits), so validation compiles two step functions per backend, not three."""
    engine.reset()
    logits = engine.run(prompt, 0, all_logits=True)[-1]
    out = [int(np.argmax(logits))]
    for i in range(n):
        if rows is not None:
            rows.append(np.asarray(logits, np.float32).reshape(-1))
        if i == n - 1:
            break
        logits = engine.run([out[-1]], len(prompt) + i)
        out.append(int(np.argmax(logits)))
    return out


def _nan_to_none(values) -> list:
    return [None if not np.isfinite(v) else float(v) for v in values]


def per_position(metrics, near_tie=None) -> dict:
    """The per-position series the validation chart draws (JSON-able); `near_tie` overrides the metrics' own
    flags (greedy steps judge a disagreement by the oracle's margin over our token, not its top-2 gap)."""
    return {
        "kl": [float(v) for v in metrics.kl],
        "pearson": _nan_to_none(metrics.pearson),
        "top10_overlap": [int(v) for v in metrics.top10_overlap],
        "top1_agree": [bool(v) for v in metrics.top1_agree],
        "near_tie": [bool(v) for v in (metrics.near_tie if near_tie is None else near_tie)],
    }


def _greedy_ties(n_steps: int, agreement) -> np.ndarray:
    """Per step: a disagreement that is a within-noise tie (the chart marks those like near-ties)."""
    flags = np.zeros(n_steps, bool)
    for d in agreement.disagreements:
        flags[d["step"]] = d["tie"]
    return flags


def tap_values(engine, prompt: list[int]) -> dict:
    """Every named intermediate (llama.cpp's names) of a fresh evaluation of `prompt`."""
    names, fn = engine.taps_function(len(prompt))
    values = fn(np.array(prompt, np.int64), np.int64(0), np.int64(len(prompt)))
    return dict(zip(names, (np.asarray(v) for v in values)))


def layer_nmse(engine, oracle, prompt: list[int]) -> dict:
    """NMSE of every named intermediate we compute against llama.cpp's tensor of the same name."""
    ours = tap_values(engine, prompt)
    order, theirs = oracle.shared_intermediates(prompt, ours)
    report = first_divergence(ours, theirs, order, tol=THRESHOLDS["exact_nmse"])
    per_tensor = {n: float(nmse(ours[n], theirs[n])) for n in order if n in theirs}
    divergent = report.nmse.get(report.name) if report.name else None
    return {"order": order, "nmse": per_tensor, "first_divergence": report.name, "divergent_nmse": divergent}


def validate_backend(
    loaded: LoadedForValidation,
    backend: str,
    oracle,
    prompt: list[int],
    n_generate: int,
    context: int,
    engine=None,
    quantized: bool | None = None,
    layers: bool = True,
) -> dict:
    """Validate one backend. Pass `engine` to reuse its compiled functions: its weights are replaced by
    `loaded.weights_for(backend)`, which must have the same names, dtypes and shapes (e.g. the same fixture
    at another weight type that the backend also runs as float32). With exact weights every layer's output is
    compared too (one more compiled function, which returns every intermediate) unless `layers` is False."""

    exact = is_exact(loaded.ir)
    t0 = time.perf_counter()
    if engine is None:
        engine = loaded.engine(backend, context, quantized)
    else:
        _check_shared_engine(engine, loaded)
        engine.set_weights(loaded.weights_for(backend, quantized))
    ours = engine.run(prompt, 0, all_logits=True)
    ref = oracle.logits(prompt)
    metrics = compare_logits(ours, ref, near_tie=THRESHOLDS["near_tie"])
    failures = []
    if metrics.decisive_disagreements:
        failures.append(f"prompt top-1 differs at positions {metrics.decisive_disagreements} (not near-ties)")
    logits_nmse = float(nmse(ours, ref))
    if exact and logits_nmse > THRESHOLDS["exact_nmse"]:
        failures.append(f"logits NMSE {logits_nmse:.3g} > {THRESHOLDS['exact_nmse']}")
    if not exact:
        if metrics.mean_kl > THRESHOLDS["mean_kl"]:
            failures.append(f"mean KL {metrics.mean_kl:.4g} > {THRESHOLDS['mean_kl']}")
        if metrics.mean_pearson < THRESHOLDS["mean_pearson"]:
            failures.append(f"mean Pearson {metrics.mean_pearson:.5f} < {THRESHOLDS['mean_pearson']}")
    result = {
        "backend": backend,
        "numerics": loaded.numerics,
        "exact_weights": exact,
        # GGUF blocks (uint8) or MLX-packed rows (uint32), as numpy, JAX or MLX arrays
        "quantized_kernels": any(
            str(v.dtype).rsplit(".", 1)[-1] in ("uint8", "uint32") for v in engine_weights(engine)
        ),
        "prompt_tokens": len(prompt),
        "prompt": {**metrics.summary(), "logits_nmse": logits_nmse},
        "positions": {"prompt": per_position(metrics)},
    }
    if n_generate:
        our_rows: list = []
        generated = _greedy(engine, prompt, n_generate, our_rows)  # compiles decode
        compiles_before = engine.stats.compile_count
        if _greedy(engine, prompt, n_generate) != generated:
            failures.append("greedy generation is not deterministic across two runs")
        rescored = oracle.rescore(prompt, generated)
        ours_rows = np.stack(our_rows)
        agreement = greedy_agreement(generated, rescored, near_tie=THRESHOLDS["near_tie"], our_logits=ours_rows)
        steps = compare_logits(ours_rows, rescored, near_tie=THRESHOLDS["near_tie"])
        result["positions"]["generated"] = per_position(steps, _greedy_ties(len(generated), agreement))
        for d in agreement.untied:
            failures.append(
                f"greedy step {d['step']}: ours {d['ours']}, oracle {d['oracle']}; the oracle's margin "
                f"{d['oracle_margin']:.3g} >= max |Δlogit| {d['max_abs_delta']:.3g} there: not a within-noise tie"
            )
        result["greedy"] = {
            "token_ids": generated,
            "n_agree": agreement.n_agree,
            "n_steps": agreement.n_steps,
            "n_ties": len(agreement.disagreements) - len(agreement.untied),
            "disagreements": agreement.disagreements,
            "first_divergence": str(agreement) if not agreement.all_agree else None,
            "recompiles_second_run": engine.stats.compile_count - compiles_before,
        }
    if exact and layers:
        compared = layer_nmse(engine, oracle, prompt)
        worst = max(compared["nmse"].values()) if compared["nmse"] else 0.0
        if compared["first_divergence"]:
            failures.append(
                f"layer outputs: first divergence at {compared['first_divergence']} "
                f"(NMSE {compared['divergent_nmse']:.3g})"
            )
        result["layers"] = {
            "n_compared": len(compared["nmse"]),
            "max_nmse": worst,
            "first_divergence": compared["first_divergence"],
        }
    result["compile_count"] = engine.stats.compile_count
    result["compile_s"] = round(engine.stats.compile_seconds, 2)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["failures"] = failures
    result["passed"] = not failures
    return result


def _check_shared_engine(engine, loaded: LoadedForValidation) -> None:
    """An engine passed to validate_backend must compute with `loaded`'s numerics: "ggml" rounds by the weight
    types of its own file, so its engine cannot be reused for a file of other weight types."""
    ours, theirs = engine.numerics, loaded.numerics

    def types(module) -> dict:
        return {name: spec[0] for name, spec in module.TENSORS.items()}

    if ours != theirs or (ours != "exact" and types(engine.module) != types(loaded.module)):
        raise AlchemistError(
            f"validate_backend: the engine computes with numerics={ours!r} for its own file's weight types, "
            f"{loaded.path} needs numerics={theirs!r} for its own; share engines across weight types with "
            "load_for_validation(..., numerics='exact')"
        )


def attribute_to_rounding(
    path: str, backend: str, oracle, prompt: list[int], n_generate: int, context: int, quantized: bool | None = None
) -> dict:
    """Does llama.cpp's activation rounding explain why `path` fails validation with numerics "exact"?

    Validates again with numerics "ggml" (llama.cpp's rounding computed in our graph): explained when that
    passes the bar. The evidence: every layer output (l_out-N) of the prompt, NMSE against llama.cpp's with
    both numerics, and the first layer where exact exceeds exact_nmse.
    """

    exact_loaded = load_for_validation(path, numerics="exact")
    ggml_loaded = load_for_validation(path, numerics="ggml")
    ggml = validate_backend(ggml_loaded, backend, oracle, prompt, n_generate, context, quantized=quantized)
    size = max(context, len(prompt) + 1)
    ours = {}
    for loaded in (exact_loaded, ggml_loaded):
        engine = loaded.engine(backend, size, quantized)
        ours[loaded.numerics] = tap_values(engine, prompt)
    order, theirs = oracle.shared_intermediates(prompt, ours["exact"])
    names = [n for n in order if n.startswith("l_out-")] or order  # the layer outputs (else every shared tensor)
    layers = [
        {
            "tensor": n,
            "exact_nmse": float(nmse(ours["exact"][n], theirs[n])),
            "ggml_nmse": float(nmse(ours["ggml"][n], theirs[n])),
        }
        for n in names
        if n in theirs and n in ours["ggml"]
    ]
    first = next((row for row in layers if row["exact_nmse"] > THRESHOLDS["exact_nmse"]), None)
    explained = bool(ggml["passed"])
    return {
        "explained": explained,
        "verdict": ROUNDING_EXPLAINED if explained else ROUNDING_NOT_EXPLAINED,
        "ggml": {
            "passed": ggml["passed"],
            "failures": ggml["failures"],
            "mean_kl": ggml["prompt"]["mean_kl"],
            "mean_pearson": ggml["prompt"]["mean_pearson"],
            "logits_nmse": ggml["prompt"]["logits_nmse"],
            "greedy": f"{ggml['greedy']['n_agree']}/{ggml['greedy']['n_steps']}" if "greedy" in ggml else None,
        },
        "layers": layers,
        "first_exact_divergence": first["tensor"] if first else None,
        "first_exact_divergence_nmse": first["exact_nmse"] if first else None,
        "ggml_nmse_there": first["ggml_nmse"] if first else None,
    }


def attribution_text(attribution: dict) -> str:
    """One line: the verdict and its headline evidence."""
    g = attribution["ggml"]
    line = f"{attribution['verdict']}: with numerics ggml {'PASS' if g['passed'] else 'FAIL'}"
    line += f" (mean KL {g['mean_kl']:.3g}"
    line += f", greedy {g['greedy']})" if g["greedy"] else ")"
    if attribution["first_exact_divergence"]:
        line += (
            f"; exact first diverges at {attribution['first_exact_divergence']} (NMSE "
            f"{attribution['first_exact_divergence_nmse']:.3g}, ggml {attribution['ggml_nmse_there']:.3g})"
        )
    if not g["passed"]:
        line += "; ggml still fails: " + "; ".join(g["failures"])
    return line


def engine_weights(engine) -> list:
    return [sv.get_value(borrow=True) for sv in engine.weights.values()]


SNAPSHOT_PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]  # ids: a snapshot's tokenizer is not read


def prompt_ids_for(path: str, text: str | None, n_vocab: int | None = None) -> list[int]:
    """The prompt's ids by the model's own tokenizer; a snapshot without tokenizer.json: fixed ids (mod n_vocab)."""
    from alchemist.snapshot import is_snapshot
    from alchemist.snapshot.tokenizer import load_snapshot_tokenizer
    from alchemist.tokenizer import load_tokenizer

    if is_snapshot(path):
        tokenizer = load_snapshot_tokenizer(path)
        if tokenizer is not None:
            return tokenizer.encode(text or DEFAULT_PROMPT)
        if text is not None:
            raise AlchemistError(f"{path}: the snapshot has no tokenizer.json; give token ids (--tokens)")
        return [i % (n_vocab or 1 << 30) for i in SNAPSHOT_PROMPT]
    return load_tokenizer(path).encode(text or DEFAULT_PROMPT)


def validate_model(
    path: str,
    backends: list[str],
    prompt: list[int] | None = None,
    n_generate: int = 32,
    context: int = 256,
    n_threads: int | None = None,
    progress=print,
    llamacpp_rounding: bool = False,
    numerics: str | None = None,
    oracle: str = "llama.cpp",
    gguf: str | None = None,
    devices: int = 1,
) -> dict:
    """Validate `path` on each backend computing with `numerics` (default "ggml"; llamacpp_rounding=True is
    the older spelling of "ggml"); an "exact" backend that fails gets an attribution (attribute_to_rounding).
    `oracle`: "llama.cpp" (a GGUF file), or "mlx-lm" (a snapshot directory: logits and greedy steps, exact
    numerics, no named intermediates). `gguf`: with mlx-lm, the snapshot's GGUF conversion: the prompt's logits of
    alchemist (the first backend), mlx-lm and llama.cpp compared pairwise (report["three_way"]). `devices`: the
    jax backend's model split over that many devices."""
    from alchemist.harness.mlx_oracle import MlxLmOracle
    from alchemist.harness.oracle import LlamaCppOracle

    if oracle not in ("llama.cpp", "mlx-lm"):
        raise AlchemistError(f"unknown oracle {oracle!r} (llama.cpp or mlx-lm)")
    mlx = oracle == "mlx-lm"
    numerics = "exact" if mlx else resolve_numerics(numerics, llamacpp_rounding)  # mlx-lm rounds no activations
    loaded = load_for_validation(path, numerics=numerics)
    loaded.devices = devices
    prompt = prompt if prompt is not None else prompt_ids_for(path, None, loaded.ir.n_vocab)
    context = max(context, len(prompt) + n_generate + 1)
    report = {
        "model": loaded.ir.model_name,
        "source_file": loaded.ir.source_file,
        "source_sha256": loaded.ir.source_sha256,
        "architecture": loaded.ir.architecture,
        "weight_types": sorted({t.ggml_type for t in loaded.ir.tensors}),
        "thresholds": THRESHOLDS,
        "numerics": numerics,
        "oracle": oracle,
        "arithmetic": (
            {"note": "oracle: mlx-lm's model classes on MLX's CPU backend, weights widened to float32"}
            if mlx
            else arithmetic(numerics)
        ),
        "prompt_token_ids": prompt,
        "backends": {},
        **({"jax_devices": devices} if devices > 1 else {}),
    }
    if progress:
        progress(report["arithmetic"]["note"])
    with MlxLmOracle(path) if mlx else LlamaCppOracle(path, n_ctx=context, n_threads=n_threads) as reference:
        for backend in backends:
            # mlx-lm names no intermediates: its logits and greedy steps are compared
            res = validate_backend(loaded, backend, reference, prompt, n_generate, context, layers=not mlx)
            report["backends"][backend] = res
            if progress:
                progress(f"{backend}: {'PASS' if res['passed'] else 'FAIL'} " + "; ".join(res["failures"]))
            if numerics == "exact" and not mlx and not res["passed"]:
                res["attribution"] = attribute_to_rounding(path, backend, reference, prompt, n_generate, context)
                if progress:
                    progress(f"{backend}: " + attribution_text(res["attribution"]))
    if gguf is not None:
        if not mlx:
            raise AlchemistError("--gguf compares a snapshot with its GGUF conversion: it needs --oracle mlx-lm")
        report["three_way"] = three_way(loaded, backends[0], path, gguf, prompt, context, n_threads)
    report["passed"] = all(r["passed"] for r in report["backends"].values())
    return report


def three_way(loaded, backend: str, snapshot: str, gguf: str, prompt: list[int], context: int, n_threads=None) -> dict:
    """The prompt's logits of alchemist (on `backend`, from the snapshot), mlx-lm (the snapshot) and llama.cpp (its
    GGUF conversion), each pair compared: where the two oracles differ, the report shows which one alchemist's
    model is (gemma3n's activation sparsity: Hugging Face's std over n, llama.cpp's over n - 1)."""
    from alchemist.harness.mlx_oracle import MlxLmOracle
    from alchemist.harness.oracle import LlamaCppOracle

    engine = loaded.engine(backend, context)
    logits = {"alchemist": np.asarray(engine.run(prompt, 0, all_logits=True), np.float32)}
    with MlxLmOracle(snapshot) as mlx:
        logits["mlx-lm"] = mlx.logits(prompt)
    with LlamaCppOracle(gguf, n_ctx=context, n_threads=n_threads) as llama:
        logits["llama.cpp"] = llama.logits(prompt)
    pairs = {}
    for a, b in (("alchemist", "mlx-lm"), ("alchemist", "llama.cpp"), ("mlx-lm", "llama.cpp")):
        m = compare_logits(logits[a], logits[b])
        pairs[f"{a} vs {b}"] = {"logits_nmse": float(nmse(logits[a], logits[b])), "mean_kl": m.mean_kl,
                                "top1_agree": m.n_top1_agree, "n_positions": m.n_positions}  # fmt: skip
    return {"backend": backend, "gguf": str(gguf), "pairs": pairs}


def validate_generation(model, prompt: list[int], out_ids: list[int]) -> dict:
    """inference(..., validate=True): re-score our prompt and continuation with llama.cpp."""
    from alchemist.harness.oracle import LlamaCppOracle

    with LlamaCppOracle(model.path, n_ctx=max(64, len(prompt) + len(out_ids) + 1)) as oracle:
        ours = model.engine.run(prompt, 0, all_logits=True) if prompt else None
        metrics = compare_logits(ours, oracle.logits(prompt), near_tie=THRESHOLDS["near_tie"]).summary()
        agreement = greedy_agreement(out_ids, oracle.rescore(prompt, out_ids)) if out_ids else None
    return {
        "prompt": metrics,
        "greedy_agree": agreement.n_agree if agreement else None,
        "greedy_steps": agreement.n_steps if agreement else 0,
        "note": "greedy agreement is meaningful for temperature 0 only",
    }


def to_markdown(report: dict) -> str:
    lines = [
        f"# Validation: {report['source_file']}",
        "",
        f"- model: {report['model']!r} ({report['architecture']}), weights: {', '.join(report['weight_types'])}",
        f"- sha256: `{report['source_sha256']}`",
        f"- prompt: {len(report['prompt_token_ids'])} tokens; thresholds: "
        + ", ".join(f"{k} {v:.4g}" for k, v in report["thresholds"].items()),
        f"- numerics: {report.get('numerics', 'exact')}",
        f"- {report['arithmetic']['note']}",
        f"- result: **{'PASS' if report['passed'] else 'FAIL'}**",
        "",
        "| backend | top-1 (decisive) | near-ties | mean KL | mean Pearson | logits NMSE | greedy agree | layers max NMSE | compiles | s | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b, r in report["backends"].items():
        p, g, lay = r["prompt"], r.get("greedy"), r.get("layers")
        lines.append(
            f"| {b} | {p['top1_agree_decisive']}/{p['n_decisive']} | {p['n_near_ties']} | {p['mean_kl']:.2e} | "
            f"{p['mean_pearson']:.6f} | {p['logits_nmse']:.2e} | "
            f"{(str(g['n_agree']) + '/' + str(g['n_steps'])) if g else '-'} | "
            f"{('%.2e' % lay['max_nmse']) if lay else '-'} | {r['compile_count']} | {r['seconds']} | "
            f"{'PASS' if r['passed'] else 'FAIL: ' + '; '.join(r['failures'])} |"
        )
    for b, r in report["backends"].items():
        ties = (r.get("greedy") or {}).get("disagreements", [])
        if ties:
            lines += ["", f"Greedy disagreements ({b}): the oracle's margin over our token vs max |Δ logit| there", ""]
            lines += ["| step | ours | oracle | oracle top-2 gap | oracle margin | max abs Δ | within-noise tie |"]
            lines += ["| --- | --- | --- | --- | --- | --- | --- |"]
            lines += [
                f"| {d['step']} | {d['ours']} | {d['oracle']} | {d['oracle_top2_gap']:.3g} | {d['oracle_margin']:.3g} | "
                f"{d['max_abs_delta']:.3g} | {'yes' if d['tie'] else '**no**'} |"
                for d in ties
            ]
        if r.get("attribution"):
            a = r["attribution"]
            lines += ["", f"Attribution ({b}): **{a['verdict']}**. {attribution_text(a)}", ""]
            lines += ["| layer output | NMSE exact vs llama.cpp | NMSE ggml vs llama.cpp | |"]
            lines += ["| --- | --- | --- | --- |"]
            lines += [
                f"| {row['tensor']} | {row['exact_nmse']:.3e} | {row['ggml_nmse']:.3e} | "
                f"{'first exact divergence' if row['tensor'] == a['first_exact_divergence'] else ''} |"
                for row in a["layers"]
            ]
        lines += ["", chart_markdown(r, f"{b} backend: KL, Pearson and top-1/top-10 per position")]
    if report.get("three_way"):
        t = report["three_way"]
        lines += ["", f"The prompt's logits three ways (alchemist on {t['backend']}, mlx-lm, llama.cpp on `{t['gguf']}`):",
                  "", "| pair | logits NMSE | mean KL | top-1 agree |", "| --- | --- | --- | --- |"]  # fmt: skip
        lines += [f"| {pair} | {v['logits_nmse']:.2e} | {v['mean_kl']:.2e} | {v['top1_agree']}/{v['n_positions']} |"
                  for pair, v in t["pairs"].items()]  # fmt: skip
    return "\n".join(lines) + "\n"


def chart_markdown(section: dict, alt: str) -> str:
    """The report's picture: a relative link to the PNG, or why there is none."""
    if section.get("chart"):
        return f"![{alt}]({section['chart']})"
    if section.get("chart_error"):
        return f"_{alt}: chart not drawn ({section['chart_error']})_"
    return ""


def write_validation(report: dict, out_dir: str | Path, stem: str) -> list[Path]:
    """`<stem>.json`, `<stem>.md` and one chart per backend, `<stem>_<backend>.png`; a chart that cannot be drawn
    leaves its reason in the JSON and the markdown instead."""
    from alchemist.harness.charts import draw, validation_chart

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    pngs = []
    for b, r in report["backends"].items():
        r.pop("chart", None), r.pop("chart_error", None)
        png, error = draw(validation_chart, report, b, out_dir / f"{stem}_{b}.png")
        if png:
            r["chart"] = png.name
            pngs.append(png)
        else:
            r["chart_error"] = error
    js.write_text(json.dumps(report, indent=2, default=float) + "\n")
    md.write_text(to_markdown(report))
    return [js, md, *pngs]


def diff_model(
    path: str,
    backend: str,
    prompt: list[int],
    tol: float | None = None,
    context: int = 256,
    llamacpp_rounding: bool = False,
    numerics: str | None = None,
    fed: bool | str = False,
    fed_tol: float | None = None,
) -> dict:
    """Layer-by-layer comparison with llama.cpp; names the first tensor whose NMSE exceeds tol. `numerics`:
    default "ggml" (llamacpp_rounding=True is the older spelling of it). fed=True also runs every layer on
    llama.cpp's own input to it (alchemist.harness.fed) and adds the "fed" section: each layer's own error
    against fed_tol (default 1e-10, the fed bar). fed="ops" also computes every tap from llama.cpp's taps
    before it (alchemist.harness.fed.op_fed_function): which op makes the first non-identical value."""
    from alchemist.harness.fed import FED_TOL, INPUT_NAMES, compare_fed, fed_taps
    from alchemist.harness.oracle import LlamaCppOracle

    numerics = resolve_numerics(numerics, llamacpp_rounding)
    loaded = load_for_validation(path, numerics=numerics)
    exact = is_exact(loaded.ir)
    tol = tol if tol is not None else (THRESHOLDS["exact_nmse"] if exact else DIFF_QUANTIZED_TOL)
    engine = loaded.engine(backend, max(context, len(prompt) + 1))
    t0 = time.perf_counter()
    ours = tap_values(engine, prompt)
    seconds = time.perf_counter() - t0
    with LlamaCppOracle(path, n_ctx=max(context, len(prompt) + 1)) as oracle:
        # the fed diff also needs the tensor llama.cpp's first block reads
        order, theirs = oracle.shared_intermediates(prompt, list(ours) + (list(INPUT_NAMES) if fed else []))
    rows = [(n, float(nmse(ours[n], theirs[n]))) for n in order if n in ours]
    first = next((n for n, v in rows if v > tol), None)
    fed_section = None
    if fed:
        fed_ours, op_ours, facts = fed_taps(engine, theirs, order, len(prompt), ops=fed == "ops")
        names = [n for n, _ in rows]
        fed_section = {
            **compare_fed(fed_ours, theirs, names, FED_TOL if fed_tol is None else fed_tol, op_ours),
            **facts,
        }
    return {
        "model": loaded.ir.model_name,
        "source_file": loaded.ir.source_file,
        "source_sha256": loaded.ir.source_sha256,
        "architecture": loaded.ir.architecture,
        "weight_types": sorted({t.ggml_type for t in loaded.ir.tensors}),
        "numerics": numerics,
        "arithmetic": arithmetic(numerics),
        "prompt_token_ids": list(prompt),
        "prompt_tokens": len(prompt),
        "backend": backend,
        "tolerance": tol,
        "exact_weights": exact,
        "rows": rows,
        "first_divergence": first,
        "seconds": round(seconds, 2),  # our taps: compile and run
        **({"fed": fed_section} if fed_section else {}),
    }


def diff_to_markdown(diff: dict) -> str:
    first, fed = diff["first_divergence"], diff.get("fed")
    lines = [
        f"# Layer diff: {diff['source_file']}",
        "",
        f"- model: {diff['model']!r} ({diff['architecture']}), weights: {', '.join(diff['weight_types'])}",
        f"- sha256: `{diff['source_sha256']}`",
        f"- backend: {diff['backend']}; prompt: {diff['prompt_tokens']} tokens; numerics: {diff['numerics']}",
        f"- {diff['arithmetic']['note']}",
        f"- tolerance: NMSE {diff['tolerance']:.1e}; "
        + (f"first divergent tensor: **{first}**" if first else f"**no tensor exceeds {diff['tolerance']:.1e}**"),
        *([fed_summary_line(fed)] if fed else []),
        "",
        chart_markdown(diff, "per-layer NMSE against llama.cpp"),
        "",
    ]
    if fed:
        return "\n".join(lines + fed_markdown(diff)) + "\n"
    lines += ["| tensor | NMSE vs llama.cpp | |", "| --- | --- | --- |"]
    for name, value in diff["rows"]:
        lines.append(f"| {name} | {value:.3e} | {'first divergence' if name == first else ''} |")
    return "\n".join(lines) + "\n"


def fed_summary_line(fed: dict) -> str:
    """The fed diff's headline: its input, its tolerance and the first tap over it."""
    first, tol = fed["first_divergence"], fed["tolerance"]
    return (
        f"- fed: every layer run on llama.cpp's own input to it (`{fed['input']}` for layer 0, `l_out-(il-1)` after, "
        f"the head on the last `l_out`); tolerance NMSE {tol:.1e}; "
        + (f"first tap over it: **{first}**" if first else f"**every layer within {tol:.1e}**")
    )


def fed_markdown(diff: dict) -> list[str]:
    """The per-layer table (fed: each layer's own error) and the per-tensor table with both columns (three with
    the op-fed one: each tap computed from llama.cpp's taps before it)."""
    fed, first, fed_first = diff["fed"], diff["first_divergence"], diff["fed"]["first_divergence"]
    tol = fed["tolerance"]
    ops = any("op_nmse" in row for row in fed["rows"])
    accumulated = dict(diff["rows"])
    lines = [
        f"Per layer, fed llama.cpp's input (tolerance {tol:.0e}); `accumulated` is our whole model's l_out",
        "",
        f"| layer | max fed NMSE | worst tap | out fed NMSE | out accumulated NMSE | first tap over {tol:.0e} | "
        "first tap not bit-identical |" + (" first op not bit-exact |" if ops else ""),
        "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if ops else ""),
    ]
    for e in fed["layers"]:
        out = f"l_out-{e['layer']}" if e["layer"] >= 0 else "result_output"
        over = f"{e['first_exceeding']} ({e['first_exceeding_nmse']:.2e})" if e["first_exceeding"] else "-"
        lines.append(
            f"| {e['layer'] if e['layer'] >= 0 else 'head'} | {e['max_nmse']:.2e} | {e['worst']} | "
            f"{_fmt(e['out_nmse'])} | {_fmt(accumulated.get(out))} | {over} | {e['first_differing'] or '-'} |"
            + (f" {e.get('first_op_differing') or '-'} |" if ops else "")
        )
    lines += [
        "",
        "Per tensor: NMSE of our whole model (accumulated) and of each layer fed llama.cpp's input (fed), and how "
        "many of the fed tensor's elements are not bit-identical to llama.cpp's"
        + (
            "; op-fed: the tensor computed from llama.cpp's tensors before it (the ops since those alone)"
            if ops
            else ""
        ),
        "",
        "| tensor | accumulated NMSE | fed NMSE | fed: differing elements |"
        + (" op-fed NMSE | op-fed: differing |" if ops else "")
        + " |",
        "| --- | --- | --- | --- |" + (" --- | --- |" if ops else "") + " --- |",
    ]
    for row in fed["rows"]:
        name = row["tensor"]
        marks = ["first divergence"] * (name == first) + [f"first fed over {tol:.0e}"] * (name == fed_first)
        op = f" {_fmt(row.get('op_nmse'), 3)} | {row.get('op_differing', '-')}/{row['size']} |" if ops else ""
        lines.append(
            f"| {name} | {_fmt(accumulated.get(name), 3)} | {row['nmse']:.3e} | {row['differing']}/{row['size']} |"
            f"{op} {'; '.join(marks)} |"
        )
    return lines


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}e}"


def write_diff(diff: dict, out_dir: str | Path, stem: str) -> list[Path]:
    """`<stem>.json`, `<stem>.md` and `<stem>.png` (or, if it cannot be drawn, the reason in the other two)."""
    from alchemist.harness.charts import diff_chart, draw

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    diff.pop("chart", None), diff.pop("chart_error", None)
    png, error = draw(diff_chart, diff, out_dir / f"{stem}.png")
    if png:
        diff["chart"] = png.name
    else:
        diff["chart_error"] = error
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    js.write_text(json.dumps(diff, indent=2, default=float) + "\n")
    md.write_text(diff_to_markdown(diff))
    return [js, md] + ([png] if png else [])
