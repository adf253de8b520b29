"""Choosing the next token from logits: greedy, or sampled with the usual filters (llama.cpp's order:
repetition penalty, top-k, top-p, temperature)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0 or not np.isfinite(self.temperature):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, previous: list[int]) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float64).reshape(-1).copy()
        if p.repetition_penalty != 1.0 and previous:
            seen = np.unique(np.asarray(previous, dtype=np.int64))
            vals = logits[seen]
            logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        order = np.argsort(-logits, kind="stable")
        if p.top_k:
            order = order[: p.top_k]
        cand = logits[order] / p.temperature
        probs = np.exp(cand - cand.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self.rng.choice(len(order), p=probs)])
