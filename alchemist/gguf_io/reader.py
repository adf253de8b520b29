"""A validating, memory-mapped GGUF reader.

`gguf.GGUFReader` parses every element of every array in Python (18 s for a 262k-token vocabulary) and
trusts the sizes it reads. This reader walks the header once, keeps string arrays as offsets that are
decoded only when asked for, and checks every count, length, type, shape and offset against the file
before using it. Any inconsistency is a `GGUFError` naming the field and byte offset.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
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
TYPE_STRING = 8
TYPE_ARRAY = 9


def type_name(code: int) -> str:
    if code == TYPE_STRING:
        return "string"
    if code == TYPE_ARRAY:
        return "array"
    return _SCALAR_FORMATS[code][0]


class StringArray:
    """A GGUF array of strings, decoded on first access (a vocabulary is 100k-300k strings)."""

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
            buf = self._buf
            out = []
            for i, (s, n) in enumerate(zip(self._starts.tolist(), self._lengths.tolist())):
                try:
                    out.append(str(buf[s : s + n], "utf-8"))
                except UnicodeDecodeError:
                    raise GGUFError(self._path, f"{self._key}[{i}]", "string is not valid UTF-8", s) from None
            self._decoded = out
        return self._decoded

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
    offset: int  # relative to the start of the data section
    nbytes: int

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
        if self._sha256 is None:
            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            self._sha256 = h.hexdigest()
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
    if vtype in _SCALAR_FORMATS:
        v = cur.scalar(_SCALAR_FORMATS[vtype][1], key)
        return v
    if vtype == TYPE_STRING:
        return cur.string(key)
    if vtype == TYPE_ARRAY:
        item_type = cur.u32(f"{key} (array item type)")
        count_at = cur.pos
        count = cur.u64(f"{key} (array length)")
        if item_type in _SCALAR_FORMATS:
            itemsize = struct.calcsize(_SCALAR_FORMATS[item_type][1])
            if count * itemsize > cur.size - cur.pos:
                cur.fail(key, f"array of {count} {type_name(item_type)} does not fit in the file", count_at)
            arr = np.frombuffer(cur.buf, dtype=_NUMPY_DTYPES[item_type], count=count, offset=cur.pos).copy()
            cur.pos += count * itemsize
            return arr
        if item_type == TYPE_STRING:
            if count * 8 > cur.size - cur.pos:
                cur.fail(key, f"array of {count} strings does not fit in the file", count_at)
            starts = np.empty(count, dtype=np.int64)
            lengths = np.empty(count, dtype=np.int64)
            buf, pos, size = cur.buf, cur.pos, cur.size
            unpack = struct.Struct("<Q").unpack_from
            for i in range(count):
                if pos + 8 > size:
                    cur.fail(f"{key}[{i}] (length)", "file ends inside a string array", pos)
                (n,) = unpack(buf, pos)
                pos += 8
                if n > size - pos:
                    cur.fail(f"{key}[{i}]", f"string length {n} runs past the end of the file", pos - 8)
                starts[i] = pos
                lengths[i] = n
                pos += n
            cur.pos = pos
            return StringArray(facts_path, key, buf, starts, lengths)
        if item_type == TYPE_ARRAY:
            cur.fail(key, "nested arrays are not supported", count_at)
        cur.fail(key, f"unknown array item type {item_type}", count_at - 4)
    cur.fail(key, f"unknown value type {vtype}", cur.pos - 4)


def _tensor_nbytes(path: str, name: str, type_code: int, ne: tuple[int, ...], at: int) -> tuple[str, int]:
    try:
        qtype = GGMLQuantizationType(type_code)
    except ValueError:
        raise GGUFError(path, f"tensor {name!r} type", f"unknown ggml type code {type_code}", at) from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if ne[0] % block_size:
        raise GGUFError(
            path,
            f"tensor {name!r} shape",
            f"first dimension {ne[0]} is not a multiple of the {qtype.name} block size {block_size}",
            at,
        )
    return qtype.name, math.prod(ne) // block_size * type_size


def read_gguf(path: str | os.PathLike) -> GGUFFacts:
    """Open, memory-map and validate a GGUF file's header and tensor inventory."""
    path = str(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise GGUFError(path, "file", f"cannot open: {e.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFError(path, "header", f"file is {size} bytes, too small to be GGUF", 0)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf = memoryview(mm)
    cur = _Cursor(path, buf)

    cur.need(4, "magic")
    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        cur.fail("magic", f"expected b'GGUF', found {magic!r}: not a GGUF file")
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (big-endian files are not supported)" if version > 0xFFFF else ""
        cur.fail("version", f"unsupported GGUF version {version}{hint}", 4)
    n_tensors = cur.u64("tensor_count")
    n_kv = cur.u64("kv_count")
    # Each metadata entry takes at least 8 (key length) + 1 + 4 (type) + 1 bytes, each tensor info 8+1+4+8+4+8.
    if n_kv * 14 > size:
        cur.fail("kv_count", f"{n_kv} metadata entries cannot fit in a {size}-byte file", 16)
    if n_tensors * 33 > size:
        cur.fail("tensor_count", f"{n_tensors} tensors cannot fit in a {size}-byte file", 8)

    metadata: dict[str, Any] = {}
    metadata_types: dict[str, str] = {}
    for i in range(n_kv):
        key_at = cur.pos
        key = cur.string(f"metadata key #{i}", max_len=MAX_KEY_LENGTH)
        if key in metadata:
            cur.fail(f"metadata key {key!r}", "appears twice", key_at)
        vtype = cur.u32(f"{key} (value type)")
        metadata[key] = _read_value(cur, key, vtype, path)
        metadata_types[key] = type_name(vtype) if vtype in _SCALAR_FORMATS or vtype in (8, 9) else "?"

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(path, "general.alignment", f"must be a positive power of two, got {alignment!r}")

    infos: list[tuple[TensorInfo, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        at = cur.pos
        name = cur.string(f"tensor #{i} name", max_len=MAX_KEY_LENGTH)
        if name in names:
            cur.fail(f"tensor {name!r}", "name appears twice", at)
        names.add(name)
        n_dims = cur.u32(f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            cur.fail(f"tensor {name!r} n_dims", f"must be 1..{MAX_DIMS}, got {n_dims}", cur.pos - 4)
        ne = tuple(cur.u64(f"tensor {name!r} dim {d}") for d in range(n_dims))
        if any(d == 0 for d in ne):
            cur.fail(f"tensor {name!r} shape", f"zero-sized dimension in {list(ne)}", at)
        if any(d > MAX_ELEMENTS for d in ne) or math.prod(ne) > MAX_ELEMENTS:
            cur.fail(f"tensor {name!r} shape", f"{list(ne)} has more than 2^40 elements", at)
        type_code = cur.u32(f"tensor {name!r} type")
        offset = cur.u64(f"tensor {name!r} offset")
        if offset % alignment:
            cur.fail(f"tensor {name!r} offset", f"{offset} is not aligned to {alignment}", cur.pos - 8)
        qname, nbytes = _tensor_nbytes(path, name, type_code, ne, at)
        infos.append((TensorInfo(name, qname, ne, offset, nbytes), at))

    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    if data_offset > size:
        raise GGUFError(path, "data section", f"starts at {data_offset}, past the end of the file ({size})")
    data_size = size - data_offset
    prev_end, prev_name = 0, None
    for info, at in sorted(infos, key=lambda t: t[0].offset):
        if info.offset + info.nbytes > data_size:
            raise GGUFError(
                path,
                f"tensor {info.name!r} data",
                f"bytes {info.offset}..{info.offset + info.nbytes} of the data section run past its end "
                f"({data_size} bytes; file truncated?)",
                at,
            )
        if info.offset < prev_end:
            raise GGUFError(path, f"tensor {info.name!r} data", f"overlaps tensor {prev_name!r}", at)
        prev_end, prev_name = info.offset + info.nbytes, info.name

    tensors = {info.name: info for info, _ in infos}
    return GGUFFacts(path, size, version, alignment, data_offset, metadata, metadata_types, tensors, _buffer=mm)
