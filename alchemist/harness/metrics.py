"""Comparing our outputs with the oracle's: per-position logit metrics, tensor NMSE, greedy agreement.

Conventions: `ours` and `oracle` logits are (n_positions, n_vocab) arrays (a 1-D array is one
position). All statistics are computed in float64. The oracle is the reference everywhere:
KL is KL(oracle || ours), NMSE is normalised by the oracle's energy, near-ties are judged on the
oracle's top-2 gap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

NEAR_TIE = 1e-3  # oracle top-1 minus top-2 logit below this: either choice is a legitimate argmax
TOP_K = 10


def _as2d(x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError(f"logits must be (n_positions, n_vocab), got shape {a.shape}")
    return a


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Stable log-softmax in float64."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))


def kl_divergence(oracle: np.ndarray, ours: np.ndarray) -> np.ndarray:
    """KL(softmax(oracle) || softmax(ours)) per row, in nats (float64, clipped at 0)."""
    lp = log_softmax(_as2d(oracle))
    lq = log_softmax(_as2d(ours))
    p = np.exp(lp)
    kl = np.sum(np.where(p > 0, p * (lp - lq), 0.0), axis=-1)
    return np.maximum(kl, 0.0)


def pearson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation per row; 1.0 where both rows are constant and equal, nan where one is constant."""
    a, b = _as2d(a), _as2d(b)
    da = a - a.mean(axis=-1, keepdims=True)
    db = b - b.mean(axis=-1, keepdims=True)
    num = np.sum(da * db, axis=-1)
    den = np.sqrt(np.sum(da * da, axis=-1) * np.sum(db * db, axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = num / den
    both_const = (den == 0) & np.all(a == b, axis=-1)
    r = np.where(both_const, 1.0, r)
    return np.clip(r, -1.0, 1.0)


def nmse(a, b) -> float:
    """Normalised mean squared error sum((a-b)^2) / sum(b^2), b the reference; same-size arrays are
    compared element for element whatever their shapes (layouts differ: (T, H*D) vs (T, H, D)). Equal
    elements add no error, the same infinities included (a mask's -inf), and an infinite reference adds nothing
    to sum(b^2)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size != b.size:
        raise ValueError(f"nmse: sizes differ, {a.shape} vs {b.shape}")
    a = a.reshape(-1)
    b = b.reshape(-1)
    with np.errstate(invalid="ignore"):  # -inf - -inf: an equal element, dropped by the where
        err = float(np.sum(np.where(a == b, 0.0, a - b) ** 2))
    ref = float(np.sum(np.where(np.isfinite(b), b, 0.0) ** 2))
    if ref == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / ref


def top2_gap(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit per row (0 where the maximum is shared)."""
    a = _as2d(logits)
    if a.shape[-1] < 2:
        return np.full(a.shape[0], np.inf)
    part = np.partition(a, -2, axis=-1)
    return part[:, -1] - part[:, -2]


def _topk(a: np.ndarray, k: int) -> np.ndarray:
    k = min(k, a.shape[-1])
    return np.argpartition(-a, k - 1, axis=-1)[:, :k]


@dataclass
class PositionMetrics:
    """Per-position comparison of our logits with the oracle's (arrays of length n_positions)."""

    top1_ours: np.ndarray
    top1_oracle: np.ndarray
    top1_agree: np.ndarray  # bool
    top10_overlap: np.ndarray  # |top10(ours) ∩ top10(oracle)|, 0..10
    pearson: np.ndarray
    kl: np.ndarray  # KL(oracle || ours), nats
    max_abs_diff: np.ndarray
    nmse: np.ndarray
    oracle_top2_gap: np.ndarray
    near_tie: np.ndarray  # bool: oracle_top2_gap < near_tie_threshold
    near_tie_threshold: float = NEAR_TIE

    @property
    def n_positions(self) -> int:
        return int(self.top1_agree.shape[0])

    @property
    def mean_kl(self) -> float:
        return float(np.mean(self.kl))

    @property
    def max_kl(self) -> float:
        return float(np.max(self.kl))

    @property
    def mean_pearson(self) -> float:
        return float(np.nanmean(self.pearson))

    @property
    def min_pearson(self) -> float:
        return float(np.nanmin(self.pearson))

    @property
    def max_abs_logit_diff(self) -> float:
        return float(np.max(self.max_abs_diff))

    @property
    def n_top1_agree(self) -> int:
        """Positions whose argmax agrees (all positions)."""
        return int(np.sum(self.top1_agree))

    @property
    def n_decisive(self) -> int:
        """Positions where the oracle's choice is not a near-tie."""
        return int(np.sum(~self.near_tie))

    @property
    def n_top1_agree_decisive(self) -> int:
        """Top-1 agreements counted over decisive positions only (near-ties excluded)."""
        return int(np.sum(self.top1_agree & ~self.near_tie))

    @property
    def disagreements(self) -> list[dict]:
        """Every position whose argmax differs: position, both choices, oracle gap, near-tie flag."""
        out = []
        for i in np.flatnonzero(~self.top1_agree):
            out.append(
                {
                    "position": int(i),
                    "ours": int(self.top1_ours[i]),
                    "oracle": int(self.top1_oracle[i]),
                    "oracle_top2_gap": float(self.oracle_top2_gap[i]),
                    "near_tie": bool(self.near_tie[i]),
                }
            )
        return out

    @property
    def decisive_disagreements(self) -> list[int]:
        return [d["position"] for d in self.disagreements if not d["near_tie"]]

    def summary(self) -> dict:
        return {
            "n_positions": self.n_positions,
            "mean_kl": self.mean_kl,
            "max_kl": self.max_kl,
            "mean_pearson": self.mean_pearson,
            "min_pearson": self.min_pearson,
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "mean_nmse": float(np.mean(self.nmse)),
            "top1_agree": self.n_top1_agree,
            "top1_agree_decisive": self.n_top1_agree_decisive,
            "n_decisive": self.n_decisive,
            "n_near_ties": int(np.sum(self.near_tie)),
            "mean_top10_overlap": float(np.mean(self.top10_overlap)) / TOP_K,
            "disagreements": self.disagreements,
        }

    def __str__(self) -> str:
        s = self.summary()
        return (
            f"{s['n_positions']} positions: top-1 {s['top1_agree']}/{s['n_positions']} "
            f"({s['top1_agree_decisive']}/{s['n_decisive']} decisive), top-10 overlap {s['mean_top10_overlap']:.3f}, "
            f"KL mean {s['mean_kl']:.3g} max {s['max_kl']:.3g} nats, Pearson mean {s['mean_pearson']:.6f} "
            f"min {s['min_pearson']:.6f}, max |Δlogit| {s['max_abs_logit_diff']:.3g}"
        )


def compare_logits(ours, oracle, near_tie: float = NEAR_TIE) -> PositionMetrics:
    """Per-position metrics of `ours` against `oracle`, both (n_positions, n_vocab)."""
    a, b = _as2d(ours), _as2d(oracle)
    if a.shape != b.shape:
        raise ValueError(f"compare_logits: shapes differ, ours {a.shape} vs oracle {b.shape}")
    t1a = np.argmax(a, axis=-1)
    t1b = np.argmax(b, axis=-1)
    ka, kb = _topk(a, TOP_K), _topk(b, TOP_K)
    overlap = np.array([len(np.intersect1d(x, y)) for x, y in zip(ka, kb)], dtype=np.int64)
    diff = a - b
    err = np.sum(diff * diff, axis=-1)
    ref = np.sum(b * b, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        row_nmse = np.where(ref > 0, err / np.where(ref > 0, ref, 1.0), np.where(err == 0, 0.0, np.inf))
    gap = top2_gap(b)
    return PositionMetrics(
        top1_ours=t1a,
        top1_oracle=t1b,
        top1_agree=t1a == t1b,
        top10_overlap=overlap,
        pearson=pearson(a, b),
        kl=kl_divergence(b, a),
        max_abs_diff=np.max(np.abs(diff), axis=-1),
        nmse=row_nmse,
        oracle_top2_gap=gap,
        near_tie=gap < near_tie,
        near_tie_threshold=near_tie,
    )


@dataclass
class DivergenceReport:
    """Result of `first_divergence`: `name` is the first tensor (in `order`) over `tol`, or None."""

    name: str | None
    tol: float
    nmse: dict[str, float] = field(default_factory=dict)  # every compared tensor, in order
    missing: list[str] = field(default_factory=list)  # names in order absent from either side
    mismatched: list[str] = field(default_factory=list)  # names whose element counts differ

    def __bool__(self) -> bool:  # truthy when something diverged
        return self.name is not None

    def __str__(self) -> str:
        if self.name is None:
            worst = max(self.nmse.items(), key=lambda kv: kv[1], default=(None, 0.0))
            return f"no divergence over {self.tol:g} in {len(self.nmse)} tensors (worst {worst[0]}: {worst[1]:.3g})"
        return f"first divergence at {self.name}: NMSE {self.nmse.get(self.name, float('inf')):.3g} > {self.tol:g}"


def first_divergence(
    ours: Mapping[str, np.ndarray], oracle: Mapping[str, np.ndarray], order: Sequence[str], tol: float = 1e-6
) -> DivergenceReport:
    """Walk `order` (evaluation order) and name the first tensor whose NMSE(ours, oracle) exceeds `tol`.

    Names missing from either side are skipped (and listed); a size mismatch counts as a divergence.
    All tensors are compared so the report shows how the error grows after the first divergence.
    """
    report = DivergenceReport(name=None, tol=tol)
    for name in order:
        if name not in ours or name not in oracle:
            report.missing.append(name)
            continue
        a, b = np.asarray(ours[name]), np.asarray(oracle[name])
        if a.size != b.size:
            report.mismatched.append(name)
            value = float("inf")
        else:
            value = nmse(a, b)
        report.nmse[name] = value
        if report.name is None and not value <= tol:
            report.name = name
    return report


@dataclass
class GreedyAgreement:
    """Fresh-prefix greedy agreement: at each step, does the oracle (given our prefix) pick our token?"""

    n_steps: int
    n_agree: int
    agree: np.ndarray  # bool per step
    first_divergence: int | None  # step index of the first disagreement
    first_divergence_gap: float | None  # oracle top-1 minus top-2 logit there
    first_divergence_near_tie: bool | None  # the oracle's margin over our token is below the near-tie threshold
    first_divergence_margin: float | None  # oracle logit of its choice minus that of our token
    our_token: int | None
    oracle_token: int | None
    n_decisive_disagree: int  # disagreements whose oracle margin is not a near-tie
    # every disagreement (given our logits): step, tokens, oracle top-2 gap, oracle margin over our token, the
    # largest |our logit - oracle logit| at that step, and whether it is a within-noise tie (margin < that)
    disagreements: list = field(default_factory=list)

    @property
    def untied(self) -> list:
        """The disagreements that are not within-noise ties (needs our logits; empty without them)."""
        return [d for d in self.disagreements if not d["tie"]]

    @property
    def all_agree(self) -> bool:
        return self.n_agree == self.n_steps

    def __str__(self) -> str:
        s = f"greedy: {self.n_agree}/{self.n_steps} fresh-prefix decisions agree"
        if self.first_divergence is not None:
            s += (
                f"; first divergence at step {self.first_divergence} (ours {self.our_token}, oracle "
                f"{self.oracle_token}, oracle top-2 gap {self.first_divergence_gap:.3g}"
                f"{', near-tie' if self.first_divergence_near_tie else ''})"
            )
        return s


def greedy_agreement(
    our_ids: Sequence[int], oracle_rescore_logits, near_tie: float = NEAR_TIE, our_logits=None
) -> GreedyAgreement:
    """Compare our greedy continuation with the oracle's decisions on the same prefixes.

    `oracle_rescore_logits` is `LlamaCppOracle.rescore(prefix, our_ids)`: row k is the oracle's
    logits after prefix + our_ids[:k], so its argmax is the oracle's decision for step k.
    `our_logits` (same shape: row k is ours behind our_ids[k]) lists every disagreement with its noise: a
    within-noise tie is one where the oracle prefers its token over ours by less than the largest |Δ logit|
    between the two implementations at that step (the oracle's margin over our token: its top-2 gap when ours
    is its second choice, larger otherwise).
    """
    ids = np.asarray(list(our_ids), dtype=np.int64)
    logits = _as2d(oracle_rescore_logits) if len(ids) else np.zeros((0, 1))
    if logits.shape[0] != ids.shape[0]:
        raise ValueError(f"greedy_agreement: {ids.shape[0]} tokens but {logits.shape[0]} logit rows")
    choice = np.argmax(logits, axis=-1) if len(ids) else np.zeros(0, dtype=np.int64)
    agree = choice == ids
    gaps = top2_gap(logits) if len(ids) else np.zeros(0)
    bad = np.flatnonzero(~agree)
    # margin: how much the oracle prefers its choice over ours (>= its top-2 gap); a near-tie when tiny
    margins = logits[bad, choice[bad]] - logits[bad, ids[bad]] if len(bad) else np.zeros(0)
    n_decisive = int(np.sum(margins >= near_tie))
    disagreements = []
    if our_logits is not None and len(bad):
        ours = _as2d(our_logits)
        if ours.shape != logits.shape:
            raise ValueError(f"greedy_agreement: our logits {ours.shape} vs the oracle's {logits.shape}")
        for k, margin in zip(bad, margins):
            noise = float(np.max(np.abs(ours[k] - logits[k])))
            disagreements.append(
                {
                    "step": int(k),
                    "ours": int(ids[k]),
                    "oracle": int(choice[k]),
                    "oracle_top2_gap": float(gaps[k]),
                    "oracle_margin": float(margin),
                    "max_abs_delta": noise,
                    "tie": bool(margin < noise),
                }
            )
    if len(bad) == 0:
        return GreedyAgreement(len(ids), int(agree.sum()), agree, None, None, None, None, None, None, 0)
    k = int(bad[0])
    margin = float(margins[0])
    return GreedyAgreement(
        n_steps=len(ids),
        n_agree=int(agree.sum()),
        agree=agree,
        first_divergence=k,
        first_divergence_gap=float(gaps[k]),
        first_divergence_near_tie=bool(margin < near_tie),
        first_divergence_margin=margin,
        our_token=int(ids[k]),
        oracle_token=int(choice[k]),
        n_decisive_disagree=n_decisive,
        disagreements=disagreements,
    )
