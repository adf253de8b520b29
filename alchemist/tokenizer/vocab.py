"""The vocabulary facts llama.cpp derives from a GGUF's `tokenizer.*` metadata (`llama_vocab::impl::load`).

Everything here mirrors llama.cpp, including its defaults when a key is absent and its text-based
detection of end-of-generation tokens, so that `Tokenizer` can reproduce `llama_tokenize` exactly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from alchemist.errors import GGUFError, UnsupportedModelError
from alchemist.tokenizer.pretokenizers import PreTokenizer, pre_tokenizer_for

# llama_token_type (GGUF tokenizer.ggml.token_type values)
TYPE_UNDEFINED, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = range(7)

# llama_token_attr bits
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

_TYPE_TO_ATTR = {
    TYPE_UNKNOWN: ATTR_UNKNOWN,
    TYPE_UNUSED: ATTR_UNUSED,
    TYPE_NORMAL: ATTR_NORMAL,
    TYPE_CONTROL: ATTR_CONTROL,
    TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TYPE_BYTE: ATTR_BYTE,
}

K = "tokenizer.ggml."

# Texts llama.cpp recognises (auto-detection "based on their text" in llama_vocab::impl::load).
EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
EOM_TEXTS = ("<|eom_id|>",)
FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
)  # fmt: skip
ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss hack

# (metadata key suffix, attribute name), in llama.cpp's order (the deprecated fim keys come last and win)
_SPECIAL_ID_KEYS = (
    ("bos_token_id", "bos_id"), ("eos_token_id", "eos_id"), ("eot_token_id", "eot_id"), ("eom_token_id", "eom_id"),
    ("unknown_token_id", "unk_id"), ("seperator_token_id", "sep_id"), ("padding_token_id", "pad_id"),
    ("mask_token_id", "mask_id"), ("fim_pre_token_id", "fim_pre_id"), ("fim_suf_token_id", "fim_suf_id"),
    ("fim_mid_token_id", "fim_mid_id"), ("fim_pad_token_id", "fim_pad_id"), ("fim_rep_token_id", "fim_rep_id"),
    ("fim_sep_token_id", "fim_sep_id"), ("prefix_token_id", "fim_pre_id"), ("suffix_token_id", "fim_suf_id"),
    ("middle_token_id", "fim_mid_id"),
)  # fmt: skip


@dataclass
class Vocab:
    """A GGUF vocabulary as llama.cpp sees it after loading."""

    path: str
    model: str  # tokenizer.ggml.model: "llama" (SPM) or "gpt2" (byte-level BPE)
    kind: str  # "spm" | "bpe"
    pre: str  # tokenizer.ggml.pre ("" when absent)
    pre_tokenizer: PreTokenizer | None  # BPE only
    tokens: list[str]
    scores: np.ndarray  # float32, one per token (0 when the GGUF has none)
    attrs: np.ndarray  # int32 llama_token_attr bits per token
    token_to_id: dict[str, int]
    merges: list[tuple[str, str]]  # BPE only, in rank order (first occurrence wins, like llama.cpp)
    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    unk_id: int | None = None
    sep_id: int | None = None
    pad_id: int | None = None
    mask_id: int | None = None
    fim_pre_id: int | None = None
    fim_suf_id: int | None = None
    fim_mid_id: int | None = None
    fim_pad_id: int | None = None
    fim_rep_id: int | None = None
    fim_sep_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    ignore_merges: bool = False
    clean_spaces: bool = False
    eog_ids: set[int] = field(default_factory=set)
    special_tokens: list[int] = field(default_factory=list)  # llama.cpp cache_special_tokens order
    chat_template: str | None = None
    chat_templates: dict[str, str] = field(default_factory=dict)  # tokenizer.chat_template.<name>
    notes: list[str] = field(default_factory=list)  # what llama.cpp would have logged as warnings
    phi3_rstrip: bool = False  # llama.cpp marks every special token RSTRIP for models named phi-3

    # Pickled compactly (load_tokenizer's cache is read by every new process before its first token): the
    # token -> id map is rebuilt from the tokens (they are distinct), and merges whose pieces are all tokens are
    # stored as id pairs, turned back into tuples of the token strings only when `merges` is first read (the
    # BPE port looks ranks up by id: MergeRanks), since building 150k tuples is a third of the load.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["token_to_id"] = None
        if "merge_ids" in state:  # unpickled and `merges` never read: store the ids as they came
            state["merges"] = state.pop("merge_ids")
            return state
        t2i = self.token_to_id
        if all(a in t2i and b in t2i for a, b in self.merges):
            state["merges"] = np.array([(t2i[a], t2i[b]) for a, b in self.merges], dtype=np.int32).reshape(-1, 2)
        return state

    def __setstate__(self, state: dict) -> None:
        tokens = state["tokens"]
        state["token_to_id"] = dict(zip(tokens, range(len(tokens))))
        if isinstance(state["merges"], np.ndarray):
            state["merge_ids"] = state.pop("merges")  # `merges` is built on first use (__getattr__)
        self.__dict__.update(state)

    def __getattr__(self, name: str):
        # only reached for an attribute missing from __dict__: `merges` of an unpickled vocabulary
        ids = self.__dict__.get("merge_ids") if name == "merges" else None
        if ids is not None:
            get = self.tokens.__getitem__
            merges = list(zip(map(get, ids[:, 0].tolist()), map(get, ids[:, 1].tolist())))
            self.merges = merges  # set before the ids go: a thread reading `merges` meanwhile finds one or the other
            self.__dict__.pop("merge_ids", None)
            return merges
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def merge_ranks(self) -> "MergeRanks | dict[tuple[str, str], int]":
        """merge pair -> rank (its index in `merges`; a repeated pair keeps its last index, as a dict built in
        order does)."""
        if "merge_ids" in self.__dict__:
            return MergeRanks(self.token_to_id, self.__dict__["merge_ids"])
        return dict(zip(self.merges, range(len(self.merges))))

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def token_text(self, token_id: int) -> str:
        return self.tokens[token_id]


class MergeRanks:
    """merge pair -> rank like `dict(zip(merges, range(len(merges))))`, for merges whose pieces are all tokens,
    keyed by the two pieces' token ids (a dict of 150k ints builds in a third of the time of one of string
    pairs, and the tuples are never made). Only `get` is needed: the BPE port's lookup."""

    __slots__ = ("_token_to_id", "_n", "_ranks")

    def __init__(self, token_to_id: dict[str, int], merge_ids: np.ndarray):
        self._token_to_id = token_to_id
        self._n = len(token_to_id)
        keys = merge_ids[:, 0].astype(np.int64) * self._n + merge_ids[:, 1]
        self._ranks = dict(zip(keys.tolist(), range(len(keys))))

    def get(self, pair: tuple[str, str], default=None):
        a = self._token_to_id.get(pair[0])
        b = self._token_to_id.get(pair[1])
        if a is None or b is None:  # every merge's pieces are tokens
            return default
        return self._ranks.get(a * self._n + b, default)

    def __len__(self) -> int:
        return len(self._ranks)


def _err(path: str, key: str, problem: str) -> GGUFError:
    return GGUFError(path, key, problem)


def _get_str(md: dict, path: str, key: str, default: str | None = None) -> str | None:
    v = md.get(key, default)
    if v is not None and not isinstance(v, str):
        raise _err(path, key, f"must be a string, got {type(v).__name__}")
    return v


def _get_bool(md: dict, path: str, key: str) -> bool | None:
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, int) and v in (0, 1):  # some converters wrote uint8 flags
        return bool(v)
    raise _err(path, key, f"must be a bool, got {v!r}")


def _get_id(md: dict, path: str, key: str) -> int | None:
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise _err(path, key, f"must be an integer token id, got {v!r}")
    return int(v)


def _numeric_array(md: dict, path: str, key: str, n: int, kinds: str) -> np.ndarray | None:
    v = md.get(key)
    if v is None:
        return None
    if not isinstance(v, np.ndarray) or v.dtype.kind not in kinds:
        raise _err(path, key, f"must be a numeric array ({kinds}), got {type(v).__name__}")
    if len(v) < n:
        raise _err(path, key, f"has {len(v)} entries but the vocabulary has {n} tokens")
    return v[:n]


def read_vocab(metadata: dict[str, Any], path: str = "<metadata>") -> Vocab:
    """Build the llama.cpp view of a vocabulary from GGUF metadata (as returned by `read_gguf`)."""
    md = metadata
    path = str(path)
    notes: list[str] = []
    model = _get_str(md, path, K + "model")
    if model is None:
        raise _err(path, K + "model", "missing: the file has no tokenizer (llama.cpp needs one to tokenize text)")
    pre = _get_str(md, path, K + "pre", "") or ""

    if model == "llama":
        kind = "spm"
        ids = {"bos_id": 1, "eos_id": 2, "unk_id": 0}
        flags = {"add_space_prefix": True, "clean_spaces": False, "add_bos": True, "add_eos": False}
        pre_tok = None
    elif model == "gpt2":
        kind = "bpe"
        ids = {"bos_id": 11, "eos_id": 11}
        flags = {"add_space_prefix": False, "clean_spaces": True, "add_bos": False, "add_eos": False}
        pre_tok = pre_tokenizer_for(pre)
        if pre_tok is None:
            raise UnsupportedModelError(
                f"{path}: {K}pre: pre-tokenizer {pre!r} is not supported by alchemist's tokenizer "
                "(see alchemist.tokenizer.pretokenizers.SUPPORTED_PRE)"
            )
        if not pre:
            notes.append("missing pre-tokenizer type, using 'default' (llama.cpp: generation quality will be degraded)")
        flags["clean_spaces"] = pre_tok.clean_spaces
        flags["ignore_merges"] = pre_tok.ignore_merges
        if pre_tok.add_bos is not None:
            flags["add_bos"] = pre_tok.add_bos
        if pre_tok.bos_is_null:
            ids["bos_id"] = None
    else:
        raise UnsupportedModelError(
            f"{path}: {K}model: tokenizer model {model!r} is not supported (alchemist handles 'llama' and 'gpt2')"
        )

    space_prefix = _get_bool(md, path, K + "add_space_prefix")
    if space_prefix is not None:
        flags["add_space_prefix"] = space_prefix

    # --- tokens, scores, types ---
    toks_v = md.get(K + "tokens")
    if toks_v is None:
        raise _err(path, K + "tokens", "missing: cannot find the tokenizer vocabulary")
    if not hasattr(toks_v, "to_list") and not (isinstance(toks_v, list) and all(isinstance(t, str) for t in toks_v)):
        raise _err(path, K + "tokens", f"must be an array of strings, got {type(toks_v).__name__}")
    tokens = toks_v.to_list() if hasattr(toks_v, "to_list") else list(toks_v)
    n = len(tokens)
    if n == 0:
        raise _err(path, K + "tokens", "is empty")
    token_to_id = {t: i for i, t in enumerate(tokens)}
    if "" in token_to_id:
        for i, t in enumerate(tokens):
            if not t:  # llama.cpp: "empty token at index"
                tokens[i] = f"[EMPTY_{i}]"
                notes.append(f"empty token at index {i}")
        token_to_id = {t: i for i, t in enumerate(tokens)}
    if len(token_to_id) != n:
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise _err(path, f"{K}tokens[{i}]", f"duplicates token {seen[t]} ({t!r}); llama.cpp rejects this")
            seen[t] = i

    scores_v = _numeric_array(md, path, K + "scores", n, "fi")
    scores = np.zeros(n, np.float32) if scores_v is None else scores_v.astype(np.float32)
    types_v = _numeric_array(md, path, K + "token_type", n, "iu")
    if types_v is None:
        attrs = np.full(n, ATTR_NORMAL, np.int32)
    else:
        lut = np.zeros(8, np.int32)  # unknown type codes -> ATTR_UNDEFINED, like llama.cpp
        for t, a in _TYPE_TO_ATTR.items():
            lut[t] = a
        tv = types_v.astype(np.int64)
        attrs = np.where((tv >= 0) & (tv < 8), lut[np.clip(tv, 0, 7)], ATTR_UNDEFINED).astype(np.int32)

    # --- merges ---
    merges: list[tuple[str, str]] = []
    if kind == "bpe":
        mv = md.get(K + "merges")
        if mv is None:
            raise _err(path, K + "merges", "missing: a 'gpt2' (BPE) tokenizer needs its merges")
        if not hasattr(mv, "to_list"):
            raise _err(path, K + "merges", f"must be an array of strings, got {type(mv).__name__}")
        seen_pairs: set[tuple[str, str]] = set()
        for word in mv.to_list():
            pos = word.find(" ", 1)
            if pos < 0:  # llama.cpp stores ("", ""), a pair no two symbols can ever form
                continue
            pair = (word[:pos], word[pos + 1 :])
            if pair not in seen_pairs:  # std::unordered_map::emplace keeps the first rank
                seen_pairs.add(pair)
                merges.append(pair)

    v = Vocab(path, model, kind, pre, pre_tok, tokens, scores, attrs, token_to_id, merges, notes=notes, **flags)
    v.chat_template = _get_str(md, path, "tokenizer.chat_template")
    for key, val in md.items():
        if key.startswith("tokenizer.chat_template.") and isinstance(val, str):
            v.chat_templates[key[len("tokenizer.chat_template.") :]] = val

    # --- special ids: defaults out of range are disabled, bad GGUF ids keep the default ---
    for name, value in ids.items():
        setattr(v, name, value)
    for attr in ("bos_id", "eos_id", "unk_id"):
        value = getattr(v, attr)
        if value is not None and value >= n:
            notes.append(f"default special token {attr} = {value} out of vocab range, disabling")
            setattr(v, attr, None)
    for suffix, attr in _SPECIAL_ID_KEYS:
        new_id = _get_id(md, path, K + suffix)
        if new_id is None:
            continue
        if not 0 <= new_id < n:
            notes.append(f"bad special token {K + suffix} = {new_id}, using default id {getattr(v, attr)}")
        else:
            setattr(v, attr, new_id)

    for key, attr in (("add_bos_token", "add_bos"), ("add_eos_token", "add_eos")):
        flag = _get_bool(md, path, K + key)
        if flag is not None:
            setattr(v, attr, flag)

    _detect_specials(v, md)
    _special_cache(v)
    if not pre and kind == "bpe":
        warnings.warn(f"{path}: {K}pre is missing; using llama.cpp's 'default' pre-tokenizer", stacklevel=2)
    return v


def _detect_specials(v: Vocab, md: dict) -> None:
    """EOT/EOM/FIM detection by text, 'unused' marking and the end-of-generation set, as in llama.cpp."""
    attrs, t2i = v.attrs, v.token_to_id

    def mark_control(tid: int) -> None:
        if not attrs[tid] & ATTR_CONTROL:
            v.notes.append(f"control-looking token {tid} {v.tokens[tid]!r} was not control-type; overriding")
            attrs[tid] |= ATTR_CONTROL

    # llama.cpp iterates an unordered_map here, so with several candidates the pick is unspecified (all of
    # them end up in the end-of-generation set anyway). We take the first text in llama.cpp's list order,
    # which is what it picks for Qwen (<|im_end|> over <|endoftext|>).
    def detect(attr: str, texts: tuple[str, ...]) -> None:
        if getattr(v, attr) is not None:
            return
        found = [t2i[t] for t in texts if t in t2i]
        if found:
            setattr(v, attr, found[0])
            mark_control(found[0])

    detect("eot_id", EOT_TEXTS)
    detect("eom_id", EOM_TEXTS)
    for name, texts in FIM_TEXTS.items():
        detect(f"{name}_id", texts)

    ctrl = np.nonzero(attrs & ATTR_CONTROL)[0]
    for tid in ctrl.tolist():
        if "unused" in v.tokens[tid]:
            attrs[tid] |= ATTR_UNUSED

    eog: set[int] = set()
    for attr in ("fim_pad_id", "fim_rep_id", "fim_sep_id"):
        if getattr(v, attr) is not None:
            eog.add(getattr(v, attr))
    for text in EOG_TEXTS:
        tid = t2i.get(text)
        if tid is not None:
            eog.add(tid)
            mark_control(tid)
    for text in ALWAYS_USER_DEFINED:
        tid = t2i.get(text)
        if tid is not None:
            attrs[tid] = ATTR_USER_DEFINED
    for attr in ("eos_id", "eot_id", "eom_id"):
        tid = getattr(v, attr)
        if tid is not None and tid not in eog:
            eog.add(tid)
            v.notes.append(f"special {attr} is not in the end-of-generation set; adding it")
    texts = {v.tokens[t]: t for t in eog if 0 <= t < v.n_tokens}
    if "<|end|>" in texts and (
        ("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
        or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)
    ):
        eog.discard(texts["<|end|>"])
        attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = ATTR_NORMAL
    v.eog_ids = eog

    # per-token attributes set by model name (llama.cpp "Handle per token attributes")
    name = (md.get("general.name") or "") if isinstance(md.get("general.name"), str) else ""
    name = name.lower()
    arch = md.get("general.architecture") if isinstance(md.get("general.architecture"), str) else ""
    if any(s in v.pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
    ):
        if "<mask>" in t2i:
            attrs[t2i["<mask>"]] |= ATTR_LSTRIP
    elif "phi-3" in name or "phi3" in name:
        v.phi3_rstrip = True  # applied after the special cache is built (llama.cpp does it in that order)
    elif "modern-bert" in name and "[MASK]" in t2i:
        attrs[t2i["[MASK]"]] |= ATTR_LSTRIP


def _special_cache(v: Vocab) -> None:
    """Control, user-defined and unknown tokens, longest text first (llama.cpp uses an unstable std::sort;
    ties are kept in id order here)."""
    attrs = v.attrs
    ids = np.nonzero(attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))[0].tolist()
    ids.sort(key=lambda i: -len(v.tokens[i].encode("utf-8")))
    v.special_tokens = ids
    if v.phi3_rstrip:
        for tid in ids:
            attrs[tid] |= ATTR_RSTRIP
        t2i = v.token_to_id
        for text in ("</s>",):
            if text in t2i:
                attrs[t2i[text]] |= ATTR_RSTRIP
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            if text in t2i:
                attrs[t2i[text]] &= ~ATTR_RSTRIP
