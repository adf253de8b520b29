"""Serving end to end on a real (tiny) model: the SlotEngine, the Scheduler and the HTTP app together.

The gemma3 fixture quantized to Q8_0 puts the C kernels in the graph and has a sliding window of 8 on layer 0,
so longer requests wrap their ring rows. Batching must not change tokens: greedy answers through the batch equal
the answers of one-at-a-time `inference` calls on the unbatched engine."""

from __future__ import annotations

import threading
import time

import pytest

from alchemist import inference, load_llm

pytestmark = pytest.mark.filterwarnings("ignore::alchemist.tokenizer.chat.ChatTemplateWarning")  # fixtures: no template

# (prompt ids, max_tokens): different lengths (1..4 prefill chunks of 4) and answer lengths, so requests join
# and leave the batch at different steps
REQUESTS = [([2, 7, 11, 5, 3], 12), ([9, 4], 6), ([13, 6, 8, 1, 1, 2, 40, 17, 3, 3, 21, 8, 9, 30], 9),
            ([100, 3, 17], 15), ([5, 5, 5, 5, 6, 7], 4)]  # fmt: skip


@pytest.fixture(scope="module")
def model(fixture_files, tiny_dir):
    m = load_llm(fixture_files("gemma3", "Q8_0"), backend="c", context=48, generated_dir=tiny_dir / "e2e",
                 progress=False)  # fmt: skip
    yield m
    m.stop_batching()


@pytest.fixture(scope="module")
def solo_answers(model):
    """Greedy answers of one-at-a-time inference on the single-sequence engine (no batching)."""
    assert not model.batching
    return [inference(model, ids, max_tokens=n).output_token_ids for ids, n in REQUESTS]


def test_batched_generation_equals_one_at_a_time(model, solo_answers):
    """Five threads join a batch of 3 slots at staggered times (more requests than slots: some queue); each gets
    exactly the tokens it gets alone on the unbatched engine, and no step compiles after the warm-up."""
    assert len({tuple(a) for a in solo_answers}) == len(REQUESTS)
    sched = model.start_batching(slots=3, chunk=4, decode_buckets=(2, 4))
    compiles = sched.engine.stats.compile_count
    results: list = [None] * len(REQUESTS)
    errors: list = []

    def work(i):
        try:
            time.sleep(0.05 * i)
            ids, n = REQUESTS[i]
            results[i] = inference(model, ids, max_tokens=n)
        except Exception as exc:  # reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [r.output_token_ids for r in results] == solo_answers
    assert all(r.report["batched"]["slots"] == 3 for r in results)
    assert sched.stats.decode_steps < sum(len(a) for a in solo_answers)  # rows really were batched
    assert sched.engine.stats.compile_count == compiles
    model.stop_batching()


def test_openai_client_streams_from_the_real_model(model, solo_answers):
    """The official openai client streams a completion from `create_app` over the real scheduler: the streamed
    text is the model's greedy answer, and a chat completion streams with usage."""
    openai = pytest.importorskip("openai")
    from alchemist.runtime.slot_engine import SlotEngine
    from alchemist.serve.app import create_app
    from alchemist.serve.scheduler import Scheduler
    from test_server import running

    sched = Scheduler(SlotEngine(model.engine, 2, chunk=4, decode_buckets=(2,)), model.tokenizer)
    sched.warm_up()
    app = create_app(sched, model.tokenizer, "tiny-gemma3", drain_s=3.0)
    ids, n = REQUESTS[0]
    want = model.tokenizer.decode(solo_answers[0])
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(model="tiny-gemma3", prompt=ids, max_tokens=n, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        chat = list(client.chat.completions.create(model="tiny-gemma3", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}))  # fmt: skip
        assert chat[-1].usage.completion_tokens == 5
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
