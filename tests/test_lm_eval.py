"""lm-evaluation-harness against the server: a multiple-choice task (tests/data/lm_eval) through its
`local-completions` model, which scores each choice with an echo + logprobs request and counts tokens with the
server's own tokenizer (`/tokenize`, `/tokenizer_info`). Each choice's log-likelihood must be alchemist's own
`model.log_prob` of that continuation given that context."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytensor
import pytest

from alchemist import load_llm

pytestmark = pytest.mark.filterwarnings("ignore::alchemist.tokenizer.chat.ChatTemplateWarning")  # fixtures: no template

TASKS = Path(__file__).parent / "data" / "lm_eval"
MODEL = "tiny-gemma2"


@pytest.fixture(scope="module")
def served(tiny_gguf, tiny_dir):
    """The gemma2 fixture (its final softcap keeps log-likelihoods of a realistic size) behind create_app over the real Scheduler and SlotEngine (2 slots, chunks of 8)."""
    from alchemist.runtime.slot_engine import SlotEngine
    from alchemist.serve.app import create_app
    from alchemist.serve.scheduler import Scheduler
    from test_server import running

    # numerics "exact": what model.log_prob computes (the default, "ggml", rounds as llama.cpp does)
    model = load_llm(tiny_gguf("gemma2"), backend="c", context=64, numerics="exact", generated_dir=tiny_dir / "lm_eval",
                     progress=False)  # fmt: skip
    sched = Scheduler(SlotEngine(model.engine, 2, chunk=8, decode_buckets=(1, 2)), model.tokenizer)
    with running(create_app(sched, model.tokenizer, MODEL, drain_s=3.0)) as url:
        yield model, url


def test_lm_eval_multiple_choice_log_likelihoods_are_log_prob(served, monkeypatch, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model, url = served
    monkeypatch.chdir(TASKS)  # the task's data_files is relative to it
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,"
        "num_concurrent=1,max_retries=1,batch_size=3",
        tasks=["alchemist_choices"],
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
    )
    samples = out["samples"]["alchemist_choices"]
    assert len(samples) == 3 and 0.0 <= out["results"]["alchemist_choices"]["acc,none"] <= 1.0
    tok = model.tokenizer
    for sample in samples:
        assert len(sample["arguments"]) == 3  # one request per choice
        for (context, continuation), (loglik, _greedy) in zip(sample["arguments"], sample["filtered_resps"]):
            # lm-eval's split: the whole text's ids, the context's first (no BOS: add_special_tokens false)
            whole = tok.encode(context + continuation, add_special_tokens=False)
            given = tok.encode(context, add_special_tokens=False)
            assert whole[: len(given)] == given
            ours = pytensor.function([], model.log_prob(whole[len(given) :], given=given), mode=model.mode)()
            assert np.isfinite(loglik) and abs(loglik - float(ours)) <= 1e-4, (context, continuation, loglik, ours)
