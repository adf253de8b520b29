"""Calibrate an LLM's zero-shot labels with PyMC: the LLM's log-probabilities are part of the likelihood.

A zero-shot classifier scores each label of each text by the model's log-probability of the label after the
text, s[i, k] = log p(label_k | prompt_i). Those scores are rarely calibrated. Given a few texts with known
labels, this infers a temperature τ and per-label offsets b with

    τ ~ HalfNormal(2),  b_k ~ Normal(0, 1) (b_0 = 0),  y_i ~ Categorical(softmax(s[i] / τ + b))

where s is not a table of numbers computed beforehand but the PyTensor expression `model.log_prob(...)` over
the GGUF model's weights: PyMC compiles the language model into its log-density and its gradient.

    python examples/pymc_calibration.py gemma-3-270m --method map
    python examples/pymc_calibration.py tiny.gguf --method nuts --draws 100

Needs the `pymc` extra (pip install 'alchemist[pymc]').
"""

from __future__ import annotations

import argparse
import time

import numpy as np

LABELS = [" positive", " negative"]
REVIEWS = [  # (text, index of the true label)
    ("The food was wonderful and the staff were so kind.", 0),
    ("Cold soup, rude waiter, and we waited an hour.", 1),
    ("Best concert I have been to in years!", 0),
    ("The battery died after two days. Avoid.", 1),
    ("A charming little hotel with a lovely view.", 0),
    ("The plot made no sense and the acting was wooden.", 1),
]


def prompt(text: str) -> str:
    return f"Review: {text}\nSentiment:"


def label_scores(model, reviews, labels):
    """s[i, k] = log p(label_k | prompt_i) as one PyTensor expression (reviews x labels).

    When every label is a single token, one forward pass per review scores them all (the log-softmax of the
    prompt's last position); otherwise each (review, label) pair is its own sequence.
    """
    import pytensor.tensor as pt

    label_ids = [model.tokenizer.encode(label, add_special_tokens=False) for label in labels]
    if all(len(ids) == 1 for ids in label_ids):
        rows = []
        for text, _ in reviews:
            ids = model.tokenizer.encode(prompt(text))
            last = pt.special.log_softmax(model.symbolic_logits(ids)[-1])
            rows.append(last[[ids[0] for ids in label_ids]])
        return pt.stack(rows)
    return pt.stack([pt.stack([model.log_prob(label, given=prompt(text)) for label in labels]) for text, _ in reviews])


def build(model, reviews=REVIEWS, labels=LABELS):
    """The PyMC model and the LLM's label scores (the expression inside its likelihood).

    The scores are not a pm.Deterministic: PyMC evaluates deterministics once more at the end in PyTensor's
    FAST_COMPILE (Python) mode, which would run the whole language model in Python.
    """
    import pymc as pm
    import pytensor.tensor as pt

    scores = label_scores(model, reviews, labels)
    observed = np.array([y for _, y in reviews])
    with pm.Model() as pm_model:
        tau = pm.HalfNormal("tau", sigma=2.0)
        offset = pm.Normal("offset", 0.0, 1.0, shape=len(labels) - 1)
        logits = scores / tau + pt.concatenate([pt.zeros(1), offset])
        pm.Categorical("label", logit_p=logits, observed=observed)
    return pm_model, scores


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="gemma-3-270m", help="a GGUF file or a reference model name")
    parser.add_argument("--backend", default="c", choices=["c", "numba"])
    parser.add_argument("--method", default="map", choices=["map", "nuts"])
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--tune", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reviews", type=int, default=len(REVIEWS), help="use the first N reviews (N >= 2)")
    args = parser.parse_args(argv)

    from alchemist import load_llm  # first: it configures PyTensor (BLAS, compiler flags) before PyMC imports it

    import pymc as pm
    import pytensor

    reviews = REVIEWS[: max(2, args.reviews)]
    model = load_llm(args.model, backend=args.backend, compile_now=False, progress=False)
    pm_model, scores = build(model, reviews)
    from pytensor.graph.traversal import ancestors

    read = set(ancestors([pm_model.logp()]))
    n_read = sum(weight in read for weight in model.engine.weights.values())
    print(f"PyMC's log-density reads {n_read} of the language model's {len(model.engine.weights)} weight tensors")
    compile_kwargs = {"mode": model.mode}  # the model's backend compiles PyMC's functions too
    t0 = time.perf_counter()
    with pm_model:
        if args.method == "map":
            point = pm.find_MAP(
                progressbar=False,
                compile_kwargs=compile_kwargs,
                random_seed=args.seed,
                jitter=False,
                return_inferencedata=False,
            )
            tau, offset = float(point["tau"]), np.atleast_1d(point["offset"])
            print(
                f"MAP after {time.perf_counter() - t0:.1f} s: tau = {tau:.3f}, offset = {np.round(offset, 3).tolist()}"
            )
        else:
            idata = pm.sample(
                draws=args.draws,
                tune=args.tune,
                chains=1,
                cores=1,
                random_seed=args.seed,
                compile_kwargs=compile_kwargs,
                progressbar=False,
            )
            post = idata.posterior
            taus = np.asarray(post["tau"]).ravel()
            offsets = np.asarray(post["offset"]).reshape(taus.size, -1)
            tau, offset = float(np.mean(taus)), offsets.mean(axis=0)
            lo, hi = np.percentile(taus, [5, 95])
            print(
                f"NUTS ({taus.size} draws) after {time.perf_counter() - t0:.1f} s: tau = {tau:.3f} "
                f"(90% interval {lo:.3f} .. {hi:.3f}), offset = {np.round(offset, 3).tolist()}"
            )
    llm = pytensor.function([], scores, mode=model.mode)()  # the raw scores, for the table
    calibrated = llm / tau + np.concatenate([[0.0], offset])
    calibrated = np.exp(calibrated - calibrated.max(axis=1, keepdims=True))
    calibrated /= calibrated.sum(axis=1, keepdims=True)
    raw = np.exp(llm - llm.max(axis=1, keepdims=True))
    raw /= raw.sum(axis=1, keepdims=True)
    print(f"{'review':<52} {'true':>9}  {'p(true) raw':>11}  {'calibrated':>10}")
    for (text, y), r, c in zip(reviews, raw, calibrated):
        print(f"{text[:50]:<52} {LABELS[y].strip():>9}  {r[y]:>11.3f}  {c[y]:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
