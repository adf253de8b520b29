"""A snapshot's tokenizer: tokenizer.json through the Hugging Face `tokenizers` library (token ids as transformers
gives them), tokenizer_config.json for the special tokens and the chat template (rendered in alchemist's sandbox,
as a GGUF's), and the interface the runtime, the server and `alchemist chat` use of a GGUF's Tokenizer."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from alchemist.errors import AlchemistError
from alchemist.snapshot.safetensors import SnapshotError
from alchemist.tokenizer.tokenizer import StreamDecoder, Tokenizer, _byte_level_decode

MAX_JSON_BYTES = 64 << 20  # a tokenizer.json of a 262k vocabulary is ~35 MB
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class SnapshotVocab:
    """What the chat renderer and the stream decoder read of a vocabulary."""

    path: str
    tokens: list[str]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    chat_templates: dict[str, str] = field(default_factory=dict)
    add_space_prefix: bool = False  # the tokenizer's decoder strips a leading space itself where it adds one


def _read_json(path: Path, required: bool = True):
    if not path.exists():
        if required:
            raise SnapshotError(str(path), "file", "the snapshot has no tokenizer file of this name")
        return {}
    if path.stat().st_size > MAX_JSON_BYTES:
        raise SnapshotError(str(path), "file", f"over {MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SnapshotError(str(path), "file", f"cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise SnapshotError(str(path), "file", "is not a JSON object")
    return data


def _token_text(value) -> str | None:
    """tokenizer_config.json names a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class SnapshotTokenizer:
    def __init__(self, root: str | os.PathLike):
        from tokenizers import Tokenizer as HFTokenizer

        root = Path(root)
        path = root / "tokenizer.json"
        spec = _read_json(path)
        config = _read_json(root / "tokenizer_config.json", required=False)
        try:
            self._hf = HFTokenizer.from_str(json.dumps(spec))
            self._hf_plain = HFTokenizer.from_str(json.dumps(spec))  # special tokens' texts stay text
            self._hf_plain.encode_special_tokens = True
        except Exception as e:  # noqa: BLE001 (the tokenizers library's errors are its own)
            raise SnapshotError(str(path), "file", f"the tokenizers library cannot build it: {e}") from None
        n = self._hf.get_vocab_size(with_added_tokens=True)
        self._tokens = [self._hf.id_to_token(i) or "" for i in range(n)]
        added = {t["id"]: t for t in spec.get("added_tokens", []) if isinstance(t, dict) and "id" in t}
        self._special = {i for i, t in added.items() if t.get("special")}
        layout = json.dumps([spec.get(k) for k in ("normalizer", "pre_tokenizer", "decoder")])
        self._byte_level = '"ByteLevel"' in layout
        # a SentencePiece-style tokenizer puts "▁" before the text, which its decoder takes off again
        prefix_space = '"Metaspace"' in layout and '"never"' not in layout or r'"prepend": "\u2581"' in layout
        self._byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))

        def special_id(key):
            text = _token_text(config.get(key))
            return self._hf.token_to_id(text) if text is not None else None

        bos, eos, pad = special_id("bos_token"), special_id("eos_token"), special_id("pad_token")
        template = config.get("chat_template")
        templates = {}
        if isinstance(template, list):  # [{"name", "template"}, ...]
            templates = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
            template = templates.get("default")
        self._eos_ids = frozenset(
            {i for i in (eos,) if i is not None}
            | {i for i, t in added.items() if t.get("special") and t.get("content") in EOG_TEXTS}
        )
        self._pad_id = pad
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # the post-processor decides; see whether it puts BOS first
            add_bos = bos is not None and self._hf.encode("a").ids[:1] == [bos]
        self.vocab = SnapshotVocab(str(root), self._tokens, bos, eos, bool(add_bos),
                                   template if isinstance(template, str) else None, templates,
                                   add_space_prefix=prefix_space)  # fmt: skip
        self._pieces: dict[tuple[int, bool], bytes] = {}

    # -- what a GGUF's Tokenizer answers ----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def chat_template(self) -> str | None:
        return self.vocab.chat_template

    @property
    def has_chat_template(self) -> bool:
        return bool(self.vocab.chat_template)

    def id_to_token(self, token_id: int) -> str:
        self._check(token_id)
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        return self._hf.token_to_id(text)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eos_ids

    def _check(self, token_id: int) -> None:
        if not 0 <= int(token_id) < len(self._tokens):
            raise AlchemistError(f"token id {token_id} is out of range [0, {len(self._tokens)})")

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        hf = self._hf if parse_special else self._hf_plain
        return list(hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes a token stands for (a special token's text, or nothing when special is False)."""
        key = (int(token_id), bool(special))
        piece = self._pieces.get(key)
        if piece is None:
            self._check(token_id)
            text = self._tokens[token_id]
            if token_id in self._special:
                piece = text.encode("utf-8") if special else b""
            elif self._byte_fallback and (m := _BYTE_TOKEN.fullmatch(text)):
                piece = bytes([int(m.group(1), 16)])
            elif self._byte_level:
                piece = _byte_level_decode(text)
            else:
                piece = text.replace("\u2581", " ").encode("utf-8")
            self._pieces[key] = piece
        return piece

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)

    # the chat template renders and tokenizes as a GGUF's does (alchemist's sandbox; BOS not added twice)
    apply_chat_template = Tokenizer.apply_chat_template
    encode_chat = Tokenizer.encode_chat

    def __repr__(self) -> str:
        return f"<SnapshotTokenizer n_vocab={len(self._tokens)} from {self.vocab.path}>"


# end-of-generation tokens by their text, beside tokenizer_config.json's eos_token (llama.cpp's EOG list)
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<|end|>", "</s>", "<|eom_id|>"})


def load_snapshot_tokenizer(root: str | os.PathLike) -> SnapshotTokenizer | None:
    """The snapshot's tokenizer, or None when it has no tokenizer.json (token ids in)."""
    return SnapshotTokenizer(root) if (Path(root) / "tokenizer.json").exists() else None
