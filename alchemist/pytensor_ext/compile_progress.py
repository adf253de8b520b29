"""What a step-function compile is doing, while it does it: rewriting the graph, then C modules linked / total.

A cold compile is PyTensor's graph rewrites followed by linking, in which every distinct C node (op, input and
output types) needs a compiled module: imported from PyTensor's compiledir when it is there, else built with g++
(~0.5-3 s each). `tracking(label, callback)` reports that as CompileEvent's to `callback` for the compiles
started in this thread inside it; `TqdmProgress` draws them as a tqdm bar on stderr:

    decode: rewriting graph  12 s
    decode: C modules  37/120 [00:21, g++=30]

The hooks wrap PyTensor's FunctionMaker.prepare_fgraph (the rewrites), FunctionMaker.create (the linking; the
total is counted there from the rewritten graph), COp.make_c_thunk (each C node linked) and
CLinker.compile_cmodule (each g++ build). Outside `tracking` they only check a thread-local list.
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from alchemist.pytensor_ext import pytensor_internals


@dataclass
class CompileEvent:
    label: str  # what is compiled ("decode", "prefill 8")
    phase: str  # "rewriting", "linking" or "done"
    done: int = 0  # distinct C modules linked so far
    total: int = 0  # distinct C modules the rewritten graph needs
    compiled: int = 0  # of them, built with g++ (the rest came from PyTensor's compiledir)
    elapsed: float = 0.0  # seconds since tracking() began


class _Tracker:
    def __init__(self, label: str, callback: Callable[[CompileEvent], None]):
        self.label = label
        self.callback = callback
        self.t0 = time.perf_counter()
        self.phase = "rewriting"
        self.pending: set = set()  # signatures of C nodes not linked yet
        self.done = self.total = self.compiled = 0

    def emit(self, phase: str | None = None) -> None:
        if phase is not None:
            self.phase = phase
        event = CompileEvent(
            self.label, self.phase, self.done, self.total, self.compiled, time.perf_counter() - self.t0
        )
        self.callback(event)


_local = threading.local()
_installed = False


def _active() -> _Tracker | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextmanager
def tracking(label: str, callback: Callable[[CompileEvent], None] | None):
    """Report the compiles this thread runs inside the block to `callback` (nothing when it is None)."""
    if callback is None:
        yield
        return
    tracker = _Tracker(label, callback)
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(tracker)
    try:
        yield tracker
    finally:
        stack.pop()
        tracker.emit("done")


def _signature(node):
    """What makes a C node's module distinct (as PyTensor's module key, up to constants' values)."""
    return (node.op, tuple(v.type for v in node.inputs), tuple(v.type for v in node.outputs))


def install() -> None:
    """Wrap the four PyTensor entry points once per process (after alchemist.pytensor_ext.fast_link.enable())."""
    global _installed
    if _installed or not pytensor_internals.tested():  # another PyTensor: no progress bar, its own paths
        return
    from alchemist.pytensor_ext.pytensor_internals import CLinker, COp, FunctionMaker

    prepare_fgraph = FunctionMaker.prepare_fgraph

    @functools.wraps(prepare_fgraph)
    def prepare(*args, **kwargs):
        tracker = _active()
        if tracker is not None:
            tracker.emit("rewriting")
        return prepare_fgraph(*args, **kwargs)

    FunctionMaker.prepare_fgraph = staticmethod(prepare)

    create = FunctionMaker.create

    @functools.wraps(create)
    def create_wrapper(self, *args, **kwargs):
        tracker = _active()
        if tracker is not None:
            pending = set()
            for node in self.fgraph.apply_nodes:
                if isinstance(node.op, COp):
                    try:
                        pending.add(_signature(node))
                    except TypeError:  # an unhashable op: not counted
                        pass
            tracker.pending = pending
            tracker.done, tracker.total = 0, len(pending)
            tracker.emit("linking")
        return create(self, *args, **kwargs)

    FunctionMaker.create = create_wrapper

    make_c_thunk = COp.make_c_thunk

    @functools.wraps(make_c_thunk)
    def make_c_thunk_wrapper(self, node, *args, **kwargs):
        tracker = _active()
        if tracker is None:
            return make_c_thunk(self, node, *args, **kwargs)
        try:
            return make_c_thunk(self, node, *args, **kwargs)
        finally:
            try:
                sig = _signature(node)
            except TypeError:
                sig = None
            if sig in tracker.pending:
                tracker.pending.discard(sig)
                tracker.done += 1
                tracker.emit()

    COp.make_c_thunk = make_c_thunk_wrapper

    compile_cmodule = CLinker.compile_cmodule

    @functools.wraps(compile_cmodule)
    def compile_cmodule_wrapper(self, *args, **kwargs):
        module = compile_cmodule(self, *args, **kwargs)
        tracker = _active()
        if tracker is not None:
            tracker.compiled += 1
            tracker.emit()
        return module

    CLinker.compile_cmodule = compile_cmodule_wrapper
    _installed = True


class TqdmProgress:
    """A CompileEvent callback drawing one tqdm bar on stderr per tracked compile (removed when it ends).

    The bar appears once a compile has taken `delay` seconds (linking a cached graph, ~0.5 s, shows nothing)
    and is redrawn at most every `min_interval` seconds; while rewriting, nothing reports back until the
    rewrites finish, so a thread redraws the elapsed time."""

    def __init__(self, delay: float = 0.5, min_interval: float = 0.1, leave: bool = False):
        self.delay = delay
        self.min_interval = min_interval
        self.leave = leave
        self.bar = None
        self._event: CompileEvent | None = None
        self._t0 = 0.0
        self._drawn = 0.0
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, event: CompileEvent) -> None:
        with self._lock:
            if event.phase == "done":
                self._close()
                return
            now = time.perf_counter()
            if self._event is None:
                self._t0 = now
                self._stop.clear()
                self._ticker = threading.Thread(target=self._tick, daemon=True)
                self._ticker.start()
            self._event = event
            if now - self._t0 >= self.delay and now - self._drawn >= self.min_interval:
                self._draw(now)

    def _draw(self, now: float) -> None:
        from tqdm.auto import tqdm

        event = self._event
        if self.bar is None:
            self.bar = tqdm(total=None, desc=event.label, bar_format="{desc} {elapsed}", leave=self.leave)
        bar = self.bar
        if event.phase == "rewriting":
            bar.set_description_str(f"{event.label}: rewriting graph", refresh=False)
        else:
            if bar.total != event.total:
                bar.bar_format = "{desc} {bar} {n_fmt}/{total_fmt} C modules [{elapsed}{postfix}]"
                bar.total = event.total
            bar.set_description_str(f"{event.label}: linking", refresh=False)
            bar.n = event.done
            bar.set_postfix_str(f"{event.compiled} built with g++", refresh=False)
        bar.refresh()
        self._drawn = now

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                now = time.perf_counter()
                if self._event is not None and now - self._t0 >= self.delay:
                    self._draw(now)

    def _close(self) -> None:
        self._stop.set()
        self._event = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
