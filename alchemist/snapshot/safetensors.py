"""safetensors files, read as the GGUF reader reads GGUF: every size and offset checked before use, the tensors
left in the memory map (zero copy).

A file is `N` (u64, little-endian), a JSON header of N bytes ({name: {"dtype", "shape", "data_offsets"}}, and an
optional "__metadata__" of strings), then the data: tensor `name` lies at 8 + N + data_offsets[0]. As the
safetensors library requires, the tensors tile the data without gaps or overlaps and end at the end of the file.
A sharded snapshot lists its files in model.safetensors.index.json ({"weight_map": {name: file}})."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from alchemist.errors import GGUFError

MAX_HEADER = 100_000_000  # the safetensors library's MAX_HEADER_SIZE
# the dtypes alchemist reads, as the GGUF float type of the same bytes (little-endian)
# U32: MLX's packed weights; U8: the 8-bit scales of its mxfp4, mxfp8 and nvfp4 modes
DTYPES = {"F32": ("F32", 4), "F16": ("F16", 2), "BF16": ("BF16", 2), "U32": ("U32", 4), "U8": ("U8", 1)}
OTHER_DTYPES = {"BOOL", "I8", "I16", "U16", "I32", "I64", "U64", "F64", "C64", "F8_E5M2", "F8_E4M3",
                "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}  # fmt: skip


class SnapshotError(GGUFError):
    """A snapshot file is malformed, truncated, or claims something that cannot be true (names file and field)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its dtype, shape (numpy order) and absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True)
class SafetensorsFile:
    path: str
    size: int
    tensors: dict[str, Entry]
    metadata: dict[str, str]

    def array(self, name: str, buffer=None) -> np.ndarray:
        """The tensor as stored (BF16 as its uint16 bits), a read-only view into the memory map."""
        e = self.tensors[name]
        data = buffer if buffer is not None else np.memmap(self.path, dtype=np.uint8, mode="r")
        view = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "U32": "<u4"}[e.dtype]
        return data[e.start : e.start + e.nbytes].view(view).reshape(e.shape)


def read_safetensors(path: str | os.PathLike) -> SafetensorsFile:
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SnapshotError(path, "header length", f"the file has {len(head)} bytes, fewer than 8")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER or 8 + n > size:
                raise SnapshotError(path, "header length", f"{n} bytes, beyond the file's {size} (or {MAX_HEADER})")
            raw = f.read(n)
    except OSError as e:
        raise SnapshotError(path, "file", f"cannot be read: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SnapshotError(path, "header", f"not a JSON object: {e}") from None
    if not isinstance(header, dict):
        raise SnapshotError(path, "header", f"not a JSON object but a {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SnapshotError(path, "__metadata__", "must map names to strings")
    base, spans, tensors = 8 + n, [], {}
    for name, spec in header.items():
        where = f"tensor {name!r}"
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise SnapshotError(path, where, "must be {dtype, shape, data_offsets}")
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if dtype not in DTYPES:
            known = dtype in OTHER_DTYPES
            raise SnapshotError(path, f"{where} dtype", f"{dtype!r} is {'not read by alchemist' if known else 'unknown'}"
                                f" (it reads {', '.join(DTYPES)})")  # fmt: skip
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):  # fmt: skip
            raise SnapshotError(path, f"{where} shape", f"must be a list of non-negative integers, got {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):  # fmt: skip
            raise SnapshotError(path, f"{where} data_offsets", f"must be [start, end], got {offsets!r}")
        start, end = offsets
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        if not 0 <= start <= end or end - start != nbytes:
            raise SnapshotError(path, f"{where} data_offsets",
                                f"[{start}, {end}] does not hold {shape} of {dtype} ({nbytes} bytes)")  # fmt: skip
        spans.append((start, end, name))
        tensors[name] = Entry(dtype, tuple(shape), base + start, nbytes)
    at = 0
    for start, end, name in sorted(spans):
        if start != at:
            raise SnapshotError(path, f"tensor {name!r} data_offsets",
                                f"starts at {start}, not where the data before it ends ({at}): a gap or an overlap")  # fmt: skip
        at = end
    if base + at != size:
        raise SnapshotError(path, "data", f"the tensors end at byte {base + at}, the file at {size}")
    return SafetensorsFile(path, size, tensors, metadata)


def snapshot_files(root: str | os.PathLike) -> list[Path]:
    """The safetensors files of a snapshot directory: those its index names (checked to be inside the directory),
    or else its *.safetensors."""
    root = Path(root)
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise SnapshotError(str(index), "weight_map", f"cannot be read: {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise SnapshotError(str(index), "weight_map", "must map tensor names to file names")
        names = sorted(set(weight_map.values()))
        bad = [f for f in names if Path(f).name != f or not f.endswith(".safetensors")]
        if bad:
            raise SnapshotError(str(index), "weight_map", f"names files outside the snapshot: {bad[:3]}")
        return [root / f for f in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise SnapshotError(str(root), "*.safetensors", "the snapshot directory has no safetensors file")
    return files
