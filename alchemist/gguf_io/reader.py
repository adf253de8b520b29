"""A validating, memory-mapped GGUF reader.

`gguf.GGUFReader` parses every element of every array in Python (18 s for a 262k-token vocabulary) and
trusts the sizes it reads. This reader walks the header once, keeps string arrays as offsets that are
decoded only when asked for, and checks every count, length, type, shape and offset against the file
before using it. Any inconsistency is a `GGUFError` naming the field and byte offset.

The file is untrusted input. For any byte sequence `read_gguf` either returns facts that are true of
the file or raises `GGUFError`: every loop is bounded by bytes actually present, nothing is allocated
in proportion to a size the file merely claims, and every tensor's bytes are checked to lie inside the
data section before `tensor_bytes` can hand them out. The layout rules are llama.cpp's (ggml/src/gguf.cpp):
tensor data is stored back to back in header order, each tensor padded to `general.alignment` (a uint32).

String arrays (the vocabulary) are decoded lazily, but their UTF-8 is validated at read time with one
vectorised pass, so a bad byte anywhere in the header fails `read_gguf` itself, deterministically,
rather than whichever later caller first touches the token list.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import re
import stat
import struct
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from alchemist.errors import GGUFError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40  # no real tensor is anywhere near this; anything larger is a lie
MAX_KEY_LENGTH = 1 << 16
MAX_TENSOR_NAME = 63  # GGML_MAX_NAME is 64 bytes including the terminating NUL
# Smallest possible encodings, used to refuse absurd counts before looping over them:
# a metadata entry is a key length (8) + value type (4) + a 1-byte value; a tensor info is a name length (8)
# + n_dims (4) + one dimension (8) + type (4) + offset (8).
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
HEADER_BYTES = 24  # magic, version, tensor_count, kv_count

# GGUF value type codes (gguf-py/gguf/constants.py GGUFValueType)
_SCALAR_FORMATS: dict[int, tuple[str, str]] = {
    0: ("uint8", "<B"),
    1: ("int8", "<b"),
    2: ("uint16", "<H"),
    3: ("int16", "<h"),
    4: ("uint32", "<I"),
    5: ("int32", "<i"),
    6: ("float32", "<f"),
    7: ("bool", "<?"),
    10: ("uint64", "<Q"),
    11: ("int64", "<q"),
    12: ("float64", "<d"),
}
_NUMPY_DTYPES = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
TYPE_BOOL = 7
TYPE_STRING = 8
TYPE_ARRAY = 9


def type_name(code: int) -> str:
    if code == TYPE_STRING:
        return "string"
    if code == TYPE_ARRAY:
        return "array"
    return _SCALAR_FORMATS[code][0]


# StringArray decodes up to this many strings, of at most this many bytes together, with one decode call
# (a loop over gemma's 262k tokens takes ~0.2 s, batches ~0.05 s); the index arrays take 16 bytes per byte
_DECODE_BATCH = 1 << 16
_DECODE_BATCH_BYTES = 1 << 20
# a byte that is not UTF-8, as decoding with surrogateescape shows it (0xFF is the batches' separator)
_ESCAPED_BYTE = re.compile("[\udc80-\udcfe]")


def _decode_joined(buf, starts: np.ndarray, lengths: np.ndarray) -> list[str] | None:
    """The strings buf[starts[i] : starts[i] + lengths[i]] with one decode and one split, or None when one
    of them is not valid UTF-8.

    Each string is preceded by the byte 0xFF, which never occurs in UTF-8: decoded with surrogateescape it
    becomes the lone surrogate U+DCFF, which no valid string contains, and the text is split there."""
    n = len(starts)
    if n == 0:
        return []
    # joined = FF s0 FF s1 ...: byte t of the concatenated text, in string i, comes from starts[i] + t -
    # before[i] and goes to t + i + 1. Both offsets are constant along a string, so each is a running sum
    # of ones with a jump at every non-empty string's first byte.
    before = np.cumsum(lengths) - lengths
    total = int(before[-1] + lengths[-1])
    nonempty = lengths > 0
    first, source_start, length = before[nonempty], starts[nonempty], lengths[nonempty]
    target_start = first + np.flatnonzero(nonempty) + 1
    source = np.ones(total, dtype=np.int64)
    target = np.ones(total, dtype=np.int64)
    if total:
        source[0], target[0] = source_start[0], target_start[0]
        source[first[1:]] = source_start[1:] - (source_start[:-1] + length[:-1] - 1)
        target[first[1:]] = target_start[1:] - (target_start[:-1] + length[:-1] - 1)
    joined = np.full(total + n, 0xFF, dtype=np.uint8)
    joined[np.cumsum(target)] = np.frombuffer(buf, dtype=np.uint8)[np.cumsum(source)]
    text = str(joined.tobytes(), "utf-8", "surrogateescape")
    parts = text.split("\udcff")
    if len(parts) != n + 1 or _ESCAPED_BYTE.search(text) is not None:
        return None
    return parts[1:]


class StringArray:
    """A GGUF array of strings, decoded on first access (a vocabulary is 100k-300k strings).

    `read_gguf` has already checked that every string is valid UTF-8, so decoding cannot fail for an
    array it returned; the check below only guards arrays built some other way."""

    def __init__(self, facts_path: str, key: str, buf: memoryview, starts: np.ndarray, lengths: np.ndarray):
        self._path = facts_path
        self._key = key
        self._buf = buf
        self._starts = starts
        self._lengths = lengths
        self._decoded: list[str] | None = None

    def __len__(self) -> int:
        return len(self._starts)

    def _decode_all(self) -> list[str]:
        if self._decoded is None:
            out: list[str] = []
            for lo in range(0, len(self._starts), _DECODE_BATCH):
                hi = min(lo + _DECODE_BATCH, len(self._starts))
                starts, lengths = self._starts[lo:hi], self._lengths[lo:hi]
                batch = _decode_joined(self._buf, starts, lengths) if lengths.sum() <= _DECODE_BATCH_BYTES else None
                out += batch if batch is not None else self._decode_each(lo, hi)
            self._decoded = out
        return self._decoded

    def _decode_each(self, lo: int, hi: int) -> list[str]:
        """Strings lo..hi-1 one by one; the first that is not UTF-8 is named in the error."""
        buf = self._buf
        out = []
        for i, s, n in zip(range(lo, hi), self._starts[lo:hi].tolist(), self._lengths[lo:hi].tolist()):
            try:
                out.append(str(buf[s : s + n], "utf-8"))
            except UnicodeDecodeError:
                raise GGUFError(self._path, f"{self._key}[{i}]", "string is not valid UTF-8", s) from None
        return out

    def to_list(self) -> list[str]:
        return list(self._decode_all())

    def __getitem__(self, index):
        return self._decode_all()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decode_all())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"<StringArray {self._key} n={len(self)}>"


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor inventory. `shape` is numpy order (GGUF `ne` reversed)."""

    name: str
    ggml_type: str  # GGMLQuantizationType name, e.g. "Q4_K"
    ne: tuple[int, ...]  # GGUF order: ne[0] is the contiguous (input) dimension
    offset: int  # relative to the start of the data section (a snapshot's: within its file)
    nbytes: int
    file: int = 0  # a snapshot's: which of its files holds the tensor
    transform: tuple = ()  # a snapshot's: what the loader does to the values (alchemist.snapshot)
    # a snapshot's MLX-quantized weight: (bits, group size, its scales and its biases as (file, offset, nbytes, type))
    quant: tuple = ()
    # a snapshot's tensor stacked from several (transformers' experts): each one's (file, offset, nbytes), in order
    parts: tuple = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def is_quantized(self) -> bool:
        return self.ggml_type != "F32"


@dataclass
class GGUFFacts:
    """Everything alchemist needs from a GGUF file's header, with byte access to its tensors."""

    path: str
    file_size: int
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any]
    metadata_types: dict[str, str]
    tensors: dict[str, TensorInfo]
    _buffer: Any = field(repr=False, default=None)
    _sha256: str | None = field(repr=False, default=None)

    @property
    def file_name(self) -> str:
        return os.path.basename(self.path)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(self.path, "general.architecture", "missing or not a string")
        return arch

    def sha256(self) -> str:
        """The file's sha256, remembered on disk per (path, inode, size, mtime) as git's index does, so
        reopening an unchanged 250 MB model does not hash it again (0.3 s)."""
        if self._sha256 is None:
            self._sha256 = _cached_file_sha256(self.path)
        return self._sha256

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as a read-only uint8 view into the memory map."""
        info = self.tensors[name]
        start = self.data_offset + info.offset
        return np.frombuffer(self._buffer, dtype=np.uint8, count=info.nbytes, offset=start)


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; every failure names the field and offset."""

    def __init__(self, path: str, buf: memoryview):
        self.path = path
        self.buf = buf
        self.pos = 0
        self.size = len(buf)

    def fail(self, fld: str, problem: str, offset: int | None = None):
        raise GGUFError(self.path, fld, problem, self.pos if offset is None else offset)

    def need(self, n: int, fld: str):
        if n < 0 or self.pos + n > self.size:
            self.fail(fld, f"needs {n} bytes but the file ends at byte {self.size} (truncated?)")

    def scalar(self, fmt: str, fld: str):
        n = struct.calcsize(fmt)
        self.need(n, fld)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, fld: str) -> int:
        return self.scalar("<I", fld)

    def u64(self, fld: str) -> int:
        return self.scalar("<Q", fld)

    def string(self, fld: str, max_len: int | None = None) -> str:
        start = self.pos
        n = self.u64(f"{fld} (length)")
        if max_len is not None and n > max_len:
            self.fail(fld, f"string length {n} exceeds the limit of {max_len}", start)
        self.need(n, fld)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            self.fail(fld, "string is not valid UTF-8", start)


def _read_value(cur: _Cursor, key: str, vtype: int, facts_path: str):
    if vtype == TYPE_BOOL:  # one byte, 0 or 1 (struct's "?" would read any non-zero byte as True)
        at = cur.pos
        v = cur.scalar("<B", key)
        if v > 1:
            cur.fail(key, f"bool value must be 0 or 1, got {v}", at)
        return bool(v)
    if vtype in _SCALAR_FORMATS:
        return cur.scalar(_SCALAR_FORMATS[vtype][1], key)
    if vtype == TYPE_STRING:
        return cur.string(key)
    if vtype == TYPE_ARRAY:
        item_type = cur.u32(f"{key} (array item type)")
        count_at = cur.pos
        count = cur.u64(f"{key} (array length)")
        if item_type in _SCALAR_FORMATS:
            return _read_scalar_array(cur, key, item_type, count, count_at)
        if item_type == TYPE_STRING:
            return _read_string_array(cur, key, count, count_at, facts_path)
        if item_type == TYPE_ARRAY:
            cur.fail(key, "nested arrays are not supported", count_at - 4)
        cur.fail(key, f"unknown array item type {item_type}", count_at - 4)
    cur.fail(key, f"unknown value type {vtype}", cur.pos - 4)


def _read_scalar_array(cur: _Cursor, key: str, item_type: int, count: int, count_at: int) -> np.ndarray:
    itemsize = struct.calcsize(_SCALAR_FORMATS[item_type][1])
    if count * itemsize > cur.size - cur.pos:
        cur.fail(key, f"array of {count} {type_name(item_type)} does not fit in the file", count_at)
    raw = np.frombuffer(cur.buf, dtype=np.uint8, count=count * itemsize, offset=cur.pos)
    if item_type == TYPE_BOOL and count and int(raw.max()) > 1:
        bad = int(np.argmax(raw > 1))
        cur.fail(f"{key}[{bad}]", f"bool value must be 0 or 1, got {int(raw[bad])}", cur.pos + bad)
    arr = raw.view(_NUMPY_DTYPES[item_type]).copy()
    cur.pos += count * itemsize
    return arr


def _read_string_array(cur: _Cursor, key: str, count: int, count_at: int, facts_path: str) -> "StringArray":
    if count * 8 > cur.size - cur.pos:
        cur.fail(key, f"array of {count} strings does not fit in the file", count_at)
    buf, pos, size, region_start = cur.buf, cur.pos, cur.size, cur.pos
    memo = _ends_memo(buf, pos, size, count) if count >= ENDS_MEMO_MIN_COUNT else None
    remembered = None if memo is None else _remembered_ends(memo, buf, pos, size, count)
    ends = remembered if remembered is not None else _string_ends(buf, pos, size, count)
    if ends is not None:
        starts_np = np.empty(count, dtype=np.int64)
        if count:
            starts_np[0] = pos + 8
            starts_np[1:] = ends[:-1] + 8
            cur.pos = int(ends[-1])
        lengths_np = ends - starts_np
        if remembered is None:  # (remembered ends: these same bytes passed the check before)
            _check_utf8(cur, key, region_start, cur.pos, starts_np, lengths_np)
            if memo is not None:
                _remember_ends(memo, buf, pos, ends)
        return StringArray(facts_path, key, buf, starts_np, lengths_np)
    # A string runs past the end of the file: find which, one by one, to say so.
    unpack = struct.Struct("<Q").unpack_from
    for i in range(count):
        if pos + 8 > size:
            cur.fail(f"{key}[{i}] (length)", "file ends inside a string array", pos)
        (n,) = unpack(buf, pos)
        pos += 8
        if n > size - pos:
            cur.fail(f"{key}[{i}]", f"string length {n} runs past the end of the file", pos - 8)
        pos += n
    raise AssertionError("unreachable: _string_ends failed but every string fits")  # pragma: no cover


# String arrays this long (a vocabulary, its merges) have their string offsets remembered on disk: walking
# the length prefixes is a Python loop (~0.1 s for a 150k-token vocabulary and its merges) that every new
# process opening the model would otherwise pay.
ENDS_MEMO_MIN_COUNT = 16384
ENDS_MEMO_KEY_BYTES = 65536  # the memo is looked up by this many bytes from the array's start


def _ends_memo(buf, pos: int, size: int, count: int) -> Path | None:
    """Where the offsets of the `count` strings at `pos` are remembered, looked up by the array's first bytes
    (a copy of the file elsewhere finds them too); None when the cache directory is unusable."""
    from alchemist.paths import cache_subdir

    key = hashlib.sha256(b"gguf string ends 1\0%d\0" % count)
    key.update(buf[pos : min(size, pos + ENDS_MEMO_KEY_BYTES)])
    try:
        return cache_subdir("gguf") / f"{key.hexdigest()}.ends"
    except OSError:
        return None


def _remembered_ends(memo: Path, buf, pos: int, size: int, count: int) -> np.ndarray | None:
    """The remembered end offsets, if the memo holds `count` of them and the sha256 of the bytes they span
    (every length prefix and string) is still that of the bytes from `pos` to the last end; else None."""
    try:
        data = memo.read_bytes()
    except OSError:
        return None
    if len(data) != 32 + 8 * count:
        return None
    ends = np.frombuffer(data, dtype="<i8", offset=32)
    end = int(ends[-1])
    if not pos + 8 * count <= end <= size or hashlib.sha256(buf[pos:end]).digest() != data[:32]:
        return None
    return ends.astype(np.int64, copy=False)


def _remember_ends(memo: Path, buf, pos: int, ends: np.ndarray) -> None:
    from alchemist.paths import remember

    digest = hashlib.sha256(buf[pos : int(ends[-1])]).digest()
    remember(memo, digest + ends.astype("<i8").tobytes())


def _string_ends(buf, pos: int, size: int, count: int) -> np.ndarray | None:
    """The end offset of each of `count` length-prefixed strings from `pos` (the tightest Python loop: 0.06 s
    for a 262k-token vocabulary), or None when one does not fit in the file (the caller then says which)."""
    unpack = struct.Struct("<Q").unpack_from
    ends = array("q")
    append = ends.append
    try:
        for _ in range(count):
            pos += unpack(buf, pos)[0] + 8
            append(pos)
    except (struct.error, OverflowError):  # a length prefix past the end, or an end past 2**63
        return None
    if pos > size:  # ends only grow, so this covers every string
        return None
    return np.frombuffer(ends, dtype=np.int64) if count else np.zeros(0, np.int64)


def _check_utf8(cur: _Cursor, key: str, region_start: int, region_end: int, starts: np.ndarray, lengths: np.ndarray):
    """Validate every string of an array at once: their concatenation must be UTF-8 and each must start
    on a character boundary (not a continuation byte 0x80-0xBF); then each string is UTF-8 on its own."""
    if not len(starts):
        return
    region = np.frombuffer(cur.buf, dtype=np.uint8, count=region_end - region_start, offset=region_start)
    rel_starts = starts - region_start
    edges = np.zeros(len(region) + 1, dtype=np.int8)
    edges[rel_starts] += 1  # starts are distinct, and so are ends; a string's end is never another's start
    edges[rel_starts + lengths] -= 1
    text = region[np.cumsum(edges[:-1], dtype=np.int8) > 0]
    if not len(text) or int(text.max()) < 0x80:
        return  # pure ASCII
    first = region[rel_starts[lengths > 0]]
    ok = not np.any((first & 0xC0) == 0x80)
    if ok:
        try:
            str(text.tobytes(), "utf-8")
        except UnicodeDecodeError:
            ok = False
    if ok:
        return
    for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):  # error path only: name the string
        try:
            str(cur.buf[s : s + n], "utf-8")
        except UnicodeDecodeError:
            cur.fail(f"{key}[{i}]", "string is not valid UTF-8", s - 8)
    raise AssertionError("unreachable: concatenation invalid but every string valid")  # pragma: no cover


def _tensor_nbytes(path: str, name: str, type_code: int, ne: tuple[int, ...], at: int) -> tuple[str, int]:
    try:
        qtype = GGMLQuantizationType(type_code)
    except ValueError:
        raise GGUFError(path, f"tensor {name!r} type", f"unknown ggml type code {type_code}", at) from None
    if qtype not in GGML_QUANT_SIZES:
        raise GGUFError(path, f"tensor {name!r} type", f"ggml type {qtype.name} has no known block size", at)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if ne[0] % block_size:
        raise GGUFError(
            path,
            f"tensor {name!r} shape",
            f"first dimension {ne[0]} is not a multiple of the {qtype.name} block size {block_size}",
            at,
        )
    return qtype.name, math.prod(ne) // block_size * type_size


def _padded(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def read_gguf(path: str | os.PathLike, *, max_elements: int = MAX_ELEMENTS) -> GGUFFacts:
    """Open, memory-map and validate a GGUF file's header and tensor inventory.

    `max_elements` caps the element count of any one tensor (and each of its dimensions): a file claiming
    more is refused while its tensor info is read, before anything is sized from it.
    """
    path = os.fsdecode(os.fspath(path))
    try:
        st = os.stat(path)
    except OSError as e:
        raise GGUFError(path, "file", f"cannot open: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise GGUFError(path, "file", "not a regular file")  # a FIFO would block open(); a device has no size
    try:
        f = open(path, "rb")
    except OSError as e:
        raise GGUFError(path, "file", f"cannot open: {e.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_BYTES:
            raise GGUFError(path, "header", f"file is {size} bytes, too small to be GGUF", 0)
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise GGUFError(path, "file", f"cannot memory-map: {e}") from None
    return _parse(path, mm, max_elements)


def _parse(path: str, mm: mmap.mmap, max_elements: int) -> GGUFFacts:
    size = len(mm)
    buf = memoryview(mm)
    cur = _Cursor(path, buf)
    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        cur.fail("magic", f"expected b'GGUF', found {magic!r}: not a GGUF file", 0)
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (big-endian files are not supported)" if version > 0xFFFF else ""
        cur.fail("version", f"unsupported GGUF version {version}{hint}", 4)
    n_tensors = cur.u64("tensor_count")
    n_kv = cur.u64("kv_count")
    if n_kv * MIN_KV_BYTES > size - HEADER_BYTES:
        cur.fail("kv_count", f"{n_kv} metadata entries cannot fit in a {size}-byte file", 16)
    if n_tensors * MIN_TENSOR_INFO_BYTES > size - HEADER_BYTES:
        cur.fail("tensor_count", f"{n_tensors} tensors cannot fit in a {size}-byte file", 8)

    metadata: dict[str, Any] = {}
    metadata_types: dict[str, str] = {}
    metadata_at: dict[str, int] = {}
    for i in range(n_kv):
        key_at = cur.pos
        key = cur.string(f"metadata key #{i}", max_len=MAX_KEY_LENGTH)
        if not key:
            cur.fail(f"metadata key #{i}", "is empty", key_at)
        if key in metadata:
            cur.fail(f"metadata key {key!r}", "appears twice", key_at)
        vtype = cur.u32(f"{key} (value type)")
        metadata_at[key] = cur.pos
        metadata[key] = _read_value(cur, key, vtype, path)
        metadata_types[key] = type_name(vtype)

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        alignment = metadata["general.alignment"]
        at = metadata_at["general.alignment"]
        if metadata_types["general.alignment"] != "uint32":
            cur.fail("general.alignment", f"must be a uint32, got a {metadata_types['general.alignment']}", at)
        if alignment == 0 or alignment & (alignment - 1):
            cur.fail("general.alignment", f"must be a positive power of two, got {alignment}", at)

    infos: list[tuple[TensorInfo, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        at = cur.pos
        name = cur.string(f"tensor #{i} name", max_len=MAX_KEY_LENGTH)
        if not name:
            cur.fail(f"tensor #{i} name", "is empty", at)
        if len(name.encode("utf-8")) > MAX_TENSOR_NAME:
            cur.fail(f"tensor #{i} name", f"{name[:80]!r} is longer than {MAX_TENSOR_NAME} bytes (ggml's limit)", at)
        if name in names:
            cur.fail(f"tensor {name!r}", "name appears twice", at)
        names.add(name)
        n_dims = cur.u32(f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            cur.fail(f"tensor {name!r} n_dims", f"must be 1..{MAX_DIMS}, got {n_dims}", cur.pos - 4)
        ne = tuple(cur.u64(f"tensor {name!r} dim {d}") for d in range(n_dims))
        if any(d == 0 for d in ne):
            cur.fail(f"tensor {name!r} shape", f"zero-sized dimension in {list(ne)}", at)
        if any(d > max_elements for d in ne) or math.prod(ne) > max_elements:
            cur.fail(f"tensor {name!r} shape", f"{list(ne)} has more than the limit of {max_elements} elements", at)
        type_at = cur.pos
        type_code = cur.u32(f"tensor {name!r} type")
        offset_at = cur.pos
        offset = cur.u64(f"tensor {name!r} offset")
        if offset % alignment:
            cur.fail(f"tensor {name!r} offset", f"{offset} is not aligned to {alignment}", offset_at)
        qname, nbytes = _tensor_nbytes(path, name, type_code, ne, type_at)
        if offset + nbytes > size:
            cur.fail(
                f"tensor {name!r} data", f"{nbytes} bytes at data offset {offset} cannot fit in a {size}-byte file", at
            )
        infos.append((TensorInfo(name, qname, ne, offset, nbytes), offset_at))

    data_offset = _padded(cur.pos, alignment)
    if infos and data_offset > size:  # with no tensors the (empty) data section may lie past the end
        cur.fail("data section", f"starts at {data_offset}, past the end of the file ({size})", cur.pos)
    data_size = max(0, size - data_offset)
    # llama.cpp's layout: tensor i starts where tensor i-1 ends, rounded up to the alignment. This also
    # rules out overlaps and gaps, so a type whose byte size disagrees with the next offset is caught.
    expected = 0
    for info, offset_at in infos:
        if info.offset != expected:
            cur.fail(
                f"tensor {info.name!r} offset",
                f"is {info.offset}, expected {expected}: each tensor's data must start where the previous "
                f"tensor's ends, rounded up to the alignment {alignment} (the first starts at 0)",
                offset_at,
            )
        if info.offset + info.nbytes > data_size:
            cur.fail(
                f"tensor {info.name!r} data",
                f"bytes {info.offset}..{info.offset + info.nbytes} of the data section run past its end "
                f"({data_size} bytes; file truncated?)",
                offset_at,
            )
        expected = _padded(info.offset + info.nbytes, alignment)

    tensors = {info.name: info for info, _ in infos}
    return GGUFFacts(path, size, version, alignment, data_offset, metadata, metadata_types, tensors, _buffer=mm)


def _cached_file_sha256(path: str) -> str:
    from alchemist.paths import cache_subdir, remember

    st = os.stat(path)
    identity = f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
    memo = cache_subdir("sha256") / hashlib.sha256(identity.encode()).hexdigest()
    try:
        known = memo.read_text().strip()
        if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
            return known
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    remember(memo, digest)
    return digest
