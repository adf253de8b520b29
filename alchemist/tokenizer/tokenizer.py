"""`Tokenizer`: text in, token ids out, exactly as llama.cpp's `llama_tokenize` / `llama_detokenize` do it.

The pipeline follows `llama_vocab::impl::tokenize`:
1. special-token partition (`tokenizer_st_partition`): control, user-defined and unknown tokens, longest
   text first, are cut out of the text (control/unknown only when `parse_special`);
2. each remaining text fragment goes through the model: SPM (optional space prefix, spaces to U+2581, the
   score-ordered merge loop with byte fallback) or byte-level BPE (pre-tokenizer regexes, byte encoding,
   rank-ordered merges). Prompts run through a Python port of llama.cpp's loops; after
   FAST_PATH_AFTER_CHARS characters a Hugging Face `tokenizers` merge table (built from the GGUF metadata,
   nothing is downloaded) takes over, except for the corners a merge table cannot express;
3. BOS/EOS as the vocabulary's add_bos/add_eos say.

Decoding is `token_to_piece` per token (bytes), joined and UTF-8 decoded, plus `llama_detokenize`'s
leading-space removal and `clean_spaces` passes. `StreamDecoder` decodes incrementally and never emits half
a UTF-8 character.
"""

from __future__ import annotations

import codecs
import hashlib
import operator
import os
import pickle
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from alchemist.errors import AlchemistError, GGUFError
from alchemist.paths import cache_subdir
from alchemist.tokenizer.algorithms import bpe_tokenize_word, spm_merges, spm_tokenize
from alchemist.tokenizer.vocab import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_NORMAL,
    ATTR_RSTRIP,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    Vocab,
    read_vocab,
)

_SPACE = " "
_ESCAPED_SPACE = "\u2581"
_C_ISSPACE = frozenset(" \t\n\v\f\r")
_ATTR_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (llama.cpp unicode_byte_to_utf8)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


@dataclass
class BuildInfo:
    """How the tokenizer was built (for reports and tests)."""

    seconds: float  # constructing the Tokenizer (the merge-table fast path is built later, on demand)
    n_merges: int | None  # merges in the fast path's table; None until it is built (SPM derives them)
    exact_fast_path: bool  # False: every fragment goes through the Python port of llama.cpp's loop
    notes: tuple[str, ...] = ()
    fast_path_seconds: float | None = None  # building the Hugging Face merge table, once it is built


# The Python ports of llama.cpp's loops tokenize ~0.6 M characters/s; building the Hugging Face merge table
# costs ~1.3 s for gemma's 262k vocabulary (515k derived merges), i.e. as much as ~800k characters. Short
# inputs (prompts) therefore go through the port, and the table is built once this many characters have been
# tokenized in total, so a model opens without paying for it. Both paths give llama.cpp's ids (tested).
FAST_PATH_AFTER_CHARS = 200_000


class Tokenizer:
    """A GGUF vocabulary that tokenizes like llama.cpp. Build it with `load_tokenizer(path)`."""

    def __init__(self, vocab: Vocab):
        t0 = time.perf_counter()
        self.vocab = vocab
        self.path = vocab.path
        self._tokens = vocab.tokens
        self._attrs = vocab.attrs
        self._t2i = vocab.token_to_id
        self._piece_cache: dict[tuple[int, bool], bytes] = {}
        self._special_index = self._index_specials()
        self._hf = None  # the merge-table fast path, built by build_fast_path()
        self._ported_chars = 0  # characters tokenized by the Python port so far
        notes: list[str] = list(vocab.notes)
        n_merges: int | None = None
        if vocab.kind == "spm":
            self._byte_ids: list[int | None] = [self._spm_byte_token_or_none(b) for b in range(256)]
            exact = True
        else:
            n_merges, exact = self._prepare_bpe(notes)
        self.build_info = BuildInfo(time.perf_counter() - t0, n_merges, exact, tuple(notes))
        self._chat = None

    # What the vocabulary determines is rebuilt on unpickling rather than stored (see Vocab.__getstate__).
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_t2i"] = None
        if "_ranks" in state:
            state["_ranks"] = None
            if state["_bpe_exact"]:
                state["_good_merges"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._t2i = self.vocab.token_to_id
        if "_ranks" in state and state["_ranks"] is None:  # a BPE tokenizer (see __getstate__)
            self._ranks = self.vocab.merge_ranks()  # _good_merges None: all of vocab.merges (_build_bpe)

    # ------------------------------------------------------------------ construction
    def build_fast_path(self) -> "Tokenizer":
        """Build the Hugging Face merge table now (otherwise it is built after FAST_PATH_AFTER_CHARS)."""
        if self._hf is None:
            t0 = time.perf_counter()
            notes = list(self.build_info.notes)
            if self.vocab.kind == "spm":
                self.build_info.n_merges = self._build_spm(notes)
            else:
                self._build_bpe()
            self.build_info.notes = tuple(notes)
            self.build_info.fast_path_seconds = time.perf_counter() - t0
        return self

    def _use_fast_path(self, text: str) -> bool:
        """True when `text` should go through the merge table (building it once enough text has been seen)."""
        if self._hf is None:
            self._ported_chars += len(text)
            if self._ported_chars <= FAST_PATH_AFTER_CHARS:
                return False
            self.build_fast_path()
        return True

    def _build_spm(self, notes: list[str]) -> int:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models

        v = self.vocab
        is_byte = (v.attrs & ATTR_BYTE) != 0
        merges, byte_piece_merges = spm_merges(v.tokens, v.scores, is_byte)
        self._single_chars = frozenset(t for t in v.tokens if len(t) == 1)
        all_chars = set("".join(v.tokens))
        # characters llama.cpp could merge although they are not tokens themselves
        self._merge_only_chars = frozenset(all_chars - self._single_chars)
        hex_ids = [self._t2i.get(f"<0x{b:02X}>") for b in range(256)]
        self._hf_byte_fallback_ok = all(i is not None for i in hex_ids) and not byte_piece_merges
        if byte_piece_merges:
            notes.append("some merges use <0xXX> byte-token texts as pieces; unknown characters take the slow path")
        self._hf = HFTokenizer(models.BPE(self._t2i, merges, byte_fallback=True, fuse_unk=False))
        return len(merges)

    def _prepare_bpe(self, notes: list[str]) -> tuple[int, bool]:
        """What the Python BPE port needs (merge ranks, pre-tokenizer); the merge table waits."""
        from tokenizers import Regex, pre_tokenizers

        v = self.vocab
        t2i = self._t2i
        good = [(a, b) for a, b in v.merges if a in t2i and b in t2i and (a + b) in t2i]
        exact = len(good) == len(v.merges)
        if not exact:
            notes.append(
                f"{len(v.merges) - len(good)} merges have pieces or results that are not tokens; "
                "tokenizing with the Python port of llama.cpp's BPE loop"
            )
        self._ranks = {pair: i for i, pair in enumerate(v.merges)}
        pre = v.pre_tokenizer
        assert pre is not None
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.regexes]
        self._hf_pre = pre_tokenizers.Sequence(
            splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
        )
        self._good_merges = good
        self._bpe_exact = exact
        return len(good), exact

    def _build_bpe(self) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models

        merges = self.vocab.merges if self._good_merges is None else self._good_merges
        hf = HFTokenizer(
            models.BPE(self._t2i, merges, byte_fallback=False, ignore_merges=self.vocab.ignore_merges)
        )
        hf.pre_tokenizer = self._hf_pre
        self._hf = hf

    def _spm_byte_token_or_none(self, b: int) -> int | None:
        tid = self._t2i.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self._t2i.get(chr(b))
        return tid

    def _spm_byte_token(self, b: int) -> int:
        tid = self._byte_ids[b]
        if tid is None:  # llama.cpp: token_to_id.at() throws std::out_of_range
            raise AlchemistError(
                f"{self.path}: tokenizer.ggml.tokens: no byte token <0x{b:02X}> for a character the vocabulary lacks"
            )
        return tid

    def _index_specials(self) -> dict[str, list[tuple[int, int, str, int]]]:
        """Special tokens grouped by their first three characters: (order, id, text, attr) lists."""
        index: dict[str, list[tuple[int, int, str, int]]] = {}
        for order, tid in enumerate(self.vocab.special_tokens):
            text = self._tokens[tid]
            index.setdefault(text[:3], []).append((order, tid, text, int(self._attrs[tid])))
        return index

    # ------------------------------------------------------------------ properties
    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every token llama.cpp treats as end of generation (EOS, EOT, <|im_end|>, <end_of_turn>, ...)."""
        return frozenset(self.vocab.eog_ids)

    @property
    def pad_id(self) -> int | None:
        return self.vocab.pad_id

    @property
    def unk_id(self) -> int | None:
        return self.vocab.unk_id

    @property
    def vocab_size(self) -> int:
        return self.vocab.n_tokens

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    @property
    def has_chat_template(self) -> bool:
        return bool(self.vocab.chat_template)

    @property
    def chat_template(self) -> str | None:
        return self.vocab.chat_template

    @property
    def hf_tokenizer(self):
        """The underlying `tokenizers.Tokenizer` (model and pre-tokenizer only; special tokens are handled here)."""
        return self.build_fast_path()._hf

    def id_to_token(self, token_id: int) -> str:
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        return self._t2i.get(text)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    def is_special(self, token_id: int) -> bool:
        return bool(self._attrs[token_id] & (ATTR_CONTROL | ATTR_UNKNOWN))

    def __repr__(self) -> str:
        v = self.vocab
        return f"<Tokenizer {v.kind} pre={v.pre!r} n_vocab={v.n_tokens} from {os.path.basename(v.path)}>"

    # ------------------------------------------------------------------ encoding
    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`, like llama.cpp `llama_tokenize(text, add_special, parse_special)`.

        With `parse_special` (the default) the texts of control tokens such as `<|im_start|>` become those
        tokens; user-defined tokens are always recognised, as in llama.cpp."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise AlchemistError(f"cannot tokenize text that is not valid Unicode: {e}") from None
        v = self.vocab
        out: list[int] = []
        fragments = self._partition(text, parse_special) if text else []
        if add_special_tokens and v.add_bos:
            out.append(self._required("bos_id", "add_bos"))
        if v.kind == "spm":
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if v.add_space_prefix and prev_special:
                    frag = _SPACE + frag
                out.extend(self._spm_fragment(frag.replace(_SPACE, _ESCAPED_SPACE)))
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self._bpe_fragment(frag))
        if add_special_tokens and v.add_eos:
            out.append(self._required("eos_id", "add_eos"))
        return out

    def _required(self, attr: str, flag: str) -> int:
        tid = getattr(self.vocab, attr)
        if tid is None:  # llama.cpp: GGML_ASSERT(special_bos_id != LLAMA_TOKEN_NULL)
            key = "tokenizer.ggml." + attr.replace("_id", "_token_id")
            raise GGUFError(
                self.path, key, f"tokenizer.ggml.{flag}_token asks for this token but the vocabulary has none"
            )
        return tid

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = True, parse_special: bool = True):
        return [self.encode(t, add_special_tokens, parse_special) for t in texts]

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp `tokenizer_st_partition`: cut special-token texts out, longest first."""
        present: list[tuple[int, int, str, int]] = []
        for key, group in self._special_index.items():
            if key in text:
                for entry in group:
                    if (parse_special or not entry[3] & _ATTR_SPECIAL) and entry[2] in text:
                        present.append(entry)
        if not present:
            return [text]
        present.sort()
        frags: list[tuple[int, int] | int] = [(0, len(text))]
        for _, tid, tok_text, attr in present:
            new: list[tuple[int, int] | int] = []
            n_tok = len(tok_text)
            for frag in frags:
                if isinstance(frag, int):
                    new.append(frag)
                    continue
                pos, end = frag[0], frag[0] + frag[1]
                while True:
                    m = text.find(tok_text, pos, end)
                    if m < 0:
                        if pos < end:
                            new.append((pos, end - pos))
                        break
                    left_end = m
                    if attr & ATTR_LSTRIP:
                        while left_end > pos and text[left_end - 1] in _C_ISSPACE:
                            left_end -= 1
                    if left_end > pos:
                        new.append((pos, left_end - pos))
                    new.append(tid)
                    pos = m + n_tok
                    if attr & ATTR_RSTRIP:
                        while pos < end and text[pos] in _C_ISSPACE:
                            pos += 1
            frags = new
        return [f if isinstance(f, int) else text[f[0] : f[0] + f[1]] for f in frags]

    def _spm_fragment(self, text: str) -> list[int]:
        if not self._use_fast_path(text):
            return self.spm_reference(text)
        unknown = set(text) - self._single_chars
        if unknown and (not self._hf_byte_fallback_ok or not unknown.isdisjoint(self._merge_only_chars)):
            return self.spm_reference(text)
        return self._hf.encode(text, add_special_tokens=False).ids

    def spm_reference(self, escaped_text: str) -> list[int]:
        """The Python port of llama.cpp's SPM loop on already-escaped text (no partition, no BOS)."""
        return spm_tokenize(escaped_text, self._t2i, self.vocab.scores, self._spm_byte_token)

    def _bpe_fragment(self, text: str) -> list[int]:
        if self._bpe_exact and self._use_fast_path(text):
            return self._hf.encode(text, add_special_tokens=False).ids
        return self.bpe_reference(text)

    def bpe_reference(self, text: str) -> list[int]:
        """HF pre-tokenizer + the Python port of llama.cpp's BPE merge loop (no partition, no BOS)."""
        out: list[int] = []
        for word, _ in self._hf_pre.pre_tokenize_str(text):
            out.extend(bpe_tokenize_word(word, self._ranks, self._t2i, self.vocab.ignore_merges))
        return out

    # ------------------------------------------------------------------ decoding
    def _check_id(self, token_id) -> None:
        if not isinstance(token_id, (int, np.integer)) or isinstance(token_id, bool):
            raise TypeError(f"token ids must be integers, got {token_id!r}")
        if not 0 <= token_id < self.vocab.n_tokens:
            raise AlchemistError(f"token id {token_id} is out of range for a vocabulary of {self.vocab.n_tokens}")

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """llama.cpp `llama_token_to_piece` (lstrip=0): the bytes a token stands for."""
        key = (token_id, special)
        piece = self._piece_cache.get(key)
        if piece is not None:
            return piece
        self._check_id(token_id)
        attr = int(self._attrs[token_id])
        text = self._tokens[token_id]
        if not special and attr & _ATTR_SPECIAL:
            piece = b""
        elif attr & (_ATTR_SPECIAL | ATTR_USER_DEFINED):
            piece = text.encode("utf-8")
        elif attr & ATTR_NORMAL:
            if self.vocab.kind == "spm":
                piece = text.replace(_ESCAPED_SPACE, _SPACE).encode("utf-8")
            else:
                piece = _byte_level_decode(text)
        elif attr & ATTR_BYTE:
            piece = bytes([_strtol_hex(text[3:5])])
        else:  # unused / undefined tokens render as nothing in llama.cpp
            piece = b""
        self._piece_cache[key] = piece
        return piece

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        """llama.cpp `llama_detokenize(ids, remove_special=skip, unparse_special=not skip)` as bytes."""
        v = self.vocab
        ids = list(ids)
        remove_space = v.add_space_prefix
        if skip_special_tokens and v.add_bos and ids and ids[0] == v.bos_id:
            remove_space = False
            ids = ids[1:]
        if skip_special_tokens and v.add_eos and ids and ids[-1] == v.eos_id:
            ids = ids[:-1]
        parts = []
        special = not skip_special_tokens
        for tid in ids:
            piece = self.token_to_piece(_index(tid), special)
            if remove_space and piece[:1] == b" ":
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        out = b"".join(parts)
        if v.clean_spaces:
            out = _clean_spaces(out)
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids` (invalid UTF-8, e.g. a character cut in half, becomes U+FFFD)."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs):
        """Render the model's chat template (sandboxed, time- and size-bounded); see `alchemist.tokenizer.chat`."""
        from alchemist.tokenizer.chat import render_chat

        return render_chat(self, messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Render and tokenize a chat prompt; BOS is not added twice when the template already writes it."""
        prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        bos_text = self._tokens[self.bos_id] if self.bos_id is not None else None
        add_special = not (bos_text and self.vocab.add_bos and prompt.startswith(bos_text))
        return self.encode(prompt, add_special_tokens=add_special, parse_special=True)


class StreamDecoder:
    """Incremental decoding: feed token ids one (or a few) at a time, get text that is safe to show.

    Bytes of a UTF-8 character split across byte tokens are held back until the character is complete, so
    no chunk ever ends in half a character. `"".join(chunks) + flush()` equals `Tokenizer.decode(ids)` for
    vocabularies without llama.cpp's `clean_spaces` post-processing (which needs the whole text)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True
        self._remove_space = tokenizer.vocab.add_space_prefix

    def feed(self, token_ids: int | Iterable[int]) -> str:
        ids = [token_ids] if isinstance(token_ids, (int, np.integer)) else list(token_ids)
        v = self._tok.vocab
        parts = []
        for tid in ids:
            tid = _index(tid)
            if self._first:
                self._first = False
                if self._skip and v.add_bos and tid == v.bos_id:
                    self._remove_space = False
                    continue
            piece = self._tok.token_to_piece(tid, not self._skip)
            if self._remove_space and piece[:1] == b" ":
                piece = piece[1:]
            self._remove_space = False
            parts.append(piece)
        return self._utf8.decode(b"".join(parts))

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)

    @property
    def pending_bytes(self) -> int:
        return len(self._utf8.getstate()[0])


def _index(x) -> int:
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"token ids must be integers, got {x!r}") from None


def _strtol_hex(s: str) -> int:
    """C strtol(s, NULL, 16) on two characters: the longest hex prefix, 0 if none."""
    digits = ""
    for ch in s:
        if ch in "0123456789abcdefABCDEF":
            digits += ch
        else:
            break
    return int(digits, 16) & 0xFF if digits else 0


def _byte_level_decode(text: str) -> bytes:
    """llama.cpp `llama_decode_text`: GPT-2 byte characters back to bytes."""
    out = bytearray()
    for ch in text:
        b = UNICODE_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:  # llama.cpp writes this marker (including the whole token text) for unmappable characters
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


def _clean_spaces(text: bytes) -> bytes:
    """The three `clean_spaces` passes of llama.cpp `llama_detokenize`, done in place like the C++."""
    t = bytearray(text)
    # first pass: " ?", " !", " .", " ,"
    n, total = len(t), (1 if t else 0)
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    # second pass: strip single apostrophe between spaces
    n, total, i = total, (1 if total else 0), 1
    while i < n:
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    # third pass: apostrophe contractions (" 's", " 'm", " 're", " 've" lose the space)
    n, total = total, (1 if total else 0)
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n:
                x2 = t[i + 2]
                if (x1 == 0x72 and x2 == 0x65) or (x1 == 0x76 and x2 == 0x65):  # "re", "ve"
                    total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])


def load_tokenizer(path: str | os.PathLike, facts=None) -> Tokenizer:
    """Build a llama.cpp-exact tokenizer from a GGUF file's own metadata (nothing is downloaded).

    `facts`: the file's already parsed `read_gguf(path)`, to avoid reading its vocabulary twice.
    A BPE tokenizer built without warnings is kept in alchemist's cache (`tokenizers/`), keyed by the file's
    identity (path, size, mtime, inode), its first 32 MB (the metadata, vocabulary included) and this package's
    sources: a 150k-token BPE vocabulary takes ~0.5 s
    to build and ~0.15 s to load back, which a new process pays before its first token."""
    from alchemist.gguf_io import read_gguf

    # only BPE vocabularies are cached: their merge table is what takes the time (an SPM vocabulary builds
    # about as fast as it unpickles, and unpickled it holds a few MB more than one built from `facts`)
    bpe = facts is None or facts.metadata.get("tokenizer.ggml.model") == "gpt2"
    cache = _cache_entry(path, facts) if bpe else None
    if cache is not None and cache.is_file():
        try:
            with open(cache, "rb") as f:  # streamed: a transient 10-20 MB buffer would stay in the heap
                tok = pickle.load(f)
        except Exception:  # a damaged or foreign entry: build it again (and overwrite it below)
            tok = None
        if isinstance(tok, Tokenizer):
            return tok
    if facts is None:
        facts = read_gguf(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = Tokenizer(read_vocab(facts.metadata, str(Path(path))))
    for w in caught:  # shown to the caller as before; a tokenizer that warned is rebuilt (and warns) every time
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if cache is not None and not caught and tok.vocab.kind == "bpe":
        _store(cache, tok)
    return tok


def _cache_entry(path, facts=None) -> Path | None:
    """Where the tokenizer of the GGUF file at `path` is cached (None: the file cannot be stat'ed).

    The key covers the file's metadata bytes: its first 32 MB, or with `facts` everything before the tensor
    data when that is shorter (hashed from the memory map)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    import tokenizers

    key = hashlib.sha256(_SOURCES_DIGEST.encode())
    key.update(repr((os.fspath(path), os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino, tokenizers.__version__)).encode())
    buf = getattr(facts, "_buffer", None)
    if buf is not None and 0 < facts.data_offset <= min(_HEADER_BYTES, len(buf)):
        key.update(buf[: facts.data_offset])
        return cache_subdir("tokenizers") / f"{key.hexdigest()}.pkl"
    try:  # and the bytes of the file's header, where its vocabulary is (a rewrite within one mtime tick)
        chunk = bytearray(1 << 20)  # read in 1 MB pieces: one 32 MB buffer would raise malloc's mmap threshold
        view = memoryview(chunk)
        with open(path, "rb") as f:
            left = _HEADER_BYTES
            while left > 0:
                n = f.readinto(view[: min(left, len(chunk))])
                if not n:
                    break
                key.update(view[:n])
                left -= n
    except OSError:
        return None
    return cache_subdir("tokenizers") / f"{key.hexdigest()}.pkl"


_HEADER_BYTES = 32 << 20


def _store(cache: Path, tok: Tokenizer) -> None:
    """Pickle `tok` into `cache` atomically (streamed to a temporary file, then renamed); a cache that cannot
    be written is skipped."""
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            pickle.dump(tok, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, cache)
    except OSError:
        tmp.unlink(missing_ok=True)


# the tokenizer package's own sources: editing them invalidates every cached tokenizer
_SOURCES_DIGEST = hashlib.sha256(
    b"".join(f.read_bytes() for f in sorted(Path(__file__).parent.glob("*.py")))
    + f"{sys.version_info[:2]}".encode()
).hexdigest()
