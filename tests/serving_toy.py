"""A toy slot engine with SlotEngine's interface (alchemist.runtime.slot_engine), in numpy and instant.

Each slot's "KV cache" holds the token id written at each position; the logits at position p are a fixed
function of every token at positions 0..p of that slot, so a scheduler bug that mixes slots, loses a prefix or
reuses stale rows changes the tokens. Scheduler and server tests run on it without compiling a model.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from alchemist.errors import AlchemistError


@dataclass
class ToyStats:
    compile_count: int = 0
    compile_seconds: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    compiled_shapes: list = field(default_factory=list)


class ToySlotEngine:
    def __init__(
        self,
        n_vocab: int,
        n_slots: int = 4,
        capacity: int = 64,
        chunk: int = 4,
        decode_buckets=(1, 2, 4, 8),
        piece=None,
    ):
        self.n_vocab, self.n_slots, self.capacity, self.chunk = n_vocab, n_slots, capacity, chunk
        self.piece = piece or chunk
        self.prefills: list[tuple[int, int, int]] = []  # (slot, start, n) of every prefill call
        self.decode_buckets = tuple(decode_buckets)
        self.kv = np.full((n_slots, capacity), -1, dtype=np.int64)
        self.lock = threading.RLock()
        self.stats = ToyStats()
        self.engine = None
        rng = np.random.default_rng(0)
        self._token_vecs = rng.standard_normal((n_vocab, 16))
        self._out = rng.standard_normal((16, n_vocab)) * 3.0

    def _logits(self, slot: int, pos: int) -> np.ndarray:
        toks = self.kv[slot, : pos + 1]
        if (toks < 0).any():
            raise AssertionError(f"slot {slot} reads unwritten position(s) {np.flatnonzero(toks < 0).tolist()}")
        decay = 0.7 ** np.arange(pos, -1, -1)  # recent tokens weigh most; every one counts
        h = np.tanh((self._token_vecs[toks] * decay[:, None]).sum(0) + 0.01 * pos)
        return (h @ self._out).astype(np.float32)

    def _check(self, slot: int, a: int, b: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise AlchemistError(f"slot {slot} out of range [0, {self.n_slots})")
        if a < 0 or b > self.capacity:
            raise AlchemistError(f"positions [{a}, {b}) outside the slot capacity {self.capacity}")

    def decode(self, slots, tokens, positions) -> np.ndarray:
        if not 0 < len(slots) <= max(self.decode_buckets) or len(set(slots)) != len(slots):
            raise AlchemistError(f"bad decode batch: slots {list(slots)}")
        with self.lock:
            for s, t, p in zip(slots, tokens, positions):
                self._check(s, p, p + 1)
                self.kv[s, p] = t
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(slots)
            return np.stack([self._logits(s, p) for s, p in zip(slots, positions)])

    def prefill(self, slot, ids, start, all_rows=False, logits=True) -> np.ndarray | None:
        if start % self.piece or not 0 < len(ids) <= self.chunk - start % self.chunk:
            raise AlchemistError(f"prefill must start at a multiple of {self.piece} and end within its chunk")
        with self.lock:
            self.prefills.append((slot, start, len(ids)))
            self._check(slot, start, start + len(ids))
            self.kv[slot, start : start + len(ids)] = ids
            self.stats.prefill_chunks += 1
            self.stats.prefill_tokens += len(ids)
            if all_rows:
                return np.stack([self._logits(slot, p) for p in range(start, start + len(ids))])
            return self._logits(slot, start + len(ids) - 1) if logits else None

    def chunk_plan(self, n: int, start: int = 0, pieces: bool = False) -> list[tuple[int, int]]:
        plan, a = [], start
        while a < n:
            step = self.piece if pieces or a % self.chunk else self.chunk
            b = min(n, (a // step + 1) * step)
            plan.append((a, b))
            a = b
        return plan

    def reusable_prefix(self, cached_len: int, lcp: int, prompt_len: int, slot: int | None = None) -> int:
        k = min(lcp, cached_len, prompt_len - 1)
        return max(0, k // self.chunk * self.chunk)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        with self.lock:
            self.kv[dst, :n] = self.kv[src, :n]

    def warm_up(self, progress=None) -> None:
        if progress is not None:
            progress("toy engine: nothing to compile")
