"""A corpus of malformed GGUF files, each derived from a valid tiny fixture by one precise mutation.

`parse_layout` is an independent, trusting parser of a *valid* file: it records the byte offset of every
header field, metadata entry and tensor info, so a mutation can hit exactly the field it means to.
`assemble` re-serialises a header from (possibly edited) pieces and re-pads the data section, for
mutations that change sizes (a value of another type, a duplicated entry, a longer name) but should not
disturb anything else.

Each `Variant` says what a correct reader must do with it:

  REJECT     read_gguf raises GGUFError (the file is provably invalid)
  IR_REJECT  read_gguf succeeds (the file is a valid GGUF) and build_model_ir raises an AlchemistError,
             whose message contains `mention` when given (the key it must name)
  OK         both succeed (a harmless mutation: tensor bytes, trailing bytes, an explicit default)
  ANY        a clean AlchemistError at either stage, or a read that agrees with an independent reader

`generate_corpus(dir)` writes the base fixtures and returns the variants (a few hundred).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from alchemist.fixtures import FixtureConfig, write_fixture

REJECT, IR_REJECT, OK, ANY = "reject", "ir_reject", "ok", "any"

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {
    U8: "<B",
    I8: "<b",
    U16: "<H",
    I16: "<h",
    U32: "<I",
    I32: "<i",
    F32: "<f",
    BOOL: "<B",
    U64: "<Q",
    I64: "<q",
    F64: "<d",
}
GGML_F32, GGML_F16, GGML_Q8_0, GGML_Q4_K, GGML_I8 = 0, 1, 8, 12, 24
UNKNOWN_GGML_TYPES = (4, 5, 31, 36, 42, 0xFFFFFFFF)
U64_MAX = (1 << 64) - 1
NAN, INF = float("nan"), float("inf")


@dataclass(frozen=True)
class Variant:
    name: str
    data: bytes
    expect: str = ANY
    mention: str | None = None


# --------------------------------------------------------------------------------------------------
# Layout of a valid file


@dataclass
class KV:
    index: int
    key: str
    start: int  # the key's u64 length field
    key_at: int  # first byte of the key
    type_at: int
    value_at: int
    end: int
    vtype: int
    item_type: int | None = None
    count_at: int | None = None
    count: int | None = None
    strings: list[tuple[int, int]] = field(default_factory=list)  # string arrays: (length field offset, length)
    value: object = None


@dataclass
class TI:
    index: int
    name: str
    start: int  # name length field
    name_at: int
    ndims_at: int
    dims_at: list[int]
    type_at: int
    offset_at: int
    end: int
    ne: tuple[int, ...]
    type_code: int
    offset: int


@dataclass
class Layout:
    data: bytes
    version: int
    kvs: list[KV]
    tensors: list[TI]
    infos_end: int
    alignment: int
    data_offset: int

    def kv(self, suffix: str) -> KV:
        for kv in self.kvs:
            if kv.key == suffix or kv.key.endswith("." + suffix):
                return kv
        raise KeyError(suffix)

    def has(self, suffix: str) -> bool:
        try:
            self.kv(suffix)
            return True
        except KeyError:
            return False

    @property
    def arch(self) -> str:
        return self.kv("general.architecture").value

    def kv_blob(self, i: int) -> bytes:
        return self.data[self.kvs[i].start : self.kvs[i].end]

    def ti_blob(self, i: int) -> bytes:
        return self.data[self.tensors[i].start : self.tensors[i].end]

    @property
    def data_blob(self) -> bytes:
        return self.data[self.data_offset :]

    def tensor_end(self, i: int) -> int:
        """Absolute end of tensor i's bytes (F32/F16 fixtures only)."""
        t = self.tensors[i]
        size = {GGML_F32: 4, GGML_F16: 2}[t.type_code]
        return self.data_offset + t.offset + math.prod(t.ne) * size


def parse_layout(data: bytes) -> Layout:
    pos = 0

    def take(fmt):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    def take_str():
        nonlocal pos
        n = take("<Q")
        s = data[pos : pos + n].decode()
        pos += n
        return s

    assert data[:4] == b"GGUF"
    pos = 4
    version = take("<I")
    n_tensors = take("<Q")
    n_kv = take("<Q")
    kvs = []
    for i in range(n_kv):
        start = pos
        key = take_str()
        type_at = pos
        vtype = take("<I")
        kv = KV(i, key, start, start + 8, type_at, pos, 0, vtype)
        if vtype == STRING:
            kv.value = take_str()
        elif vtype == ARRAY:
            kv.item_type = take("<I")
            kv.count_at = pos
            kv.count = take("<Q")
            if kv.item_type == STRING:
                for _ in range(kv.count):
                    at = pos
                    n = take("<Q")
                    kv.strings.append((at, n))
                    pos += n
            else:
                pos += kv.count * struct.calcsize(_FMT[kv.item_type])
        else:
            kv.value = take(_FMT[vtype])
        kv.end = pos
        kvs.append(kv)
    alignment = next((kv.value for kv in kvs if kv.key == "general.alignment"), 32)
    tensors = []
    for i in range(n_tensors):
        start = pos
        name = take_str()
        ndims_at = pos
        n_dims = take("<I")
        dims_at = [pos + 8 * d for d in range(n_dims)]
        ne = tuple(take("<Q") for _ in range(n_dims))
        type_at = pos
        type_code = take("<I")
        offset_at = pos
        offset = take("<Q")
        tensors.append(TI(i, name, start, start + 8, ndims_at, dims_at, type_at, offset_at, pos, ne, type_code, offset))
    data_offset = (pos + alignment - 1) // alignment * alignment
    return Layout(data, version, kvs, tensors, pos, alignment, data_offset)


# --------------------------------------------------------------------------------------------------
# Encoding and editing


def enc_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def enc_scalar(vtype: int, value) -> bytes:
    return struct.pack(_FMT[vtype], value)


def enc_kv(key: str | bytes, vtype: int, value) -> bytes:
    """A metadata entry; `value` is a Python value, or for ARRAY a tuple (item_type, [values])."""
    out = enc_str(key) + struct.pack("<I", vtype)
    if vtype == STRING:
        return out + enc_str(value)
    if vtype == ARRAY:
        item_type, items = value
        out += struct.pack("<IQ", item_type, len(items))
        return out + b"".join(enc_str(v) if item_type == STRING else enc_scalar(item_type, v) for v in items)
    return out + enc_scalar(vtype, value)


def enc_ti(name: str | bytes, ne: tuple[int, ...], type_code: int, offset: int) -> bytes:
    return (
        enc_str(name)
        + struct.pack("<I", len(ne))
        + b"".join(struct.pack("<Q", d) for d in ne)
        + struct.pack("<IQ", type_code, offset)
    )


def assemble(
    L: Layout,
    kv_blobs: list[bytes] | None = None,
    ti_blobs: list[bytes] | None = None,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    pad_to: int | None = None,
    data_blob: bytes | None = None,
) -> bytes:
    """Header from pieces (defaults: the original ones), zero-padded to `pad_to`, then the tensor data."""
    kv_blobs = [L.kv_blob(i) for i in range(len(L.kvs))] if kv_blobs is None else kv_blobs
    ti_blobs = [L.ti_blob(i) for i in range(len(L.tensors))] if ti_blobs is None else ti_blobs
    head = b"GGUF" + struct.pack(
        "<IQQ", L.version, len(ti_blobs) if n_tensors is None else n_tensors, len(kv_blobs) if n_kv is None else n_kv
    )
    head += b"".join(kv_blobs) + b"".join(ti_blobs)
    align = pad_to or L.alignment
    head += b"\0" * (-len(head) % align)
    return head + (L.data_blob if data_blob is None else data_blob)


def put(data: bytes, at: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def put_bytes(data: bytes, at: int, raw: bytes) -> bytes:
    return data[:at] + raw + data[at + len(raw) :]


def replace_kv(L: Layout, suffix: str, vtype: int, value) -> bytes:
    kv = L.kv(suffix)
    blobs = [L.kv_blob(i) for i in range(len(L.kvs))]
    blobs[kv.index] = enc_kv(kv.key, vtype, value)
    return assemble(L, kv_blobs=blobs)


def add_kv(L: Layout, key: str, vtype: int, value, pad_to: int | None = None) -> bytes:
    blobs = [L.kv_blob(i) for i in range(len(L.kvs))] + [enc_kv(key, vtype, value)]
    return assemble(L, kv_blobs=blobs, pad_to=pad_to)


def remove_kv(L: Layout, suffix: str) -> bytes:
    kv = L.kv(suffix)
    return assemble(L, kv_blobs=[L.kv_blob(i) for i in range(len(L.kvs)) if i != kv.index])


def replace_ti(L: Layout, i: int, name=None, ne=None, type_code=None, offset=None) -> bytes:
    t = L.tensors[i]
    blobs = [L.ti_blob(j) for j in range(len(L.tensors))]
    blobs[i] = enc_ti(
        t.name if name is None else name,
        t.ne if ne is None else ne,
        t.type_code if type_code is None else type_code,
        t.offset if offset is None else offset,
    )
    return assemble(L, ti_blobs=blobs)


# --------------------------------------------------------------------------------------------------
# Mutation families


def header_variants(L: Layout) -> Iterator[Variant]:
    d = L.data
    for magic in (b"GGUG", b"\0\0\0\0", b"FUGG", b"gguf", b"GGML", b"\xff\xff\xff\xff"):
        yield Variant(f"magic={magic!r}", put_bytes(d, 0, magic), REJECT, "magic")
    for version in (0, 1, 4, 0xFFFF, 0x03000000, 0xFFFFFFFF):
        yield Variant(f"version={version:#x}", put(d, 4, "<I", version), REJECT, "version")
    yield Variant("version=2", put(d, 4, "<I", 2), OK)  # v2 and v3 share the little-endian layout


def count_variants(L: Layout) -> Iterator[Variant]:
    d, nt, nk = L.data, len(L.tensors), len(L.kvs)
    for n in (U64_MAX, 1 << 63, 1 << 40, 1 << 32, len(d) // 32 + 1):
        yield Variant(f"tensor_count={n:#x}", put(d, 8, "<Q", n), REJECT, "tensor")
    for n in (U64_MAX, 1 << 63, 1 << 40, 1 << 32, len(d) // 13 + 1):
        yield Variant(f"kv_count={n:#x}", put(d, 16, "<Q", n), REJECT, "kv_count")
    # The tensor infos become junk after a valid header: a valid file with no tensors, which no model is.
    yield Variant("tensor_count=0", put(d, 8, "<Q", 0), IR_REJECT)
    yield Variant("tensor_count-1", put(d, 8, "<Q", nt - 1))
    yield Variant("tensor_count+1", put(d, 8, "<Q", nt + 1))
    yield Variant("tensor_count+2", put(d, 8, "<Q", nt + 2))
    yield Variant("kv_count=0", put(d, 16, "<Q", 0))
    yield Variant("kv_count-1", put(d, 16, "<Q", nk - 1))
    yield Variant("kv_count+1", put(d, 16, "<Q", nk + 1))
    yield Variant("kv_count+2", put(d, 16, "<Q", nk + 2))


def truncation_variants(L: Layout) -> Iterator[Variant]:
    d = L.data
    last_end = max(L.tensor_end(i) for i in range(len(L.tensors)))
    cuts = {0, 1, 3, 4, 7, 8, 12, 16, 20, 23, 24, 25}
    for kv in L.kvs:
        cuts |= {kv.start, kv.start + 4, kv.key_at, kv.key_at + 1, kv.type_at, kv.value_at, kv.value_at + 1, kv.end - 1}
        if kv.count_at is not None:
            cuts |= {kv.count_at, kv.count_at + 8}
        for at, n in kv.strings[:2] + kv.strings[-2:]:
            cuts |= {at + 3, at + 8 + n // 2}
    for t in L.tensors:
        cuts |= {t.start, t.name_at + 1, t.ndims_at, t.dims_at[0] + 2, t.type_at, t.offset_at, t.offset_at + 7}
        a = L.data_offset + t.offset
        cuts |= {a, a + 1, (a + L.tensor_end(t.index)) // 2, L.tensor_end(t.index) - 1}
    cuts |= {L.infos_end, L.infos_end + 1, L.data_offset, last_end - 1}
    for n in sorted(c for c in cuts if 0 <= c < last_end):
        yield Variant(f"truncate@{n}", d[:n], REJECT)
    if last_end < len(d):
        yield Variant("truncate@last-tensor-end", d[:last_end], OK)  # only trailing padding lost


def kv_variants(L: Layout) -> Iterator[Variant]:
    d = L.data
    for kv in L.kvs:
        k = kv.key
        yield Variant(f"kv[{k}] key length=u64max", put(d, kv.start, "<Q", U64_MAX), REJECT, "key")
        yield Variant(f"kv[{k}] key length=0", put(d, kv.start, "<Q", 0), REJECT, "empty")
        yield Variant(f"kv[{k}] key length+1", put(d, kv.start, "<Q", len(k) + 1))
        yield Variant(f"kv[{k}] key length-1", put(d, kv.start, "<Q", len(k) - 1))
        yield Variant(f"kv[{k}] key byte 0xff", put_bytes(d, kv.key_at + len(k) // 2, b"\xff"), REJECT, "UTF-8")
        for code in (13, 0xFFFFFFFF):
            yield Variant(f"kv[{k}] value type {code}", put(d, kv.type_at, "<I", code), REJECT, "unknown value type")
        if kv.vtype == ARRAY:
            yield from _array_variants(L, kv)
        elif kv.vtype == STRING:
            n = len(kv.value.encode())
            yield Variant(f"kv[{k}] string length=u64max", put(d, kv.value_at, "<Q", U64_MAX), REJECT, k)
            yield Variant(
                f"kv[{k}] string length past EOF", put(d, kv.value_at, "<Q", len(d) - kv.value_at - 7), REJECT, k
            )
            yield Variant(f"kv[{k}] string length+1", put(d, kv.value_at, "<Q", n + 1))
            if n:
                yield Variant(f"kv[{k}] string length-1", put(d, kv.value_at, "<Q", n - 1))
                yield Variant(f"kv[{k}] string byte 0xff", put_bytes(d, kv.value_at + 8, b"\xff"), REJECT, "UTF-8")
                yield Variant(
                    f"kv[{k}] string lone continuation", put_bytes(d, kv.value_at + 8, b"\x80"), REJECT, "UTF-8"
                )
        else:
            other = U64 if kv.vtype != U64 else U8  # a scalar of another size: the rest of the header desyncs
            yield Variant(f"kv[{k}] scalar type {kv.vtype}->{other}", put(d, kv.type_at, "<I", other))
            yield Variant(f"kv[{k}] scalar type ->array", put(d, kv.type_at, "<I", ARRAY))
        # the same entry twice
        blobs = [L.kv_blob(i) for i in range(len(L.kvs))]
        yield Variant(f"kv[{k}] duplicated", assemble(L, kv_blobs=blobs + [blobs[kv.index]]), REJECT, "appears twice")
    flag = next(kv for kv in L.kvs if kv.vtype == BOOL)
    yield Variant("bool scalar = 2", put(d, flag.value_at, "<B", 2), REJECT, "bool")
    yield Variant("bool scalar = 0xff", put(d, flag.value_at, "<B", 0xFF), REJECT, "bool")
    yield Variant("bool scalar flipped", put(d, flag.value_at, "<B", 1 - flag.value), OK)
    yield Variant("bool array with a 2", add_kv(L, "alchemist.test.flags", ARRAY, (BOOL, [0, 1, 2, 1])), REJECT, "bool")
    yield Variant("valid bool array", add_kv(L, "alchemist.test.flags", ARRAY, (BOOL, [0, 1, 1])), OK)
    yield Variant("empty string array", add_kv(L, "alchemist.test.names", ARRAY, (STRING, [])), OK)
    yield Variant("empty u8 array", add_kv(L, "alchemist.test.bytes", ARRAY, (U8, [])), OK)
    yield Variant("unknown extra key", add_kv(L, "alchemist.test.note", STRING, "héllo ✓"), OK)
    yield Variant("non-ascii utf-8 key", add_kv(L, "alchemist.tést", U32, 1), OK)
    yield Variant("non-utf8 key (added)", add_kv(L, b"alchemist.t\xc3", U32, 1), REJECT, "UTF-8")
    yield Variant("overlong utf-8 value", add_kv(L, "alchemist.test.s", STRING, b"\xc0\xaf"), REJECT, "UTF-8")
    yield Variant("utf-8 surrogate value", add_kv(L, "alchemist.test.s", STRING, b"\xed\xa0\x80"), REJECT, "UTF-8")
    yield Variant("key longer than 64 KiB", add_kv(L, "k" * 70000, U32, 1), REJECT, "limit")
    yield Variant("general.name non-utf8", replace_kv(L, "general.name", STRING, b"tiny \xfe model"), REJECT, "UTF-8")
    yield Variant("general.name renamed", replace_kv(L, "general.name", STRING, "another name"), OK)


def _array_variants(L: Layout, kv: KV) -> Iterator[Variant]:
    d, k = L.data, kv.key
    item_at = kv.count_at - 4
    for n in (U64_MAX, 1 << 62, 1 << 40, 1 << 32, len(d)):
        yield Variant(f"kv[{k}] array length={n:#x}", put(d, kv.count_at, "<Q", n), REJECT, k)
    yield Variant(f"kv[{k}] array length=0", put(d, kv.count_at, "<Q", 0))
    yield Variant(f"kv[{k}] array length+1", put(d, kv.count_at, "<Q", kv.count + 1))
    yield Variant(f"kv[{k}] array length-1", put(d, kv.count_at, "<Q", kv.count - 1))
    for code, why in ((13, "unknown array item type"), (0xFFFFFFFF, "unknown array item type"), (ARRAY, "nested")):
        yield Variant(f"kv[{k}] array item type {code}", put(d, item_at, "<I", code), REJECT, why)
    other = U16 if kv.item_type != U16 else U64
    yield Variant(f"kv[{k}] array item type {kv.item_type}->{other}", put(d, item_at, "<I", other))
    if kv.item_type != STRING:
        return
    n_str = len(kv.strings)
    for j in sorted({0, 1, n_str // 2, n_str - 1}):
        at, n = kv.strings[j]
        yield Variant(f"kv[{k}][{j}] length=u64max", put(d, at, "<Q", U64_MAX), REJECT, k)
        yield Variant(f"kv[{k}][{j}] length past EOF", put(d, at, "<Q", len(d) - at - 7), REJECT, k)
        yield Variant(f"kv[{k}][{j}] length+1", put(d, at, "<Q", n + 1))
        if n:
            yield Variant(f"kv[{k}][{j}] byte 0xff", put_bytes(d, at + 8, b"\xff"), REJECT, f"{k}[{j}]")
            yield Variant(
                f"kv[{k}][{j}] starts with a continuation byte", put_bytes(d, at + 8, b"\xbf"), REJECT, f"{k}[{j}]"
            )
            yield Variant(
                f"kv[{k}][{j}] ends with a dangling lead byte",
                put_bytes(d, at + 8 + n - 1, b"\xe2"),
                REJECT,
                f"{k}[{j}]",
            )
    # A character split across two strings: the concatenation is valid UTF-8, neither string is.
    items = [d[at + 8 : at + 8 + n] for at, n in kv.strings]
    split = list(items)
    split[3], split[4] = items[3] + b"\xc4", b"\xa0" + items[4]
    blobs = [L.kv_blob(i) for i in range(len(L.kvs))]
    blobs[kv.index] = enc_kv(k, ARRAY, (STRING, split))
    yield Variant(f"kv[{k}] character split across strings", assemble(L, kv_blobs=blobs), REJECT, f"{k}[3]")
    ok = list(items)
    ok[3] = items[3] + "é✓".encode()
    blobs[kv.index] = enc_kv(k, ARRAY, (STRING, ok))
    yield Variant(f"kv[{k}] valid multibyte token", assemble(L, kv_blobs=blobs), OK)


def alignment_variants(L: Layout) -> Iterator[Variant]:
    key = "general.alignment"
    for value in (0, 3, 48, 0xFFFFFFFF):
        yield Variant(f"alignment={value}", add_kv(L, key, U32, value), REJECT, key)
    yield Variant("alignment=2^31 padded", add_kv(L, key, U32, 1 << 31), REJECT)
    for vtype, value in (
        (U64, 32),
        (I32, 32),
        (U16, 32),
        (F32, 32.0),
        (F64, 32.0),
        (STRING, "32"),
        (BOOL, 1),
        (ARRAY, (U32, [32])),
    ):
        yield Variant(f"alignment as type {vtype}", add_kv(L, key, vtype, value), REJECT, key)
    yield Variant("alignment=32 explicit", add_kv(L, key, U32, 32), OK)
    for value in (1, 8, 16, 64):
        yield Variant(f"alignment={value} repadded", add_kv(L, key, U32, value, pad_to=value))
    yield Variant("alignment=64 not repadded", add_kv(L, key, U32, 64, pad_to=32))
    yield Variant("alignment=4096 not repadded", add_kv(L, key, U32, 4096, pad_to=32), REJECT)


def hparam_variants(L: Layout) -> Iterator[Variant]:
    """Valid GGUF, impossible model: the reader returns the values, building the IR must refuse them."""
    a = L.arch

    def bad(suffix: str, vtype: int, value, mention: str | None = "", label: str = ""):
        mention = suffix if mention == "" else mention
        if L.has(suffix):
            data = replace_kv(L, suffix, vtype, value)
        else:
            data = add_kv(L, suffix if suffix.startswith("general.") else f"{a}.{suffix}", vtype, value)
        return Variant(f"{a}: {suffix}={label or value!r} ({vtype})", data, IR_REJECT, mention)

    eps = "attention.layer_norm_rms_epsilon"
    for v in (NAN, INF, -INF, 0.0, -1e-6):
        yield bad(eps, F32, v)
    yield bad(eps, F64, NAN)
    yield bad(eps, STRING, "1e-6")
    yield bad(eps, ARRAY, (F32, [1e-6]), label="[1e-6]")
    yield bad(eps, BOOL, 1)
    for v in (NAN, INF, 0.0, -10000.0):
        yield bad("rope.freq_base", F32, v)
    yield bad("rope.freq_base", STRING, "10000")
    n_layer = L.kv("block_count").value
    for vtype, v in (
        (U32, 0),
        (U32, 0xFFFFFFFF),
        (U64, U64_MAX),
        (I32, -1),
        (U32, 1000),
        (F32, 2.0),
        (STRING, "2"),
        (BOOL, 1),
    ):
        yield bad("block_count", vtype, v)
    yield bad("block_count", ARRAY, (U32, [2, 3]), label="[2, 3]")
    yield bad("block_count", ARRAY, (U32, []), label="[]")
    yield bad("block_count", ARRAY, (STRING, ["2"]), label="['2']")
    yield bad("block_count", U32, n_layer + 1, mention=f"blk.{n_layer}")
    yield bad("block_count", U32, n_layer - 1, mention=f"blk.{n_layer - 1}")
    for vtype, v in ((U32, 0), (F32, NAN), (STRING, "256")):
        yield bad("embedding_length", vtype, v)
    yield bad("embedding_length", U64, U64_MAX, mention="token_embd.weight")  # refused as a shape mismatch
    for v in (0, 3, 0xFFFFFFFF):
        yield bad("attention.head_count", U32, v, mention=None)
    for v in (0, 3):
        yield bad("attention.head_count_kv", U32, v)
    for v in (0, 15):
        yield bad("attention.key_length", U32, v, mention=None)
    yield bad("context_length", U32, 0)
    yield bad("context_length", STRING, "512")
    yield bad("feed_forward_length", U32, 0)
    yield bad("feed_forward_length", F32, 64.0)
    yield bad("rope.dimension_count", U32, 3)
    for v in (NAN, -1.0, INF):
        yield bad("rope.scaling.factor", F32, v)
    yield bad("rope.scaling.factor", F64, 1e-320, mention="rope.scaling.factor")
    yield bad("rope.scaling.type", STRING, "su")  # a scaling kind llama.cpp no longer knows
    yield bad("rope.scaling.type", U32, 1)
    # a key is only refused by the families that read it (llama.cpp ignores the others' copies):
    # of these four, only gemma3 reads final_logit_softcapping, and none reads attention.scale
    if a == "gemma3":
        yield bad("final_logit_softcapping", F32, NAN)
        yield bad("final_logit_softcapping", F32, -INF)
    yield bad("expert_count", U32, 8, mention="mixture-of-experts")
    yield bad("general.architecture", U32, 7)
    yield bad("general.architecture", STRING, "gpt5", mention="gpt5")
    yield bad("general.architecture", STRING, a + "\0", mention="not supported")
    yield Variant(
        f"{a}: general.architecture removed", remove_kv(L, "general.architecture"), IR_REJECT, "general.architecture"
    )
    yield Variant(f"{a}: rms eps as float64", replace_kv(L, eps, F64, 1e-6), OK)
    if a == "gemma3":
        yield bad("attention.sliding_window", F32, 8.0)
        yield bad("attention.sliding_window_pattern", ARRAY, (BOOL, [1]), label="[True]")
        yield bad("attention.sliding_window_pattern", STRING, "2")
        yield bad("rope.freq_base_swa", F32, NAN)
        yield bad("rope.freq_base_swa", F32, 0.0)
        yield Variant(
            f"{a}: sliding_window_pattern=u32max",
            replace_kv(L, "attention.sliding_window_pattern", U32, 0xFFFFFFFF),
            OK,
        )


def tensor_info_variants(L: Layout, full: set[int]) -> Iterator[Variant]:
    d = L.data
    n_t = len(L.tensors)
    for t in L.tensors:
        nm = t.name
        last = t.index == n_t - 1
        yield Variant(f"ti[{nm}] name length=u64max", put(d, t.start, "<Q", U64_MAX), REJECT, "name")
        yield Variant(f"ti[{nm}] name byte 0xff", put_bytes(d, t.name_at, b"\xff"), REJECT, "UTF-8")
        for n in (0, 5, 0xFFFFFFFF):
            yield Variant(f"ti[{nm}] n_dims={n}", put(d, t.ndims_at, "<I", n), REJECT, "n_dims")
        yield Variant(f"ti[{nm}] dim0=0", put(d, t.dims_at[0], "<Q", 0), REJECT, "zero-sized")
        yield Variant(f"ti[{nm}] dim0=-1", put(d, t.dims_at[0], "<Q", U64_MAX), REJECT, "elements")
        yield Variant(f"ti[{nm}] type=4 (removed Q4_2)", put(d, t.type_at, "<I", 4), REJECT, "ggml type")
        yield Variant(f"ti[{nm}] offset+1", put(d, t.offset_at, "<Q", t.offset + 1), REJECT, "aligned")
        yield Variant(f"ti[{nm}] offset+alignment", put(d, t.offset_at, "<Q", t.offset + L.alignment), REJECT, "offset")
        if t.index not in full:
            continue
        yield Variant(f"ti[{nm}] name length=0", put(d, t.start, "<Q", 0), REJECT, "empty")
        yield Variant(f"ti[{nm}] name length+1", put(d, t.start, "<Q", len(nm) + 1))
        yield Variant(f"ti[{nm}] name length-1", put(d, t.start, "<Q", len(nm) - 1))
        yield Variant(f"ti[{nm}] name 64 bytes", replace_ti(L, t.index, name="x" * 64), REJECT, "longer than")
        yield Variant(f"ti[{nm}] name 63 bytes", replace_ti(L, t.index, name="x" * 63), IR_REJECT, "missing")
        yield Variant(
            f"ti[{nm}] name non-utf8 tail", replace_ti(L, t.index, name=nm.encode() + b"\xc3"), REJECT, "UTF-8"
        )
        other = L.tensors[(t.index + 1) % n_t].name
        yield Variant(f"ti[{nm}] renamed to {other}", replace_ti(L, t.index, name=other), REJECT, "twice")
        yield Variant(f"ti[{nm}] n_dims+1 (desync)", put(d, t.ndims_at, "<I", len(t.ne) + 1))
        for code in UNKNOWN_GGML_TYPES:
            yield Variant(f"ti[{nm}] type={code:#x}", put(d, t.type_at, "<I", code), REJECT, "ggml type")
        for dims in (
            (1 << 32, 1 << 32),
            (1 << 33, 1 << 33),
            (1 << 40, 2),
            ((1 << 40) + 1,),
            (1 << 20,) * 4,
            (1 << 16, 1 << 16, 1 << 16),
        ):
            yield Variant(f"ti[{nm}] dims={dims}", replace_ti(L, t.index, ne=dims), REJECT, "elements")
        for dims in ((1 << 40,), (10**12,), (t.ne[0], 1 << 30)):
            yield Variant(
                f"ti[{nm}] dims={dims} (more bytes than the file)",
                replace_ti(L, t.index, ne=dims),
                REJECT,
                "cannot fit",
            )
        neg = ((1 << 64) - t.ne[0],) + t.ne[1:]
        yield Variant(f"ti[{nm}] dim0 negated", replace_ti(L, t.index, ne=neg), REJECT, "elements")
        yield Variant(f"ti[{nm}] five dims", replace_ti(L, t.index, ne=t.ne + (1,) * (5 - len(t.ne))), REJECT, "n_dims")
        yield Variant(
            f"ti[{nm}] four dims (trailing 1s)", replace_ti(L, t.index, ne=t.ne + (1,) * (4 - len(t.ne))), IR_REJECT, nm
        )
        doubled = (t.ne[0] * 2,) + t.ne[1:]
        yield Variant(f"ti[{nm}] dim0 doubled", replace_ti(L, t.index, ne=doubled), REJECT)
        plus = (t.ne[0] + 1,) + t.ne[1:]
        yield Variant(f"ti[{nm}] dim0+1", replace_ti(L, t.index, ne=plus), ANY if last else REJECT)
        smaller = GGML_F16 if t.type_code == GGML_F32 else GGML_F32
        yield Variant(
            f"ti[{nm}] type {t.type_code}->{smaller}",
            replace_ti(L, t.index, type_code=smaller),
            ANY if last else REJECT,
        )
        yield Variant(f"ti[{nm}] type->Q8_0", replace_ti(L, t.index, type_code=GGML_Q8_0), ANY if last else REJECT)
        yield Variant(
            f"ti[{nm}] type->Q4_K (row not a block multiple)",
            replace_ti(L, t.index, type_code=GGML_Q4_K),
            REJECT,
            "block size",
        )
        yield Variant(f"ti[{nm}] type->I8", replace_ti(L, t.index, type_code=GGML_I8), ANY if last else REJECT)
        for off, why in ((U64_MAX - 31, "huge"), (len(d) // 32 * 32, "past EOF"), (0, "zero")):
            if off != t.offset:
                yield Variant(f"ti[{nm}] offset={why}", put(d, t.offset_at, "<Q", off), REJECT, "offset")
        if t.index:
            prev = L.tensors[t.index - 1]
            yield Variant(f"ti[{nm}] overlaps {prev.name}", put(d, t.offset_at, "<Q", prev.offset), REJECT)
    # all offsets zero; two infos swapped (spec-valid, but not llama.cpp's back-to-back layout)
    zeros = d
    for t in L.tensors:
        zeros = put(zeros, t.offset_at, "<Q", 0)
    yield Variant("all tensor offsets 0", zeros, REJECT, "offset")
    blobs = [L.ti_blob(j) for j in range(n_t)]
    blobs[0], blobs[1] = blobs[1], blobs[0]
    yield Variant("tensor infos 0 and 1 swapped", assemble(L, ti_blobs=blobs), REJECT, "offset")
    dup = [L.ti_blob(j) for j in range(n_t)] + [L.ti_blob(0)]
    yield Variant("tensor info duplicated", assemble(L, ti_blobs=dup), REJECT, "twice")


def data_variants(L: Layout) -> Iterator[Variant]:
    d = L.data
    for frac in (0.0, 0.25, 0.5, 0.99):
        at = L.data_offset + int((len(d) - L.data_offset - 1) * frac)
        yield Variant(f"data byte flipped @{frac}", put_bytes(d, at, bytes([d[at] ^ 0xFF])), OK)
    yield Variant("data NaN-filled first tensor", put_bytes(d, L.data_offset, b"\xff" * 64), OK)
    yield Variant("trailing byte", d + b"\0", OK)
    yield Variant("trailing junk", d + b"GGUF" * 256, OK)
    yield Variant("header padding garbage", put_bytes(d, L.infos_end, b"\xff" * (L.data_offset - L.infos_end)), OK)


def garbage_variants(L: Layout) -> Iterator[Variant]:
    yield Variant("empty file", b"", REJECT, "too small")
    for n in (1, 4, 8, 23):
        yield Variant(f"{n}-byte prefix", L.data[:n], REJECT)
    hdr = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)
    yield Variant("bare header", hdr, IR_REJECT, "general.architecture")
    yield Variant("bare header + zeros", hdr + b"\0" * 4096, IR_REJECT, "general.architecture")
    yield Variant("header then 0xff", b"GGUF" + b"\xff" * 4096, REJECT)
    yield Variant("all zeros", b"\0" * 4096, REJECT, "magic")
    rng_bytes = bytes((i * 2654435761 >> 13) & 0xFF for i in range(4096))
    yield Variant("pseudo-random bytes", rng_bytes, REJECT, "magic")
    yield Variant("magic + pseudo-random", b"GGUF" + rng_bytes, REJECT)
    yield Variant("magic + v3 + pseudo-random", b"GGUF" + struct.pack("<I", 3) + rng_bytes, ANY)
    yield Variant("only the metadata", L.data[: L.tensors[0].start], REJECT)


def variants_for(L: Layout, full: bool) -> Iterator[Variant]:
    yield from hparam_variants(L)
    if not full:
        return
    yield from header_variants(L)
    yield from count_variants(L)
    yield from truncation_variants(L)
    yield from kv_variants(L)
    yield from alignment_variants(L)
    n = len(L.tensors)
    yield from tensor_info_variants(L, full={0, 1, n // 2, n - 1})
    yield from data_variants(L)
    yield from garbage_variants(L)


SMALL = dict(n_vocab=272, n_embd=32, n_head=2, n_kv_head=1, head_dim=16, n_ff=64)


def write_small_fixture(path: str | Path, arch: str) -> Path:
    """A valid fixture small enough (100-150 KB) to copy hundreds of times."""
    return write_fixture(path, arch, config=FixtureConfig(arch=arch, **SMALL))


def generate_corpus(
    workdir: str | Path, primary: str = "qwen2", others=("llama", "qwen3", "gemma3")
) -> tuple[dict[str, bytes], list[Variant]]:
    """Write the base fixtures under `workdir`; return them and every variant (all families get the
    hyperparameter variants, the primary family gets the structural ones too). Names are unique."""
    workdir = Path(workdir)
    bases: dict[str, bytes] = {}
    variants: list[Variant] = []
    for arch in (primary, *others):
        bases[arch] = write_small_fixture(workdir / f"{arch}.gguf", arch).read_bytes()
        L = parse_layout(bases[arch])
        variants.extend(variants_for(L, full=arch == primary))
    seen: dict[str, int] = {}
    unique = []
    for v in variants:
        n = seen.get(v.name, 0)
        seen[v.name] = n + 1
        unique.append(v if not n else Variant(f"{v.name} #{n + 1}", v.data, v.expect, v.mention))
    return bases, unique
