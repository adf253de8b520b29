"""The continuous-batching scheduler (alchemist/serve/scheduler.py) on the numpy toy slot engine."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from alchemist.errors import AlchemistError
from alchemist.runtime.sampling import SamplingParams
from alchemist.serve.scheduler import DoneEvent, QueueFull, Request, Scheduler, SchedulerClosed, TokenEvent
from alchemist.tokenizer import load_tokenizer
from serving_toy import ToySlotEngine

N_VOCAB = 512  # the fixtures' vocabulary


@pytest.fixture(scope="module")
def tok(tiny_gguf):
    return load_tokenizer(str(tiny_gguf("llama")))


def toy(n_slots=4, capacity=64, chunk=4, buckets=(1, 2, 4)):
    return ToySlotEngine(N_VOCAB, n_slots=n_slots, capacity=capacity, chunk=chunk, decode_buckets=buckets)


def prompts(n, seed=0, lo=3, hi=20):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, N_VOCAB, rng.integers(lo, hi))] for _ in range(n)]


def solo(tok, prompt, max_tokens, params=SamplingParams(), **kw):
    """The request alone on a one-slot scheduler."""
    s = Scheduler(toy(n_slots=1), tok)
    return s.generate(Request(prompt, params, max_tokens, **kw))


def collect(events: dict):
    def sink_for(rid):
        return lambda ev: events.setdefault(rid, []).append(ev)

    return sink_for


def run_until_idle(s: Scheduler, limit=10_000):
    for _ in range(limit):
        if not s.step():
            return
    raise AssertionError("the scheduler never went idle")


def ids_of(evs):
    assert isinstance(evs[-1], DoneEvent) and all(isinstance(e, TokenEvent) for e in evs[:-1])
    return [e.token_id for e in evs[:-1]]


def test_interleaved_joins_and_leaves_match_solo(tok):
    ps = prompts(7, seed=1)
    max_tokens = [5, 17, 3, 11, 8, 1, 14]
    engine = toy(n_slots=3)
    s = Scheduler(engine, tok)
    events: dict = {}
    sink = collect(events)
    reqs = []
    # staggered: two now, two after a few steps, the rest later; 7 requests on 3 slots, so some wait in the queue
    for i, (p, m) in enumerate(zip(ps, max_tokens)):
        reqs.append(s.submit(Request(p, max_tokens=m, sink=sink(f"r{i}"), id=f"r{i}")))
        if i in (1, 3, 4):
            for _ in range(3 + i):
                s.step()
    run_until_idle(s)
    for i, (p, m) in enumerate(zip(ps, max_tokens)):
        done = events[f"r{i}"][-1]
        want = solo(tok, p, m)
        assert ids_of(events[f"r{i}"]) == want.token_ids, f"request {i}"
        assert done.finish_reason == want.finish_reason
        assert "".join(e.text for e in events[f"r{i}"]) == want.text
        assert done.usage["prompt_tokens"] == len(p) and done.usage["completion_tokens"] == len(want.token_ids)
    assert engine.stats.decode_rows > engine.stats.decode_steps  # rows really were batched
    st = s.stats
    assert st.requests_total == 7 and sum(st.requests_finished.values()) == 7
    assert st.active_slots == 0 and st.queue_depth == 0
    assert st.generated_tokens_total == sum(len(ids_of(v)) for v in events.values())
    assert st.ttft_seconds.count == 7 and st.itl_seconds.count == st.generated_tokens_total - 7
    assert st.ttft_seconds.cumulative()[-1] == (float("inf"), 7)


def test_more_decoding_slots_than_the_largest_bucket(tok):
    ps = prompts(5, seed=2)
    engine = toy(n_slots=5, buckets=(1, 2))
    s = Scheduler(engine, tok)
    events: dict = {}
    for i, p in enumerate(ps):
        s.submit(Request(p, max_tokens=6, sink=collect(events)(i)))
    run_until_idle(s)
    for i, p in enumerate(ps):
        assert ids_of(events[i]) == solo(tok, p, 6).token_ids


def test_a_prompt_beside_decoding_streams_goes_in_pieces(tok):
    """A prompt that arrives while another request decodes is prefilled in the engine's pieces (half chunks
    here), a piece per step beside the decode; alone it goes in whole chunks. Both give their solo tokens."""
    engine = ToySlotEngine(N_VOCAB, n_slots=2, capacity=64, chunk=8, decode_buckets=(1, 2), piece=4)
    s = Scheduler(engine, tok)
    first, second = prompts(2, seed=5, lo=17, hi=18)
    events = {}
    sink = collect(events)
    s.submit(Request(first, SamplingParams(), 12, sink=sink("a")))
    s.step(), s.step(), s.step()  # three chunks: the first prompt alone, then its first token
    assert [(start, n) for _, start, n in engine.prefills] == [(0, 8), (8, 8), (16, 1)]
    s.submit(Request(second, SamplingParams(), 6, sink=sink("b")))
    run_until_idle(s)
    beside = [(start, n) for slot, start, n in engine.prefills[3:]]
    assert beside[:4] == [(0, 4), (4, 4), (8, 4), (12, 4)] and all(n <= 4 for _, n in beside)
    assert (
        ids_of(events["a"]) == solo(tok, first, 12).token_ids and ids_of(events["b"]) == solo(tok, second, 6).token_ids
    )


def test_cancel_frees_slot_next_step(tok):
    a, b, c = prompts(3, seed=3)
    s = Scheduler(toy(n_slots=2), tok)
    events: dict = {}
    ra = s.submit(Request(a, max_tokens=40, sink=collect(events)("a")))
    rb = s.submit(Request(b, max_tokens=12, sink=collect(events)("b")))
    rc = s.submit(Request(c, max_tokens=3, sink=collect(events)("c")))  # queued: both slots are busy
    for _ in range(12):
        s.step()
    assert s.stats.active_slots == 2 and s.stats.queue_depth == 1
    n_before = len(events["a"])
    s.cancel(ra.id)
    assert s.stats.active_slots == 2  # nothing happens until the next step
    s.step()
    done = events["a"][-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"
    assert len(events["a"]) == n_before + 1  # no token after the cancel
    assert s.stats.queue_depth == 0 and s.stats.active_slots == 2  # the freed slot took "c" in the same step
    # a queued request can be cancelled too
    rd = s.submit(Request(a, max_tokens=3, sink=collect(events)("d")))
    s.cancel(rd.id)
    s.step()
    assert events["d"][-1].finish_reason == "cancelled" and len(events["d"]) == 1
    run_until_idle(s)
    assert ids_of(events["b"]) == solo(tok, b, 12).token_ids  # the cancel did not disturb the others
    assert ids_of(events["c"]) == solo(tok, c, 3).token_ids
    assert rb.t_done and rc.t_done


def test_queue_full_raises_and_bad_requests_are_refused(tok):
    s = Scheduler(toy(n_slots=1, capacity=32), tok, max_queue=2)
    p = prompts(1)[0]
    s.submit(Request(p, max_tokens=2))
    s.submit(Request(p, max_tokens=2))
    with pytest.raises(QueueFull):
        s.submit(Request(p, max_tokens=2))
    s.step()  # one admitted: room again
    s.submit(Request(p, max_tokens=2))
    with pytest.raises(AlchemistError, match="exceeds the context of 32") as e:
        s.submit(Request([5] * 30, max_tokens=3))
    assert not isinstance(e.value, QueueFull)
    with pytest.raises(AlchemistError, match="out of range"):
        s.submit(Request([5, N_VOCAB], max_tokens=1))
    with pytest.raises(AlchemistError, match="empty"):
        s.submit(Request([], max_tokens=1))


def test_seeded_sampling_is_per_request(tok):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    p = prompts(1, seed=4)[0]
    alone = solo(tok, p, 15, params).token_ids
    s = Scheduler(toy(n_slots=4), tok)
    events: dict = {}
    noise = prompts(5, seed=5)
    for i, q in enumerate(noise[:2]):  # other sampled requests start first and run alongside
        s.submit(Request(q, SamplingParams(temperature=1.2, seed=i), 20, sink=collect(events)(i)))
    s.step()
    s.submit(Request(p, params, 15, sink=collect(events)("x")))
    s.submit(Request(noise[3], SamplingParams(temperature=0.7, top_k=5), 9, sink=collect(events)("y")))
    run_until_idle(s)
    assert ids_of(events["x"]) == alone
    assert solo(tok, p, 15, SamplingParams(temperature=1.0, top_p=0.9, seed=8)).token_ids != alone  # seeds matter


def test_prefix_reuse_skips_prefill_and_keeps_tokens(tok):
    p = prompts(1, seed=6, lo=14, hi=15)[0]  # 14 tokens
    engine = toy(n_slots=2, chunk=4)
    s = Scheduler(engine, tok)
    first = s.generate(Request(p, max_tokens=6))
    assert first.usage["cached_tokens"] == 0
    # the next turn extends the conversation: prompt + answer + more
    turn2 = p + first.token_ids + [7, 8, 9]
    before = engine.stats.prefill_tokens
    second = s.generate(Request(turn2, max_tokens=6))
    reused = second.usage["cached_tokens"]
    # the slot holds p + answer[:-1] (19 positions): reuse is the chunk-aligned common prefix
    assert reused == (len(p) + len(first.token_ids) - 1) // 4 * 4 == 16
    assert engine.stats.prefill_tokens - before == len(turn2) - reused
    assert second.token_ids == solo(tok, turn2, 6).token_ids
    assert s.stats.cached_tokens_total == 16
    # copied from a busy slot: a long request runs in slot A, a request sharing its prompt reuses its rows
    s2 = Scheduler(toy(n_slots=2, chunk=4), tok)
    events: dict = {}
    long = prompts(1, seed=7, lo=13, hi=14)[0]
    s2.submit(Request(long, max_tokens=30, sink=collect(events)("long")))
    for _ in range(6):
        s2.step()
    share = long[:9] + [11, 12]
    s2.submit(Request(share, max_tokens=5, sink=collect(events)("share")))
    run_until_idle(s2)
    assert events["share"][-1].usage["cached_tokens"] == 8
    assert ids_of(events["share"]) == solo(tok, share, 5).token_ids
    assert ids_of(events["long"]) == solo(tok, long, 30).token_ids


def test_stop_strings_and_eos(tok):
    p = prompts(1, seed=8)[0]
    free = solo(tok, p, 24)
    assert free.finish_reason == "length" and len(free.text) > 8, free
    stop = free.text[5:8]
    cut = solo(tok, p, 24, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    # eos: any token id can be made the eos
    i = 6
    s = Scheduler(toy(n_slots=1), tok, eos_ids=[free.token_ids[i]])
    eos = s.generate(Request(p, max_tokens=24))
    first = free.token_ids.index(free.token_ids[i])
    assert eos.finish_reason == "stop" and eos.token_ids == free.token_ids[:first]
    assert eos.text == tok.decode(free.token_ids[:first])
    ignored = s.generate(Request(p, max_tokens=24, ignore_eos=True))
    assert ignored.token_ids == free.token_ids


def test_logprobs_are_the_raw_log_softmax(tok):
    p = prompts(1, seed=9)[0]
    c = solo(tok, p, 3, logprobs=4)
    lp0, top0 = c.logprobs[0]
    engine = toy(n_slots=1)
    logits = np.concatenate([engine.prefill(0, p[a:b], a)[None] for a, b in engine.chunk_plan(len(p))])[-1]
    z = logits.astype(np.float64)
    want = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    assert len(top0) == 4 and top0[0][0] == c.token_ids[0]  # greedy: the chosen token is the most likely
    assert lp0 == pytest.approx(want[c.token_ids[0]], abs=1e-9)
    assert [i for i, _ in top0] == list(np.argsort(-want, kind="stable")[:4])
    assert all(a[1] >= b[1] for a, b in zip(top0, top0[1:]))


def test_a_scored_prompt_gets_every_positions_log_softmax_from_its_prefill(tok):
    """prompt_logprobs: the prefill keeps every row's logits; token i's logprob is the raw log-softmax of position
    i - 1's (None for the first), with the top-k there; max_tokens 0 scores only; the tokens generated after a scored
    prompt are those of the same request unscored; a scored prompt is prefilled whole, never taken from a cache."""
    p = prompts(1, seed=21, lo=11, hi=12)[0]  # 11 tokens: chunks of 4, 4 and 3
    engine = toy(n_slots=2, chunk=4)
    rows = np.concatenate([engine.prefill(0, p[a:b], a, all_rows=True) for a, b in engine.chunk_plan(len(p))])
    z = rows.astype(np.float64)
    want = z - (z.max(axis=1, keepdims=True) + np.log(np.exp(z - z.max(axis=1, keepdims=True)).sum(1, keepdims=True)))
    s = Scheduler(toy(n_slots=2, chunk=4), tok)
    unscored = s.generate(Request(p, max_tokens=5))
    scored = s.generate(Request(p, max_tokens=5, prompt_logprobs=3))
    assert scored.usage["cached_tokens"] == 0 and unscored.token_ids == scored.token_ids
    only = s.generate(Request(p, max_tokens=0, prompt_logprobs=0))
    assert only.finish_reason == "length" and only.token_ids == [] and only.usage["completion_tokens"] == 0
    for c, k in ((scored, 3), (only, 0)):
        assert len(c.prompt_logprobs) == len(p) and c.prompt_logprobs[0] == (None, [])
        for i, (lp, top) in enumerate(c.prompt_logprobs[1:], start=1):
            assert lp == pytest.approx(want[i - 1, p[i]], abs=1e-9)
            assert [t for t, _ in top] == list(np.argsort(-want[i - 1], kind="stable")[:k])
    with pytest.raises(AlchemistError, match="prompt_logprobs must be >= 0"):
        s.submit(Request(p, prompt_logprobs=-1))


def test_requests_sharing_a_prompt_prefill_it_once(tok):
    """Three requests of one 14-token prompt submitted together (n = 3 choices): the first prefills it, the others
    wait for its rows and prefill only what the chunk-aligned copy leaves (2 tokens each); each draws what it
    draws alone. A scored prompt does not wait (it reuses nothing)."""
    p = prompts(1, seed=22, lo=14, hi=15)[0]
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
    alone = [solo(tok, p, 6, sp).token_ids for sp in params]
    engine = toy(n_slots=4, chunk=4)
    s = Scheduler(engine, tok)
    events: dict = {}
    for i, sp in enumerate(params):
        s.submit(Request(p, sp, 6, sink=collect(events)(i)))
    run_until_idle(s)
    assert [ids_of(events[i]) for i in range(3)] == alone
    assert [events[i][-1].usage["cached_tokens"] for i in range(3)] == [0, 12, 12]
    assert s.stats.kv_cache_usage == 0  # nothing runs
    assert engine.stats.prefill_tokens == 14 + 2 + 2
    scored: dict = {}
    s.submit(Request(p, max_tokens=5, sink=collect(scored)("a")))
    s.submit(Request(p, max_tokens=0, prompt_logprobs=0, sink=collect(scored)("b")))
    s.step()
    assert sum(slot.request is not None for slot in s._slots) == 2  # both admitted at once
    held = sum(len(slot.kv_ids) for slot in s._slots if slot.request is not None)
    assert held > 0 and s.stats.kv_cache_usage == held / (4 * 64)  # /metrics' alchemist_kv_cache_usage_ratio
    run_until_idle(s)


def test_a_constraint_masks_the_sampler_and_its_failure_ends_only_its_request(tok):
    """Request.constraint: the sampler draws from the masked logits (a constraint that allows one token gets it,
    logprobs still report the model's distribution); a constraint that raises ends its request alone."""
    p, q = prompts(2, seed=23)

    class Only:
        def __init__(self, token, fail_after=None):
            self.token, self.fail_after, self.seen = token, fail_after, []

        def allowed(self, logits):
            out = np.full_like(logits, -np.inf)
            out[self.token] = 0.0
            return out

        def consume(self, token):
            self.seen.append(token)
            if self.fail_after is not None and len(self.seen) > self.fail_after:
                raise ValueError("the grammar broke")

    s = Scheduler(toy(n_slots=2), tok)
    forced = s.generate(Request(p, SamplingParams(temperature=1.0, seed=4), 5, logprobs=0, constraint=Only(77)))
    assert forced.token_ids == [77] * 5 and forced.finish_reason == "length"
    assert all(lp < 0 for lp, _ in forced.logprobs)  # the model's own distribution, not the mask's
    events: dict = {}
    s.submit(Request(p, max_tokens=8, constraint=Only(78, fail_after=2), sink=collect(events)("bad")))
    s.submit(Request(q, max_tokens=8, sink=collect(events)("good")))
    run_until_idle(s)
    assert events["bad"][-1].finish_reason == "error" and "the grammar broke" in events["bad"][-1].error
    assert ids_of(events["good"]) == solo(tok, q, 8).token_ids


def test_threaded_generate_from_many_threads(tok):
    ps = prompts(6, seed=10)
    want = [solo(tok, p, 9).token_ids for p in ps]
    s = Scheduler(toy(n_slots=3), tok)
    s.start()
    try:
        got = [None] * len(ps)

        def worker(i):
            got[i] = s.generate(Request(ps[i], max_tokens=9), timeout=30).token_ids

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(ps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert got == want
        assert s.stats.running
    finally:
        s.stop(drain_s=1)
    assert not s.stats.running and not s.running
    with pytest.raises(SchedulerClosed):
        s.submit(Request(ps[0], max_tokens=1))


class SlowToy(ToySlotEngine):
    def decode(self, slots, tokens, positions):
        time.sleep(0.01)
        return super().decode(slots, tokens, positions)


def test_stop_drains_or_cancels(tok):
    p = prompts(1, seed=11)[0]
    s = Scheduler(SlowToy(N_VOCAB, n_slots=2, capacity=64, chunk=4), tok)
    s.start()
    events: dict = {}
    s.submit(Request(p, max_tokens=10, sink=collect(events)("short")))
    s.submit(Request(p, max_tokens=45, sink=collect(events)("long")))
    time.sleep(0.05)
    t0 = time.perf_counter()
    s.stop(drain_s=0.2)  # "short" finishes within the drain, "long" (~0.45 s) does not
    assert time.perf_counter() - t0 < 2
    assert events["short"][-1].finish_reason == "length" and len(ids_of(events["short"])) == 10
    assert events["long"][-1].finish_reason == "cancelled"
    assert s.stats.active_slots == 0 and not s.running
    # a scheduler driven synchronously drains in the caller's thread
    s = Scheduler(toy(n_slots=1), tok)
    events = {}
    s.submit(Request(p, max_tokens=5, sink=collect(events)("q")))
    s.stop(drain_s=5)
    assert events["q"][-1].finish_reason == "length"


def test_stream_and_closing_it_cancels(tok):
    p = prompts(1, seed=12)[0]
    s = Scheduler(toy(n_slots=1), tok)
    evs = list(s.stream(Request(p, max_tokens=4)))
    assert len(evs) == 5 and isinstance(evs[-1], DoneEvent)
    it = s.stream(Request(p, max_tokens=30))
    next(it)
    it.close()  # the consumer went away: the request is cancelled and the slot freed
    assert s.idle and s.stats.requests_finished["cancelled"] == 1
    timed = s.generate(Request(p, max_tokens=30), timeout=0)
    assert timed.finish_reason == "cancelled"


def test_a_sink_that_raises_cancels_only_its_request(tok):
    a, b = prompts(2, seed=13)
    s = Scheduler(toy(n_slots=2), tok)
    events: dict = {}

    def broken(ev):
        raise RuntimeError("client went away")

    s.submit(Request(a, max_tokens=20, sink=broken))
    s.submit(Request(b, max_tokens=7, sink=collect(events)("b")))
    run_until_idle(s)
    assert s.stats.requests_finished == {"cancelled": 1, "length": 1}
    assert ids_of(events["b"]) == solo(tok, b, 7).token_ids


def test_a_failure_in_one_slot_of_a_running_batch_ends_only_its_request(tok):
    """A request whose sampling raises (injected into its slot mid-stream) ends with an error of its own; the other
    request in the same decode batch finishes as it would alone, and the scheduler serves the next one."""
    a, b, c = prompts(3, seed=14)
    s = Scheduler(toy(n_slots=2), tok)
    events: dict = {}
    s.submit(Request(a, max_tokens=20, sink=collect(events)("a"), id="a"))
    s.submit(Request(b, max_tokens=12, sink=collect(events)("b"), id="b"))
    while len(events.get("a", [])) < 3:  # both decode in one batch by now
        s.step()
    slot = next(x for x in s._slots if x.request is not None and x.request.id == "a")

    def failing(logits, previous):
        raise ValueError("Probabilities contain NaN")

    slot.sampler = failing
    run_until_idle(s)
    done_a = events["a"][-1]
    assert done_a.finish_reason == "error" and "Probabilities contain NaN" in done_a.error
    assert ids_of(events["b"]) == solo(tok, b, 12).token_ids and events["b"][-1].finish_reason == "length"
    assert s.generate(Request(c, max_tokens=5)).token_ids == solo(tok, c, 5).token_ids


# ------------------------------------------------------------------------------ inference() joins the batch


@pytest.fixture()
def toy_model(tiny_gguf, tok):
    """A LoadedModel whose engine is never used: inference() goes through an injected toy Scheduler."""
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.runtime.api import LoadedModel

    path = tiny_gguf("llama")
    ir = build_model_ir(read_gguf(path))
    model = LoadedModel(str(path), "c", ir, None, None, None, tok, 0.0, 0.0, 0.0, 0.0)
    model._scheduler = Scheduler(SlowToy(N_VOCAB, n_slots=4, capacity=64, chunk=4), tok)  # slow: threads overlap
    model._scheduler.start()
    yield model
    model.stop_batching(drain_s=1)
    assert not model.batching


def test_concurrent_inference_joins_the_batch(toy_model, tok):
    from alchemist import inference

    texts = ["the cat", "and the dog", "it is", "on the w", "by the", "that was it"]
    want = {t: solo(tok, tok.encode(t), 8) for t in texts}
    got = {}
    barrier = threading.Barrier(len(texts))

    def worker(t):
        barrier.wait()
        got[t] = inference(toy_model, input=t, max_tokens=8)

    threads = [threading.Thread(target=worker, args=(t,)) for t in texts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    for t in texts:
        r = got[t]
        assert r.output_token_ids == want[t].token_ids and r.output == want[t].text
        assert r.prompt_token_ids == tok.encode(t)
        assert r.stop_reason == {"length": "max_tokens", "stop": "eos"}[want[t].finish_reason]
        assert r.report["generated_tokens"] == len(r.output_token_ids) and r.report["batched"]["slots"] == 4
        assert r.report["timings"]["first_token_s"] > 0 and "compilations" in r.report
    assert toy_model._scheduler.engine.stats.decode_rows > toy_model._scheduler.engine.stats.decode_steps


def test_batched_inference_streams_its_output_and_stops(toy_model, tok):
    from alchemist import inference

    free = inference(toy_model, input="the cat", max_tokens=20)
    assert free.stop_reason == "max_tokens" and len(free.output) > 8
    stop = free.output[4:7]
    pieces = []
    cut = inference(toy_model, input="the cat", max_tokens=20, stop=[stop], stream=pieces.append)
    assert cut.stop_reason == "stop_string" and "".join(pieces) == cut.output == free.output[: free.output.index(stop)]
    with pytest.raises(AlchemistError, match="exceeds the context"):
        inference(toy_model, input="the cat", max_tokens=70)


def test_start_batching_builds_a_slot_engine_and_scheduler(tiny_gguf, tok, monkeypatch):
    """The wiring of LoadedModel.start_batching, with the toy standing in for alchemist.runtime.slot_engine."""
    import sys
    import types

    from alchemist import inference
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.runtime.api import LoadedModel

    made = {}

    def fake_slot_engine(engine, n_slots, chunk, decode_buckets, full_window):
        made.update(engine=engine, n_slots=n_slots, chunk=chunk, buckets=decode_buckets, full_window=full_window)
        return toy(n_slots=n_slots, chunk=chunk, buckets=decode_buckets)

    monkeypatch.setitem(
        sys.modules, "alchemist.runtime.slot_engine", types.SimpleNamespace(SlotEngine=fake_slot_engine)
    )
    path = tiny_gguf("llama")
    model = LoadedModel(str(path), "c", build_model_ir(read_gguf(path)), None, None, "ENGINE", tok, 0, 0, 0, 0)
    sched = model.start_batching(slots=3, chunk=4, decode_buckets=(1, 2))
    try:
        assert made == dict(engine="ENGINE", n_slots=3, chunk=4, buckets=(1, 2), full_window=False)
        assert model.batching and sched.running and sched.stats.n_slots == 3
        with pytest.raises(AlchemistError, match="already batching"):
            model.start_batching()
        r = inference(model, input="the cat", max_tokens=5)
        assert r.output_token_ids == solo(tok, tok.encode("the cat"), 5).token_ids
    finally:
        model.stop_batching()
    assert not model.batching and not sched.running
