"""Perplexity of a text under a model, in windows of at most `context` tokens, and the same windows under llama.cpp.

Windowing (the Hugging Face sliding-window convention, with BOS at the head of every window):

- `ids = tokenizer.encode(text)`. If the tokenizer adds BOS, `prefix = [BOS]` and `body = ids[1:]`;
  otherwise `prefix = []` and `body = ids`.
- Every window is `prefix + body[b:e]`, evaluated from position 0 on a fresh sequence, so each one looks
  like the start of a document (llama.cpp's perplexity tool also puts BOS at the head of each chunk; it
  overwrites the chunk's first text token, here BOS is prepended and no text token is lost).
  `room = context - len(prefix)` text tokens fit in a window.
- Windows start at `b = 0, stride, 2*stride, ...` and end at `e = min(b + room, len(body))`; the last window
  is the first one that reaches the end of the text. `stride` defaults to `room`: non-overlapping windows.
- Each text token is scored once, in the first window that holds it (where it has the most left context):
  window k scores the body tokens `j` in `[max(e_{k-1}, b_k + 1 - len(prefix)), e_k)` (`e_{-1} = 0`),
  each predicted by the logits at the window position before it.
  With BOS every text token is scored (the first text token of each later window sees only BOS when
  stride == room); without BOS a window's first token has nothing to be predicted from, so `body[0]` is never
  scored, nor, with non-overlapping windows, the first token of any window (as in Hugging Face's recipe).

Log-probabilities are float64 log-softmax of each row of logits; the mean negative log-likelihood over the scored
tokens gives perplexity = exp(mean NLL).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from alchemist.errors import AlchemistError


@dataclass(frozen=True)
class Window:
    """One evaluation: `ids` (BOS + text slice) from position 0; scores window positions `score_from..len(ids)-1`."""

    ids: list[int]
    start: int  # index in the full token sequence of ids[len(prefix)] (ids[0] when there is no BOS)
    score_from: int  # first window position scored (>= 1)
    prefix_len: int

    def positions(self) -> list[int]:
        """Index in the full token sequence (BOS included) of each scored token."""
        return [self.start + i - self.prefix_len for i in range(self.score_from, len(self.ids))]


@dataclass
class PerplexityResult:
    """Per scored token: its id, its index in the tokenized text (BOS = 0) and its log-probability (natural log)."""

    token_ids: list[int]
    positions: list[int]
    logprobs: list[float]
    n_windows: int
    context: int
    stride: int
    n_text_tokens: int  # the whole tokenized text, BOS included
    seconds: float = 0.0
    engine: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def n_scored(self) -> int:
        return len(self.logprobs)

    @property
    def mean_nll(self) -> float:
        return -math.fsum(self.logprobs) / len(self.logprobs)

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    def to_dict(self) -> dict:
        return {**asdict(self), "n_scored": self.n_scored, "mean_nll": self.mean_nll, "perplexity": self.perplexity}


def read_text(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise AlchemistError(f"{path}: no such text file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise AlchemistError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def check_window_args(context: int, stride: int | None, prefix_len: int, n_ctx_train: int | None = None) -> int:
    """Validate context and stride; returns the stride (default: a full window of text, no overlap)."""
    if context < 2:
        raise AlchemistError(f"--context {context}: a window needs at least 2 tokens")
    if n_ctx_train is not None and context > n_ctx_train:
        raise AlchemistError(f"--context {context}: the model's context is {n_ctx_train} tokens")
    room = context - prefix_len
    if room < 1:
        raise AlchemistError(f"--context {context}: no room for text after BOS")
    if stride is None:
        return room
    if stride < 1 or stride > room:
        why = f" ({context} - 1 for the BOS that heads every window)" if prefix_len else ""
        raise AlchemistError(f"--stride {stride}: must be between 1 and {room}{why}")
    return stride


def split_prefix(ids: Sequence[int], tokenizer) -> tuple[list[int], list[int]]:
    """(prefix, body): the BOS the tokenizer added, and the text's tokens."""
    ids = [int(t) for t in ids]
    if getattr(tokenizer, "add_bos", False) and ids and ids[0] == tokenizer.vocab.bos_id:
        return ids[:1], ids[1:]
    return [], ids


def make_windows(prefix: Sequence[int], body: Sequence[int], context: int, stride: int) -> list[Window]:
    """The windows of the module docstring's convention."""
    prefix, body = list(prefix), list(body)
    p = len(prefix)
    room = context - p
    windows: list[Window] = []
    prev_end = 0
    for b in range(0, max(len(body), 1), stride):
        e = min(b + room, len(body))
        lo = max(prev_end, b + 1 - p)  # body index of the first token scored here
        if lo < e:
            windows.append(Window(ids=prefix + body[b:e], start=b + p, score_from=p + lo - b, prefix_len=p))
        prev_end = e
        if e >= len(body):
            break
    return windows


def tokenize_text(tokenizer, text: str, name: str = "text") -> list[int]:
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise AlchemistError(f"{name}: {len(ids)} token(s) after tokenizing; perplexity needs at least 2")
    return ids


def score_windows(
    logits_fn: Callable[[list[int]], np.ndarray],
    windows: Sequence[Window],
    desc: str = "windows",
    progress: bool = True,
) -> tuple[list[int], list[int], list[float]]:
    """(token ids, positions, log-probabilities) of every scored token; `logits_fn(ids)` -> (len(ids), vocab)."""
    ids_out: list[int] = []
    pos_out: list[int] = []
    lp_out: list[float] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(windows), desc=desc, unit="window", leave=False)
    try:
        for w in windows:
            logits = np.asarray(logits_fn(w.ids))
            if logits.shape[0] != len(w.ids):
                raise AlchemistError(f"{desc}: {logits.shape[0]} rows of logits for a {len(w.ids)}-token window")
            targets = np.asarray(w.ids[w.score_from :], dtype=np.int64)
            rows = logits[w.score_from - 1 : len(w.ids) - 1].astype(np.float64)  # row i predicts token i+1
            lp_out.extend(log_softmax_at(rows, targets).tolist())
            ids_out.extend(targets.tolist())
            pos_out.extend(w.positions())
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return ids_out, pos_out, lp_out


def log_softmax_at(rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log softmax(rows)[i, targets[i]] in float64."""
    rows = np.asarray(rows, dtype=np.float64)
    m = rows.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(rows - m).sum(axis=1))
    return rows[np.arange(len(targets)), targets] - lse


def prepare(model, text: str | Sequence[int], context: int | None, stride: int | None, name: str = "text"):
    """(token ids, windows, context, stride) for `text` under a LoadedModel, with every check made."""
    tok = model.tokenizer
    if isinstance(text, str):
        if tok is None:
            raise AlchemistError(f"{model.path}: no tokenizer; pass token ids instead of text")
        ids = tokenize_text(tok, text, name)
    else:
        ids = [int(t) for t in text]
        if len(ids) < 2:
            raise AlchemistError(f"{name}: {len(ids)} token(s); perplexity needs at least 2")
    context = int(context or model.engine.capacity)
    prefix, body = split_prefix(ids, tok)
    stride = check_window_args(context, stride, len(prefix), model.ir.n_ctx_train)
    if context > model.engine.capacity:
        raise AlchemistError(
            f"--context {context}: the model was loaded with a KV cache of {model.engine.capacity} tokens "
            f"(load_llm(..., context={context}))"
        )
    windows = make_windows(prefix, body, context, stride)
    if not windows:
        raise AlchemistError(f"{name}: no token can be scored ({len(ids)} token(s), none after a first one)")
    return ids, windows, context, stride


def perplexity(
    model,
    text: str | Sequence[int],
    context: int | None = None,
    stride: int | None = None,
    progress: bool = True,
    name: str = "text",
) -> PerplexityResult:
    """Perplexity of `text` (a string, or token ids as the tokenizer gives them, BOS included) under a
    LoadedModel, in windows of at most `context` tokens (default: the model's KV-cache capacity)."""
    ids, windows, context, stride = prepare(model, text, context, stride, name)
    return alchemist_perplexity(model, windows, context, stride, len(ids), progress)


def alchemist_perplexity(
    model, windows: Sequence[Window], context: int, stride: int, n_text_tokens: int, progress: bool = True
) -> PerplexityResult:
    """Score prepared windows with the model's engine (each window from position 0, logits of every position)."""
    engine = model.engine
    compile0 = engine.stats.compile_seconds
    t0 = time.perf_counter()
    desc = f"alchemist [{model.backend}]"
    got = score_windows(lambda w: engine.run(w, 0, all_logits=True), windows, desc, progress)
    seconds = time.perf_counter() - t0
    return PerplexityResult(
        *got,
        n_windows=len(windows),
        context=context,
        stride=stride,
        n_text_tokens=n_text_tokens,
        seconds=seconds,
        engine=desc,
        extra={"compile_seconds": engine.stats.compile_seconds - compile0, "load_seconds": model.load_seconds},
    )


def llamacpp_perplexity(
    gguf_path: str | Path,
    windows: Sequence[Window],
    context: int,
    stride: int,
    ids: Sequence[int],
    text: str | None = None,
    n_threads: int | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """The same windows scored by llama.cpp (F32 KV cache, flash attention off, all positions' logits).
    With `text`, also records whether llama.cpp's own tokenizer gives the same `ids` (extra["tokenizer_agrees"])."""
    from alchemist.harness.oracle import LlamaCppOracle

    t0 = time.perf_counter()
    with LlamaCppOracle(gguf_path, n_ctx=context, n_threads=n_threads) as oracle:
        load_seconds = time.perf_counter() - t0
        agrees = None if text is None else oracle.tokenize(text) == [int(t) for t in ids]
        t1 = time.perf_counter()
        got = score_windows(oracle.logits, windows, "llama.cpp", progress)
        seconds = time.perf_counter() - t1
    return PerplexityResult(
        *got,
        n_windows=len(windows),
        context=context,
        stride=stride,
        n_text_tokens=len(ids),
        seconds=seconds,
        engine="llama.cpp",
        extra={"load_seconds": load_seconds, "tokenizer_agrees": agrees},
    )


@dataclass
class Comparison:
    ours: PerplexityResult
    llamacpp: PerplexityResult | None

    @property
    def relative_diff(self) -> float | None:
        if self.llamacpp is None:
            return None
        return (self.ours.perplexity - self.llamacpp.perplexity) / self.llamacpp.perplexity

    @property
    def max_abs_logprob_diff(self) -> float | None:
        if self.llamacpp is None:
            return None
        return float(np.max(np.abs(np.subtract(self.ours.logprobs, self.llamacpp.logprobs))))

    def to_dict(self) -> dict:
        return {
            "alchemist": self.ours.to_dict(),
            "llamacpp": self.llamacpp.to_dict() if self.llamacpp else None,
            "relative_diff": self.relative_diff,
            "max_abs_logprob_diff": self.max_abs_logprob_diff,
        }

    def table(self) -> str:
        o, r = self.ours, self.llamacpp
        rows = [
            ("tokens scored", f"{o.n_scored} of {o.n_text_tokens}"),
            ("windows", f"{o.n_windows} (context {o.context}, stride {o.stride})"),
            (f"{o.engine} ppl", f"{o.perplexity:.6g}  (mean NLL {o.mean_nll:.5f})"),
            (
                f"{o.engine} time",
                f"{o.seconds:.2f} s ({o.extra['compile_seconds']:.2f} s compiling), load {o.extra['load_seconds']:.2f} s",
            ),
        ]
        if r is not None:
            rows += [
                ("llama.cpp ppl", f"{r.perplexity:.6g}  (mean NLL {r.mean_nll:.5f})"),
                ("llama.cpp time", f"{r.seconds:.2f} s, load {r.extra['load_seconds']:.2f} s"),
                *(
                    [
                        (
                            "llama.cpp tokens",
                            "same ids" if r.extra["tokenizer_agrees"] else "DIFFER (scored on alchemist's)",
                        )
                    ]
                    if r.extra.get("tokenizer_agrees") is not None
                    else []
                ),
                ("relative diff", f"{self.relative_diff:+.3e}  (alchemist / llama.cpp - 1)"),
                ("max |Δ logprob|", f"{self.max_abs_logprob_diff:.3e}"),
            ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def compare(
    model,
    text: str | Sequence[int],
    context: int | None = None,
    stride: int | None = None,
    oracle: bool = True,
    progress: bool = True,
    n_threads: int | None = None,
    name: str = "text",
) -> Comparison:
    """Perplexity of `text` under a LoadedModel and (oracle) under llama.cpp, on the same windows of token ids."""
    ids, windows, context, stride = prepare(model, text, context, stride, name)
    ours = alchemist_perplexity(model, windows, context, stride, len(ids), progress)
    theirs = None
    if oracle:
        as_text = text if isinstance(text, str) else None
        theirs = llamacpp_perplexity(model.path, windows, context, stride, ids, as_text, n_threads, progress)
    return Comparison(ours, theirs)


def perplexity_file(
    model_path: str | Path,
    text_path: str | Path,
    context: int = 512,
    stride: int | None = None,
    backend: str = "c",
    oracle: bool = True,
    progress: bool = True,
    n_threads: int | None = None,
    llamacpp_rounding: bool = False,
    numerics: str | None = None,
) -> Comparison:
    """`alchemist perplexity`: load the model with a KV cache of `context` tokens, then `compare` on the file's text.
    `numerics` (default "ggml", see alchemist.runtime.numerics); llamacpp_rounding=True is the older spelling
    of numerics="ggml"."""
    from alchemist import load_llm
    from alchemist.runtime.numerics import resolve_numerics

    text = read_text(text_path)
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf

    # the checks that need no tokenizer, before the slow load (the GGUF header is read in ~0.2 s)
    check_window_args(context, stride, 0, build_model_ir(read_gguf(model_path)).n_ctx_train)
    if oracle:
        from alchemist.harness import _llama

        try:
            _llama.require()  # before minutes of scoring
        except _llama.OracleError as e:
            raise _llama.OracleError(f"{e} (or pass --no-oracle)") from None
    numerics = resolve_numerics(numerics, llamacpp_rounding)
    model = load_llm(model_path, backend=backend, context=context, progress=progress, numerics=numerics)
    result = compare(model, text, context, stride, oracle, progress, n_threads, str(text_path))
    result.ours.extra["numerics"] = numerics
    return result
