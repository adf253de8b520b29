"""The sampler's fast paths (argmax on the float32 row, argpartition candidates) against the full-sort sampler."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from alchemist.runtime.sampling import Sampler, SamplingParams


def full_sort_candidates(logits, previous, p: SamplingParams):
    """alchemist 0.1.0's Sampler, up to the draw: float64 copy, full stable argsort."""
    logits = np.asarray(logits, dtype=np.float64).reshape(-1).copy()
    if p.repetition_penalty != 1.0 and previous:
        seen = np.unique(np.asarray(previous, dtype=np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.temperature == 0.0:
        return np.array([int(np.argmax(logits))]), np.ones(1)
    order = np.argsort(-logits, kind="stable")
    if p.top_k:
        order = order[: p.top_k]
    cand = logits[order] / p.temperature
    probs = np.exp(cand - cand.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return order, probs


def rows(n_vocab: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for i in range(n):
        scale = [0.5, 2.0, 8.0][i % 3]  # flat to peaked distributions: few to many top-p candidates
        row = (rng.standard_normal(n_vocab) * scale).astype(np.float32)
        if i % 4 == 0:
            row = np.round(row).astype(np.float32)  # many ties, including at the top-k boundary
        yield row


PARAMS = [
    SamplingParams(temperature=0.8, top_k=40),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.7, top_k=100, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=7, top_p=0.99, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
]


@pytest.mark.parametrize("params", PARAMS, ids=repr)
def test_candidates_equal_the_full_sort(params):
    previous = [3, 17, 17, 250, 4000]
    for row in rows(5000, 24):
        ids, probs = Sampler(params).candidates(row, previous)
        want_ids, want_probs = full_sort_candidates(row, previous, params)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(probs, want_probs, rtol=1e-12, atol=1e-15)
        assert row.dtype == np.float32  # the caller's row is left alone


@pytest.mark.parametrize("params", PARAMS[:5], ids=repr)
def test_seeded_draws_with_top_k_or_top_p_equal_the_full_sort(params):
    for i, row in enumerate(rows(3000, 12, seed=1)):
        old_rng = np.random.default_rng(i)
        ids, probs = full_sort_candidates(row, [], params)
        old = [int(ids[old_rng.choice(len(ids), p=probs)]) for _ in range(5)]
        s = Sampler(SamplingParams(params.temperature, params.top_k, params.top_p, params.repetition_penalty, seed=i))
        assert [s(row, []) for _ in range(5)] == old


def test_greedy_is_the_argmax_of_the_float32_row():
    for row in rows(5000, 12, seed=2):
        assert Sampler(SamplingParams())(row, [1, 2]) == int(np.argmax(row.astype(np.float64)))
    tie = np.array([1.0, 3.0, 3.0, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams())(tie, []) == 1  # the first maximum, as before


def test_plain_temperature_keeps_the_distribution():
    row = np.array([0.0, 1.0, 2.0, -1.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0.5, seed=0))
    counts = np.bincount([s(row, []) for _ in range(20000)], minlength=4) / 20000
    z = row.astype(np.float64) / 0.5
    want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(counts, want, atol=0.01)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-320, top_k=40),
        SamplingParams(temperature=1e-300, top_p=0.9),
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-320, top_k=40, top_p=1e-300),
    ],
    ids=repr,
)
def test_a_vanishing_temperature_is_greedy(params):
    """Temperatures whose inverse overflows float32 or float64 (no NaN from inf - inf): the argmax every draw."""
    sampler = Sampler(dataclasses.replace(params, seed=3))
    for row in rows(512, 6, seed=5):
        row[17] = row.max() + 0.5  # one best token
        ids, probs = sampler.candidates(row, [])
        assert np.all(np.isfinite(probs)) and probs.sum() == pytest.approx(1.0)
        assert all(sampler(row, []) == 17 for _ in range(5))


def test_a_huge_temperature_is_uniform_and_a_vanishing_penalty_stays_finite():
    row = next(rows(512, 1, seed=6)) * 100
    hot = Sampler(SamplingParams(temperature=1e300, seed=1))
    assert len({hot(row, []) for _ in range(400)}) > 250  # ~uniform over 512: about 280 distinct in 400 draws
    seen = [int(i) for i in np.flatnonzero(row > 0)[:3]]
    penalized = Sampler(SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1e-320, seed=2))
    ids, probs = penalized.candidates(row, seen)
    assert np.all(np.isfinite(probs)) and set(ids[probs > 0].tolist()) <= set(seen)  # the limit: seen ones win
    assert all(penalized(row, seen) in seen for _ in range(20))
