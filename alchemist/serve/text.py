"""Incremental detokenization with stop strings: what a stream may show after each generated token.

`TextStream.feed(id)` returns only text that can no longer change: never half a UTF-8 character (the tokenizer's
stream decoder holds incomplete bytes back), never a suffix that could still grow into a stop string, and, for
vocabularies with llama.cpp's `clean_spaces` post-processing, never bytes that a later token could still clean.
So the concatenation of everything streamed equals the final text, which equals `Tokenizer.decode(ids)` cut
before the first stop string.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from alchemist.errors import AlchemistError

# llama.cpp's three `clean_spaces` passes (llama_detokenize), as substitutions on text: each pass only removes a
# space next to ASCII punctuation, so applying them to decoded text equals applying them to the bytes.
_CLEAN_PASSES = (
    (re.compile(r" (?=[?!.,])"), ""),  # " ?", " !", " .", " ,"
    (re.compile(r" ' "), "'"),  # a single apostrophe between spaces
    (re.compile(r" (?='(?:s|m|re|ve))"), ""),  # " 's", " 'm", " 're", " 've"
)
_CLEAN_PATTERNS = (" ?", " !", " .", " ,", " ' ", " 's", " 'm", " 're", " 've")
_CLEAN_REACH = max(map(len, _CLEAN_PATTERNS)) - 1


def _clean_cut_is_safe(text: str, cut: int) -> bool:
    """Whether no clean_spaces pattern can span position `cut` of text, whatever follows text[:cut]."""
    for s in range(max(0, cut - _CLEAN_REACH), cut):
        if text[s] == " " and any(len(p) > cut - s and p.startswith(text[s:cut]) for p in _CLEAN_PATTERNS):
            return False
    return True


def clean_spaces(text: str) -> str:
    for pattern, repl in _CLEAN_PASSES:
        text = pattern.sub(repl, text)
    return text


class TextStream:
    """Feed generated token ids one at a time; get back the text safe to show and a finish reason.

    `feed(id) -> (delta, reason)`: reason is "stop" when `id` is an eos id (its remaining held-back text is
    returned, the eos token itself renders as nothing) or when a stop string completed (the text before it is
    returned; the stop string and anything after it never are); otherwise None. After "stop" the stream is done
    and further feeds return ("", "stop"). `flush()` returns what is still held back, for a stream that ends on
    a length limit or a cancel."""

    def __init__(
        self, tokenizer, stop: Sequence[str] = (), eos_ids: Iterable[int] = (), skip_special_tokens: bool = False
    ):
        if isinstance(stop, str):
            stop = [stop]
        self.stop = [s for s in stop if s]
        if any(not isinstance(s, str) for s in self.stop):
            raise AlchemistError(f"stop strings must be strings, got {stop!r}")
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self._decoder = tokenizer.stream_decoder(skip_special_tokens)
        self._clean = bool(getattr(tokenizer.vocab, "clean_spaces", False))
        self._raw = ""  # decoded, not yet cleaned (clean_spaces vocabularies only)
        self._context = ""  # the last characters before _raw, which decide where a clean cut is safe
        self._pending = ""  # final text not yet emitted: a possible start of a stop string
        self._parts: list[str] = []
        self.finish_reason: str | None = None
        self.matched_stop: str | int | None = None  # the stop string that ended the text, or the eos id

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._parts)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, token_id: int) -> tuple[str, str | None]:
        if self.finish_reason is not None:
            return "", self.finish_reason
        if int(token_id) in self.eos_ids:
            out = self._finish(final=True)
            if self.finish_reason is None:
                self.finish_reason, self.matched_stop = "stop", int(token_id)
            return out, "stop"
        settled = self._settle(self._decoder.feed(int(token_id)))
        return self._release(settled, final=False)

    def flush(self) -> str:
        """The held-back text (an incomplete character at the very end becomes U+FFFD), cut at a stop string."""
        if self.finish_reason is not None:
            return ""
        return self._finish(final=True)

    # -- internals -------------------------------------------------------------------------------------
    def _finish(self, final: bool) -> str:
        settled = self._settle(self._decoder.flush(), final=True)
        out, reason = self._release(settled, final=final)
        if reason is not None:
            self.finish_reason = reason
        return out

    def _settle(self, new: str, final: bool = False) -> str:
        """Text that no later token can change (clean_spaces may still remove a space near the end)."""
        if not self._clean:
            return new
        raw = self._raw + new
        cut = len(raw)
        if not final:
            full, off = self._context + raw, len(self._context)
            while cut > 0 and not _clean_cut_is_safe(full, off + cut):
                cut -= 1
        settled, self._raw = raw[:cut], raw[cut:]
        self._context = (self._context + settled)[-_CLEAN_REACH:]
        return clean_spaces(settled)

    def _release(self, settled: str, final: bool) -> tuple[str, str | None]:
        pending = self._pending + settled
        hits = [(i, s) for s, i in ((s, pending.find(s)) for s in self.stop) if i >= 0]
        if hits:
            hit, self.matched_stop = min(hits, key=lambda h: h[0])
            out, self._pending, self.finish_reason = pending[:hit], "", "stop"
            self._emit(out)
            return out, "stop"
        hold = 0 if final else self._stop_prefix_len(pending)
        out, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self._emit(out)
        return out, None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, out: str) -> None:
        if out:
            self._parts.append(out)
