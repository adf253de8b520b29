"""What the scheduler thread hands to a request's sink, and the error for a full queue (serving contract, Part 2).

Shared by `alchemist.serve.scheduler` (which emits them) and `alchemist.serve.app` (which turns them into HTTP)."""

from __future__ import annotations

from dataclasses import dataclass, field

from alchemist.errors import AlchemistError


@dataclass
class TokenEvent:
    request_id: str
    token_id: int
    text: str  # text safe to emit now (may be "": held back for UTF-8 or a possible stop string)
    logprob: float | None = None  # the chosen token's log-probability, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # the k most likely (token id, logprob), best first


@dataclass
class PromptEvent:
    """A scored prompt (a request with prompt_logprobs), once before its first token: per prompt position its
    token's log-probability given the tokens before it (None for the first) and the k most likely tokens there."""

    request_id: str
    logprobs: list[tuple[float | None, list[tuple[int, float]]]]


@dataclass
class DoneEvent:
    request_id: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    text: str = ""  # trailing text flushed at the end (may be "")
    usage: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens, total_tokens, cached_tokens
    timings: dict = field(default_factory=dict)  # ttft_s, total_s, ...
    error: str | None = None
    matched_stop: str | int | None = None  # "stop": the stop string that matched, or the eos token id


Event = TokenEvent | PromptEvent | DoneEvent


class QueueFull(AlchemistError):
    """The scheduler's queue is full (the server answers 429)."""


class SchedulerClosed(AlchemistError):
    """The scheduler is stopping or stopped and admits no new requests (the server answers 503)."""
