"""A small scheduler with the serving contract's Scheduler interface (Part 2), over `serving_toy.ToySlotEngine`.

It is not alchemist.serve.scheduler: it prefills a whole prompt at admission and decodes every running slot once per
step, which is all the server tests need (real token streams, stop strings, logprobs, cancel, a queue that fills).
`gate` pauses the loop so a test can fill the queue; `step_delay` slows it so a test can disconnect mid-stream."""

from __future__ import annotations

import itertools
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import numpy as np

from alchemist.errors import AlchemistError
from alchemist.runtime.sampling import Sampler, SamplingParams
from alchemist.serve.events import DoneEvent, QueueFull, TokenEvent


@dataclass
class FakeRequest:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    sink: Callable | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ignore_eos: bool = False
    t_submit: float | None = None
    t_first: float | None = None
    t_done: float | None = None


class Histogram:
    """Cumulative buckets + sum + count, as alchemist.serve.scheduler keeps its latencies."""

    def __init__(self, buckets=(0.01, 0.1, 1.0)):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * (len(buckets) + 1), 0.0, 0

    def observe(self, v: float) -> None:
        self.counts[sum(v > b for b in self.buckets)] += 1
        self.sum += v
        self.count += 1

    def cumulative(self):
        return list(zip(self.buckets + (float("inf"),), itertools.accumulate(self.counts)))


@dataclass
class _Slot:
    req: FakeRequest
    pos: int
    last: int
    sampler: Sampler
    decoder: object
    out_ids: list = field(default_factory=list)
    pending: str = ""
    t_last: float = 0.0


class FakeScheduler:
    def __init__(self, engine, tokenizer, max_queue: int = 64, step_delay: float = 0.0):
        self.engine, self.tokenizer = engine, tokenizer
        self.queue: queue.Queue = queue.Queue(max_queue)
        self.max_context = engine.capacity
        self.slots: list[_Slot | None] = [None] * engine.n_slots
        self.step_delay = step_delay
        self.gate = threading.Event()
        self.gate.set()
        self.cancelled_ids: list[str] = []
        self.stopped_with: float | None = None
        self._wake = threading.Event()
        self._halt = False
        self._thread = None
        self._lock = threading.Lock()
        self.stats = SimpleNamespace(
            queue_depth=0, active_slots=0, n_slots=engine.n_slots, requests_total=0, generated_tokens_total=0,
            prompt_tokens_total=0, cached_tokens_total=0, ttft_seconds=Histogram(), itl_seconds=[], started_at=None,
            running=False, warming=False,
        )  # fmt: skip

    # ------------------------------------------------------------------ the contract's surface
    def submit(self, req):
        if len(req.prompt) + req.max_tokens > self.max_context:
            raise AlchemistError(f"prompt {len(req.prompt)} + max_tokens {req.max_tokens} > {self.max_context}")
        try:
            self.queue.put_nowait(req)
        except queue.Full:
            raise QueueFull(f"{self.queue.maxsize} requests queued") from None
        req.t_submit = time.perf_counter()
        self.last_request = req
        self.stats.requests_total += 1
        self.stats.prompt_tokens_total += len(req.prompt)
        self.stats.queue_depth = self.queue.qsize()
        self._wake.set()
        return req

    def cancel(self, request_id: str) -> None:
        self.cancelled_ids.append(request_id)
        for s in self.slots:
            if s is not None and s.req.id == request_id:
                s.req.cancelled.set()
        self._wake.set()

    def start(self) -> None:
        self._halt = False
        self.stats.running, self.stats.started_at = True, time.time()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="fake-scheduler")
        self._thread.start()

    def stop(self, drain_s: float = 10.0) -> None:
        self.stopped_with = drain_s
        self._halt = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(drain_s + 5)
        self.stats.running = False

    def _loop(self) -> None:
        while not self._halt:
            self.gate.wait()
            busy = self.step()
            if self.step_delay:
                time.sleep(self.step_delay)
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        with self._lock:
            for i, s in enumerate(self.slots):
                if s is not None and (s.req.cancelled.is_set() or s.req.id in self.cancelled_ids):
                    self._finish(i, "cancelled")
            for i in range(len(self.slots)):
                if self.slots[i] is not None:
                    continue
                try:
                    req = self.queue.get_nowait()
                except queue.Empty:
                    break
                if req.id in self.cancelled_ids:
                    self._emit(req, DoneEvent(req.id, "cancelled", "", self._usage(req, 0)))
                    continue
                logits = None
                for a, b in self.engine.chunk_plan(len(req.prompt)):
                    logits = self.engine.prefill(i, req.prompt[a:b], a)
                slot = _Slot(req, len(req.prompt), -1, Sampler(req.params), self.tokenizer.stream_decoder())
                self.slots[i] = slot
                self._take(i, logits)
            active = [i for i, s in enumerate(self.slots) if s is not None]
            if active:
                logits = self.engine.decode(active, [self.slots[i].last for i in active],
                                            [self.slots[i].pos for i in active])  # fmt: skip
                for row, i in enumerate(active):
                    self.slots[i].pos += 1
                    self._take(i, logits[row])
            self.stats.queue_depth = self.queue.qsize()
            self.stats.active_slots = sum(s is not None for s in self.slots)
            return bool(self.stats.active_slots or self.stats.queue_depth)

    def _take(self, i: int, logits: np.ndarray) -> None:
        """Sample slot i's next token from `logits`, emit it, finish the request when it is done."""
        s = self.slots[i]
        req = s.req
        tid = s.sampler(logits, req.prompt + s.out_ids)
        now = time.perf_counter()
        if req.t_first is None:
            req.t_first = now
            self.stats.ttft_seconds.observe(now - req.t_submit)
        else:
            self.stats.itl_seconds.append(now - s.t_last)
        s.t_last = now
        s.out_ids.append(tid)
        s.last = tid
        self.stats.generated_tokens_total += 1
        lp = top = None
        if req.logprobs is not None:
            x = logits.astype(np.float64)
            logp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
            lp = float(logp[tid])
            order = np.argsort(-logp, kind="stable")[: req.logprobs]
            top = [(int(t), float(logp[t])) for t in order]
        if self.tokenizer.is_eog(tid) and not req.ignore_eos:
            self._emit(req, TokenEvent(req.id, tid, "", lp, top))
            return self._finish(i, "stop")
        s.pending += s.decoder.feed(tid)
        for stop in req.stop:
            k = s.pending.find(stop)
            if k >= 0:
                self._emit(req, TokenEvent(req.id, tid, s.pending[:k], lp, top))
                s.pending = ""
                return self._finish(i, "stop", flush=False)
        hold = max((n for stop in req.stop for n in range(len(stop), 0, -1) if s.pending.endswith(stop[:n])), default=0)
        safe, s.pending = s.pending[: len(s.pending) - hold], s.pending[len(s.pending) - hold :]
        self._emit(req, TokenEvent(req.id, tid, safe, lp, top))
        if len(s.out_ids) >= req.max_tokens or s.pos >= self.max_context:
            self._finish(i, "length")

    def _finish(self, i: int, reason: str, flush: bool = True) -> None:
        s = self.slots[i]
        self.slots[i] = None
        tail = s.pending + s.decoder.flush() if flush else ""
        s.req.t_done = time.perf_counter()
        self._emit(s.req, DoneEvent(s.req.id, reason, tail, self._usage(s.req, len(s.out_ids)), {}))

    @staticmethod
    def _usage(req, n_out: int) -> dict:
        n = len(req.prompt)
        return {"prompt_tokens": n, "completion_tokens": n_out, "total_tokens": n + n_out, "cached_tokens": 0}

    @staticmethod
    def _emit(req, ev) -> None:
        if req.sink is not None:
            req.sink(ev)
