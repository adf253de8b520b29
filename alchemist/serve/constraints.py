"""Structured output: an answer held to a JSON schema, a regular expression, a grammar or a list of choices, by
llguidance (its Earley parser computes which tokens may come next).

A request's constraint compiles once, in a worker thread, within llguidance's parser limits (a hostile schema
is refused, never a hang). Each choice then gets its own matcher. In the scheduler thread a sampled token
advances it, and the mask of the tokens allowed next is computed on a worker thread (llguidance drops the GIL)
while the model runs its next batched step; it is applied to that request's row of logits just before its
sampler draws. Once the grammar is complete only an end-of-generation token is allowed."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import numpy as np

from alchemist.errors import AlchemistError

# llguidance's own defaults, stated: the fuel and sizes bound the work one grammar may cost (lexer states ~1-2 kB)
LIMITS = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
}
# compact JSON: a schema's answer has no whitespace between tokens for the model to repeat without end
JSON_OPTIONS = {"whitespace_flexible": False}


class ConstraintError(AlchemistError):
    """A schema, regex or grammar llguidance refuses, or a token it cannot accept (the server answers 400)."""


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: every token's bytes (control tokens marked by a leading 0xff, as
    llguidance's own llama.cpp adapter marks them), the special ids, and the tokenizer for text (as bytes)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [t for t in range(tokenizer.vocab_size) if tokenizer.is_special(t)]
        special = set(self.special_token_ids)
        self.tokens = [
            (b"\xff" if t in special else b"") + tokenizer.token_to_piece(t) for t in range(tokenizer.vocab_size)
        ]

        # greedy longest match, for text the tokenizer would not give back byte for byte
        self._ids = {piece: t for t, piece in reversed(list(enumerate(self.tokens))) if piece and t not in special}
        self._longest = max(map(len, self._ids))

    def __call__(self, text: bytes) -> list[int]:
        """Tokens whose bytes are exactly `text`: the tokenizer's (a SentencePiece vocabulary may put a space
        before the text, which llguidance must not see), or else the longest pieces from the left."""
        ids = self._tokenizer.encode(
            text.decode("utf-8", errors="replace"), add_special_tokens=False, parse_special=False
        )
        if b"".join(self.tokens[t] for t in ids) == text:
            return ids
        ids, i = [], 0
        while i < len(text):
            for n in range(min(self._longest, len(text) - i), 0, -1):
                t = self._ids.get(text[i : i + n])
                if t is not None:
                    ids.append(t)
                    i += n
                    break
            else:
                raise ConstraintError(f"no token spells the byte {text[i]:#04x}")
        return ids


class Constraint:
    """One choice's matcher: `allowed(logits)` masks a row of logits, `consume(token)` advances."""

    def __init__(self, vocabulary, grammar: str, executor: concurrent.futures.Executor):
        import llguidance
        import llguidance.numpy as lgn

        self._lgn = lgn
        self._executor = executor
        self.matcher = llguidance.LLMatcher(
            vocabulary, grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS)
        )
        if self.matcher.is_error():
            raise ConstraintError(f"the constraint cannot be used: {self.matcher.get_error()}")
        self._mask = lgn.allocate_token_bitmask(1, vocabulary.vocab_size)
        self._pending = None
        self._prepare()

    def _prepare(self) -> None:
        """Start computing the next mask (off the scheduler thread)."""
        self._pending = self._executor.submit(self._lgn.fill_next_token_bitmask, self.matcher, self._mask, 0)

    def allowed(self, logits: np.ndarray) -> np.ndarray:
        """A copy of the row of logits with every token the grammar forbids next at -inf."""
        self._pending.result()
        if self.matcher.is_error():
            raise ConstraintError(self.matcher.get_error())
        out = np.array(logits, dtype=np.float32, copy=True).reshape(1, -1)
        self._lgn.apply_token_bitmask_inplace(out, self._mask)
        return out[0]

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ConstraintError(f"token {token} breaks the constraint: {self.matcher.get_error()}")
        self._prepare()  # once the grammar is complete: end-of-generation tokens only


class Constraints:
    """A server's structured-output compiler over its tokenizer: `grammar(kind, value)` checks and compiles,
    `constraint(grammar)` makes one choice's matcher. The vocabulary is read once, on first use (a 262k-token
    vocabulary takes a few seconds)."""

    KINDS = ("json_schema", "regex", "grammar", "choice")

    def __init__(self, tokenizer, workers: int = 2):
        self._tokenizer = tokenizer
        self._vocabulary = None
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="alchemist-constraint")

    def vocabulary(self):
        with self._lock:
            if self._vocabulary is None:
                import llguidance

                eos = sorted(self._tokenizer.eos_ids) or None
                wrapper = llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer))
                self._vocabulary = llguidance.LLTokenizer(wrapper, n_vocab=self._tokenizer.vocab_size, eos_token=eos)
            return self._vocabulary

    def grammar(self, kind: str, value) -> str:
        """The llguidance grammar of a JSON schema (a dict; None: any JSON object), a regular expression, a GBNF
        or Lark grammar, or a list of strings to choose from; checked within LIMITS (ConstraintError if not)."""
        import llguidance

        try:
            if kind == "json_schema":
                schema = {"type": "object"} if value is None else value
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(value)
            elif kind == "grammar":
                grammar = llguidance.grammar_from("grammar", value)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", json.dumps(list(value)))
            else:
                raise ConstraintError(f"unknown constraint kind {kind!r} (known: {', '.join(self.KINDS)})")
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"the {kind.replace('_', ' ')} cannot be compiled: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(
            grammar, self.vocabulary(), limits=llguidance.LLParserLimits(**LIMITS)
        )
        if error:
            raise ConstraintError(f"the {kind.replace('_', ' ')} cannot be used: {error}")
        return grammar

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self.vocabulary(), grammar, self._executor)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
