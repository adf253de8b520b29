"""Serving, engine side: one model used from several threads, and the SlotEngine's batched steps.

Tiny fixtures only; the compiled functions are shared through session-scoped fixtures (a compile takes
10-20 s even for a tiny model)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from alchemist import inference, load_llm

PROMPTS = [[2, 7, 11, 5, 3], [9, 4], [13, 6, 8, 1, 1, 2, 40], [100, 3, 17], [5, 5, 5, 5]]


@pytest.fixture(scope="session")
def llama_model(tiny_gguf, tiny_dir):
    return load_llm(tiny_gguf("llama"), backend="c", context=64, generated_dir=tiny_dir / "serving", progress=False)


def test_concurrent_inference_equals_sequential(llama_model):
    """Five threads generating on one model give what five calls in a row give (the KV cache is one
    buffer: without the engine lock their steps interleave and overwrite each other's positions)."""
    sequential = [inference(llama_model, p, max_tokens=8).output_token_ids for p in PROMPTS]
    assert len({tuple(s) for s in sequential}) > 1  # the prompts lead to different answers
    results: list = [None] * len(PROMPTS)
    errors: list = []
    start = threading.Barrier(len(PROMPTS))

    def work(i):
        try:
            start.wait()
            results[i] = inference(llama_model, PROMPTS[i], max_tokens=8).output_token_ids
        except Exception as exc:  # reported by the assert below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == sequential
