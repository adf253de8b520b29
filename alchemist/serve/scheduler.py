"""Continuous batching: requests join and leave a running batch of KV-cache slots between steps.

`Scheduler(slot_engine, tokenizer)` owns a `SlotEngine` (alchemist.runtime.slot_engine) or anything with its
interface. `step()` is one synchronous scheduling step, so tests drive it without threads:

1. requests cancelled since the last step free their slots (queued ones are dropped);
2. queued requests are admitted into free slots, reusing the longest cached prompt prefix (a free slot's own
   KV, or rows copied from another slot); one that shares a chunk or more with a prompt still being prefilled
   waits for those rows (n choices of one prompt prefill it once);
3. the oldest slot still prefilling runs **one** chunk of its prompt; when the prompt is done its first token
   is sampled (a request that scores its prompt, prompt_logprobs, gets every prompt position's logits from the
   same prefill, and a PromptEvent; with max_tokens 0 it ends there);
4. every slot that is decoding runs in **one** batched decode step (split by the engine's largest bucket);
5. each row is sampled with its request's own `Sampler` (a seeded request draws the same tokens whatever else
   runs), its text is streamed through `TextStream`, and it finishes on eos / a stop string / max_tokens / the
   slot capacity.

`start()` runs `step()` on a daemon thread, the only thread that then calls PyTensor. Events go to each
request's `sink` from that thread; `generate()` and `stream()` are blocking helpers on top (they drive `step()`
themselves when no thread is running).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from alchemist.errors import AlchemistError
from alchemist.runtime.sampling import Sampler, SamplingParams
from alchemist.serve.events import DoneEvent, Event, PromptEvent, QueueFull, SchedulerClosed, TokenEvent
from alchemist.serve.text import TextStream


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = 16  # None: until the slot capacity
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob and the top-k alternatives
    sink: Callable[[Event], None] | None = None  # called from the scheduler thread; must not block
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ignore_eos: bool = False  # generate through eos tokens (fixed-length benchmarks)
    # None: off; k >= 0: score the prompt (a PromptEvent: each token's logprob and the top-k at its position); the
    # prompt is then prefilled whole, never taken from a slot's cache, which keeps no logits
    prompt_logprobs: int | None = None
    # structured output (alchemist.serve.constraints.Constraint): masks each row of logits before the sampler
    # draws, and advances with every token; once its grammar is complete only an end-of-generation token is left
    constraint: object | None = None
    t_submit: float | None = None
    t_admit: float | None = None
    t_first: float | None = None
    t_done: float | None = None


@dataclass
class Completion:
    """What `Scheduler.generate` returns: the request's events put together."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict
    timings: dict
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per token: (logprob, top alternatives)
    error: str | None = None
    matched_stop: str | int | None = None
    prompt_logprobs: list[tuple[float | None, list[tuple[int, float]]]] | None = None  # a scored prompt's, per token


class Histogram:
    """A Prometheus-style histogram (cumulative buckets, sum, count) that also keeps recent samples."""

    def __init__(self, buckets: Sequence[float], keep: int = 4096):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0
        self.samples: collections.deque[float] = collections.deque(maxlen=keep)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1
        self.samples.append(value)

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound, count of samples <= it), ..., (inf, count)]."""
        return list(zip(self.buckets + (float("inf"),), itertools.accumulate(self.counts)))

    def quantile(self, q: float) -> float | None:
        return float(np.quantile(list(self.samples), q)) if self.samples else None


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class SchedulerStats:
    n_slots: int = 0
    queue_depth: int = 0
    active_slots: int = 0
    requests_total: int = 0  # submitted
    requests_finished: dict = field(default_factory=lambda: collections.Counter())  # by finish reason
    generated_tokens_total: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0  # prompt tokens whose KV came from a slot's cache instead of a prefill
    prefill_tokens_total: int = 0
    steps: int = 0
    decode_steps: int = 0
    ttft_seconds: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    itl_seconds: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    started_at: float = field(default_factory=time.time)
    running: bool = False
    warming: bool = False
    kv_cache_usage: float = 0.0  # share of the slots' positions (n_slots x context) that running requests hold


class _Slot:
    def __init__(self, index: int):
        self.index = index
        self.request: Request | None = None
        self.kv_ids: list[int] = []  # the ids whose KV this slot holds at positions 0.. (kept for reuse)
        self.prompt_done = 0
        self.out_ids: list[int] = []
        self.prompt_logprobs: list = []  # a scoring request's, (logprob, top) per prompt position so far
        self.sampler: Sampler | None = None
        self.text: TextStream | None = None
        self.cached_tokens = 0
        self.order = 0  # admission order: the oldest prefilling slot goes first
        self.t_last = 0.0

    @property
    def prefilling(self) -> bool:
        return self.request is not None and self.prompt_done < len(self.request.prompt)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class Scheduler:
    def __init__(self, slot_engine, tokenizer, max_queue: int = 64, eos_ids: Sequence[int] | None = None):
        if max_queue < 1:
            raise AlchemistError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = slot_engine
        self.tokenizer = tokenizer
        self.max_queue = int(max_queue)
        self.max_context = int(slot_engine.capacity)
        self.n_vocab = int(slot_engine.n_vocab)
        if eos_ids is None:
            eos_ids = getattr(tokenizer, "eos_ids", ()) if tokenizer is not None else ()
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        # rows per decode call: the engine's largest bucket (8 when it does not say: the SlotEngine default)
        self._max_batch = max(getattr(slot_engine, "decode_buckets", None) or (min(slot_engine.n_slots, 8),))
        self._slots = [_Slot(i) for i in range(slot_engine.n_slots)]
        self._queue: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()  # guards the queue and the request table (submit/cancel from any thread)
        self._step_lock = threading.Lock()  # one step at a time
        self._live: dict[str, Request] = {}
        self._wake = threading.Event()
        self.ready = threading.Event()  # set by the loop thread once it serves (after its warm-up)
        self.warm_up_error: BaseException | None = None
        self._closing = False
        self._halt = False
        self._thread: threading.Thread | None = None
        self._admitted = itertools.count()
        self.stats = SchedulerStats(n_slots=slot_engine.n_slots)

    # -- submitting ---------------------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue a request. Raises QueueFull when the queue is full, SchedulerClosed while stopping, and
        AlchemistError for a prompt (plus max_tokens) over the slot capacity or token ids out of range."""
        prompt = [int(t) for t in req.prompt]
        if not prompt:
            raise AlchemistError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.n_vocab]
        if bad:
            raise AlchemistError(f"prompt token ids out of range [0, {self.n_vocab}): {bad[:5]}")
        if req.max_tokens is not None and req.max_tokens < 0:
            raise AlchemistError(f"max_tokens must be >= 0, got {req.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(req, name) is not None and getattr(req, name) < 0:
                raise AlchemistError(f"{name} must be >= 0, got {getattr(req, name)}")
        need = len(prompt) + (req.max_tokens or 0)
        if need > self.max_context or len(prompt) >= self.max_context:
            raise AlchemistError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({req.max_tokens}) exceeds the context of "
                f"{self.max_context} tokens per slot"
            )
        req.prompt = prompt
        with self._lock:
            if self._closing:
                raise SchedulerClosed("the scheduler is stopping and admits no new requests")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            if req.id in self._live:
                raise AlchemistError(f"request id {req.id!r} is already running")
            req.t_submit = time.perf_counter()
            self._queue.append(req)
            self._live[req.id] = req
            self.stats.requests_total += 1
            self.stats.queue_depth = len(self._queue)
        self._wake.set()
        return req

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; its slot is freed (and its DoneEvent sent) at the next step."""
        with self._lock:
            req = self._live.get(request_id)
        if req is not None:
            req.cancelled.set()
            self._wake.set()

    # -- one step -----------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step. Returns False when there was nothing to do."""
        with self._step_lock:
            worked = self._drop_cancelled()
            worked |= self._admit()
            worked |= self._prefill_one_chunk()
            worked |= self._decode()
            self.stats.active_slots = sum(s.request is not None for s in self._slots)
            held = sum(len(s.kv_ids) for s in self._slots if s.request is not None)
            self.stats.kv_cache_usage = held / (len(self._slots) * self.max_context)
            self.stats.queue_depth = len(self._queue)
            if worked:
                self.stats.steps += 1
            return worked

    def _drop_cancelled(self) -> bool:
        worked = False
        with self._lock:
            dropped = [r for r in self._queue if r.cancelled.is_set()]
            for r in dropped:
                self._queue.remove(r)
        for r in dropped:
            self._finish_request(r, "cancelled")
            worked = True
        for slot in self._slots:
            if slot.request is not None and slot.request.cancelled.is_set():
                self._finish(slot, "cancelled")
                worked = True
        return worked

    def _admit(self) -> bool:
        worked = False
        while True:
            free = [s for s in self._slots if s.request is None]
            if not free:
                return worked
            with self._lock:
                req = next((r for r in self._queue if not self._sibling_prefilling(r)), None)
                if req is None:
                    return worked
                self._queue.remove(req)
            self._start(req, free)
            worked = True

    def _sibling_prefilling(self, req: Request) -> bool:
        """Whether a running prompt still being prefilled shares a whole chunk or more with req's (n > 1 choices of
        one prompt, a batch over one context): req then waits, and copies those rows once they are written instead
        of prefilling them again (prefill runs one prompt at a time, so it would have waited anyway). A scored
        prompt never reuses rows, and never waits."""
        if req.prompt_logprobs is not None:
            return False
        chunk = getattr(self.engine, "chunk", 1)
        return any(s.prefilling and _common_prefix(s.request.prompt, req.prompt) >= chunk for s in self._slots)

    def _start(self, req: Request, free: list[_Slot]) -> None:
        """Put req into the free slot that can reuse the most of its prompt (copying rows from a busier slot's
        cache when that reuses more)."""
        n = len(req.prompt)

        def reuse(s: _Slot) -> int:
            if req.prompt_logprobs is not None:  # every position's logits are wanted: nothing comes from a cache
                return 0
            return self.engine.reusable_prefix(len(s.kv_ids), _common_prefix(s.kv_ids, req.prompt), n, s.index)

        own = {s.index: reuse(s) for s in free}
        slot = max(free, key=lambda s: (own[s.index], -s.index))
        k = own[slot.index]
        others = [s for s in self._slots if s is not slot]
        donor = max(others, key=lambda s: (reuse(s), -s.index), default=None)
        if donor is not None and reuse(donor) > k:
            k = reuse(donor)
            try:
                self.engine.copy_prefix(donor.index, slot.index, k)
            except BaseException:
                slot.kv_ids = []
                raise
            slot.kv_ids = list(donor.kv_ids[:k])
        else:
            self.engine.copy_prefix(slot.index, slot.index, k)  # a recurrent model's states go back to k
        del slot.kv_ids[k:]  # rows from k on will be overwritten
        req.t_admit = time.perf_counter()
        slot.request, slot.prompt_done, slot.out_ids, slot.cached_tokens = req, k, [], k
        slot.prompt_logprobs = [(None, [])]  # the first token has nothing before it
        slot.sampler = Sampler(req.params)
        slot.text = TextStream(self.tokenizer, req.stop, ()) if self.tokenizer is not None else None
        slot.order = next(self._admitted)
        self.stats.prompt_tokens_total += n
        self.stats.cached_tokens_total += k
        if req.max_tokens == 0 and req.prompt_logprobs is None:
            self._finish(slot, "length")

    def _prefill_one_chunk(self) -> bool:
        pending = [s for s in self._slots if s.prefilling]
        if not pending:
            return False
        slot = min(pending, key=lambda s: s.order)
        req = slot.request
        prompt, scoring = req.prompt, req.prompt_logprobs is not None
        # beside decoding streams a prompt goes in the engine's smaller pieces, so that no stream waits a whole chunk
        pieces = {"pieces": True} if self._decoding() and getattr(self.engine, "piece", None) else {}
        a, b = self.engine.chunk_plan(len(prompt), slot.prompt_done, **pieces)[0]
        try:
            # logits where they are read: every row when scoring, else the prompt's last token only
            wanted = {"all_rows": True} if scoring else {"logits": b == len(prompt)}
            logits = self.engine.prefill(slot.index, prompt[a:b], a, **wanted)
        except Exception as e:  # noqa: BLE001 (the request fails, the server goes on)
            slot.kv_ids = []
            self._finish(slot, "error", error=f"prefill failed: {e}")
            return True
        except BaseException:
            slot.kv_ids = []
            raise
        slot.kv_ids.extend(prompt[a:b])
        slot.prompt_done = b
        self.stats.prefill_tokens_total += b - a
        if scoring:
            logits = np.asarray(logits).reshape(b - a, -1)
            if not self._score(slot, logits, a, b):
                return True
            logits = logits[-1]
        if b == len(prompt):
            if req.max_tokens == 0:  # scored, nothing to generate
                self._finish(slot, "length")
            else:
                self._accept(slot, np.asarray(logits).reshape(-1))
        return True

    def _score(self, slot: _Slot, logits: np.ndarray, a: int, b: int) -> bool:
        """Add the log-probabilities of the prompt tokens after positions a..b-1 (logits: one row per position) and,
        at the prompt's end, emit its PromptEvent. False when this failed and ended the request."""
        req = slot.request
        try:
            for p, row in zip(range(a, min(b, len(req.prompt) - 1)), logits):
                slot.prompt_logprobs.append(_logprobs(row, req.prompt[p + 1], req.prompt_logprobs))
            if b == len(req.prompt):
                self._emit(req, PromptEvent(req.id, slot.prompt_logprobs))
            return True
        except Exception as e:  # noqa: BLE001 (the request fails, the server goes on)
            self._finish(slot, "error", error=f"scoring the prompt failed: {type(e).__name__}: {e}")
            return False

    def _decoding(self) -> list[_Slot]:
        """The slots whose sequences decode in the next step."""
        return [s for s in self._slots if s.request is not None and not s.prefilling and s.out_ids]

    def _decode(self) -> bool:
        rows = self._decoding()
        if not rows:
            return False
        for i in range(0, len(rows), self._max_batch):
            group = rows[i : i + self._max_batch]
            tokens = [s.out_ids[-1] for s in group]
            positions = [len(s.kv_ids) for s in group]
            try:
                logits = self.engine.decode([s.index for s in group], tokens, positions)
            except Exception as e:  # noqa: BLE001
                for s in group:
                    s.kv_ids = []
                    self._finish(s, "error", error=f"decode failed: {e}")
                continue
            except BaseException:
                for s in group:
                    s.kv_ids = []
                raise
            self.stats.decode_steps += 1
            for s, t, row in zip(group, tokens, np.asarray(logits)):
                s.kv_ids.append(t)
                self._accept(s, row)
        return True

    def _accept(self, slot: _Slot, logits: np.ndarray) -> None:
        """Sample the next token of slot's request from logits, emit it, and finish the request if it is done. A
        failure here (sampling, detokenizing) ends this request alone: the batch goes on."""
        try:
            self._sample(slot, logits)
        except Exception as e:  # noqa: BLE001 (the request fails, the server goes on)
            if slot.request is not None:
                slot.text = None  # its detokenizer may be what failed
                self._finish(slot, "error", error=f"sampling failed: {type(e).__name__}: {e}")

    def _sample(self, slot: _Slot, logits: np.ndarray) -> None:
        req = slot.request
        previous = (req.prompt + slot.out_ids) if req.params.repetition_penalty != 1.0 else []
        raw = logits  # logprobs report the model's distribution, not the constrained one
        if req.constraint is not None:
            logits = req.constraint.allowed(logits)
        tok = slot.sampler(logits, previous)
        now = time.perf_counter()
        if req.t_first is None:
            req.t_first = now
            self.stats.ttft_seconds.observe(now - req.t_submit)
        else:
            self.stats.itl_seconds.observe(now - slot.t_last)
        slot.t_last = now
        if tok in self.eos_ids and (not req.ignore_eos or req.constraint is not None):  # a grammar's end ends it
            tail = slot.text.flush() if slot.text is not None else ""  # eos renders as nothing
            self._finish(slot, "stop", tail, matched=tok)
            return
        if req.constraint is not None:
            req.constraint.consume(tok)
        slot.out_ids.append(tok)
        self.stats.generated_tokens_total += 1
        delta, reason = slot.text.feed(tok) if slot.text is not None else ("", None)
        lp = top = None
        if req.logprobs is not None:
            lp, top = _logprobs(raw, tok, req.logprobs)
        self._emit(req, TokenEvent(req.id, tok, delta, lp, top))
        if reason is not None:
            self._finish(slot, reason, matched=slot.text.matched_stop)
        elif req.max_tokens is not None and len(slot.out_ids) >= req.max_tokens:
            self._finish(slot, "length")
        elif len(slot.kv_ids) >= self.max_context:  # the next token has no position left
            self._finish(slot, "length")

    # -- finishing ----------------------------------------------------------------------------------------
    def _finish(self, slot: _Slot, reason: str, tail: str = "", error: str | None = None, matched=None) -> None:
        req = slot.request
        if slot.text is not None and reason != "stop":
            tail += slot.text.flush()
        self._finish_request(req, reason, tail, len(slot.out_ids), slot.cached_tokens, error, matched)
        slot.request, slot.sampler, slot.text, slot.prompt_logprobs = None, None, None, []

    def _finish_request(
        self,
        req: Request,
        reason: str,
        tail: str = "",
        n_out: int = 0,
        cached: int = 0,
        error: str | None = None,
        matched=None,
    ) -> None:
        req.t_done = time.perf_counter()
        n_prompt = len(req.prompt)
        timings = {"total_s": req.t_done - req.t_submit}
        if req.t_admit is not None:
            timings["queue_s"] = req.t_admit - req.t_submit
        if req.t_first is not None:
            timings["ttft_s"] = req.t_first - req.t_submit
            if n_out > 1 and req.t_done > req.t_first:
                timings["decode_tok_per_s"] = (n_out - 1) / (req.t_done - req.t_first)
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "cached_tokens": cached,
        }
        with self._lock:
            self._live.pop(req.id, None)
        self.stats.requests_finished[reason] += 1
        self._emit(req, DoneEvent(req.id, reason, tail, usage, timings, error, matched))

    def _emit(self, req: Request, ev: Event) -> None:
        if req.sink is not None:
            try:
                req.sink(ev)
            except Exception:  # noqa: BLE001 (a broken consumer must not stop the batch)
                req.cancelled.set()

    # -- the loop thread ----------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._queue and all(s.request is None for s in self._slots)

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile (or link) every shape the engine will run; stats.warming is True meanwhile."""
        self.stats.warming = True
        try:
            self.engine.warm_up(progress)
        finally:
            self.stats.warming = False

    def start(self, warm_up: bool = False, progress: Callable[[str], None] | None = None) -> None:
        """Run step() on a daemon thread (first warming up the engine there when warm_up is True; `ready` is set
        once it serves).

        Warm up here rather than on the caller's thread: every thread that runs an OpenMP kernel keeps a pool of
        OpenMP threads, and once the pools hold more threads than there are cores libgomp stops spin-waiting,
        which made each step of the loop thread ~35% slower after a warm-up on the main thread."""
        if self.running:
            return
        self._halt = False
        self._closing = False
        self.ready.clear()
        if warm_up:
            self.stats.warming = True
        self._thread = threading.Thread(
            target=self._loop, args=(warm_up, progress), name="alchemist-scheduler", daemon=True
        )
        self.stats.running = True
        self._thread.start()

    def _loop(self, warm_up: bool, progress: Callable[[str], None] | None = None) -> None:
        try:
            if warm_up:
                try:
                    self.warm_up(progress)
                except BaseException as e:  # noqa: BLE001 (handed to whoever waits on `ready`)
                    self.warm_up_error = e
                    return
            self.ready.set()
            while not self._halt:
                try:
                    worked = self.step()
                except Exception as e:  # noqa: BLE001 (a bug must not leave clients waiting forever)
                    self._fail_all(f"scheduler step failed: {type(e).__name__}: {e}")
                    continue
                if not worked:
                    self._wake.wait(0.5)
                    self._wake.clear()
        finally:
            self.stats.running = False
            self.ready.set()  # nobody waits forever on a loop that ended

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the loop thread serves; re-raise its warm-up error."""
        self.ready.wait(timeout)
        if self.warm_up_error is not None:
            raise self.warm_up_error

    def _fail_all(self, error: str) -> None:
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
        for req in queued:
            self._finish_request(req, "error", error=error)
        for slot in self._slots:
            if slot.request is not None:
                slot.kv_ids = []
                self._finish(slot, "error", error=error)

    def stop(self, drain_s: float = 10.0) -> None:
        """Stop admitting new requests, let queued and running ones finish for up to drain_s seconds, cancel the
        rest, and join the loop thread. Without a thread, the caller's thread drives the remaining steps."""
        with self._lock:
            self._closing = True
        deadline = time.perf_counter() + max(0.0, drain_s)
        while not self.idle and time.perf_counter() < deadline:
            if self.running:
                time.sleep(0.01)
            else:
                self.step()
        with self._lock:
            live = list(self._live.values())
        for req in live:
            req.cancelled.set()
        self._wake.set()
        if self.running:
            while not self.idle and self.running:
                time.sleep(0.005)
            self._halt = True
            self._wake.set()
            self._thread.join()
        else:
            while not self.idle:
                self.step()
        self._thread = None
        self.stats.running = False

    # -- blocking helpers ---------------------------------------------------------------------------------
    def stream(self, req: Request, timeout: float | None = None, poll_s: float = 0.05) -> Iterator[Event]:
        """Submit req and yield its events until (and including) its DoneEvent. Closing the iterator early
        cancels the request, and so does running past `timeout` seconds (the DoneEvent then says "cancelled").
        Without a loop thread, the caller's thread drives step()."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        events: queue.SimpleQueue = queue.SimpleQueue()
        user_sink = req.sink

        def sink(ev: Event) -> None:
            events.put(ev)
            if user_sink is not None:
                user_sink(ev)

        req.sink = sink
        self.submit(req)
        done = False
        try:
            while not done:
                if deadline is not None and time.perf_counter() > deadline and not req.cancelled.is_set():
                    self.cancel(req.id)
                if not self.running:
                    while events.empty():
                        if not self.step() and events.empty():
                            raise AlchemistError(f"request {req.id} stalled: the scheduler had nothing to do")
                    ev = events.get()
                else:
                    try:
                        ev = events.get(timeout=poll_s)
                    except queue.Empty:
                        continue
                done = isinstance(ev, DoneEvent)
                yield ev
        finally:
            if not done:
                self.cancel(req.id)
                if not self.running:  # free the slot now: nobody else will step
                    while req.id in self._live:
                        self.step()

    def generate(self, req: Request, timeout: float | None = None) -> Completion:
        """Submit req, wait for it to finish and return the Completion (thread-safe). On timeout the request is
        cancelled and the Completion says "cancelled"."""
        parts, ids, lps, scored = [], [], [], None
        done: DoneEvent | None = None
        for ev in self.stream(req, timeout):
            if isinstance(ev, PromptEvent):
                scored = ev.logprobs
            elif isinstance(ev, TokenEvent):
                parts.append(ev.text)
                ids.append(ev.token_id)
                if req.logprobs is not None:
                    lps.append((ev.logprob, ev.top_logprobs))
            else:
                parts.append(ev.text)
                done = ev
        return Completion(
            req.id,
            "".join(parts),
            ids,
            done.finish_reason,
            done.usage,
            done.timings,
            lps if req.logprobs is not None else None,
            done.error,
            done.matched_stop,
            scored,
        )


def _logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """log-softmax of the raw logits: the chosen token's logprob and the k most likely (id, logprob)."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    top: list[tuple[int, float]] = []
    if k:
        k = min(k, z.size)
        ids = np.argpartition(-z, k - 1)[:k]
        ids = ids[np.lexsort((ids, -z[ids]))]
        top = [(int(i), float(z[i] - lse)) for i in ids]
    return float(z[token] - lse), top


__all__ = [
    "Completion",
    "DoneEvent",
    "Event",
    "Histogram",
    "PromptEvent",
    "QueueFull",
    "Request",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerStats",
    "TokenEvent",
]
