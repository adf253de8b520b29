"""The GGUF reader against hostile input: a corpus of precise mutations plus random byte mutations.

Every variant goes through `read_gguf` and then `build_model_ir`, under a time bound and a memory bound,
and must end in a clean AlchemistError or a successful read that agrees with an independent reader
(gguf-py's `GGUFReader`). Nothing else is allowed: no other exception type, no hang, no allocation sized
by a claimed length.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import resource
import shutil
import signal
import tempfile
import time
import tracemalloc
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from alchemist.arch import build_model_ir
from alchemist.errors import AlchemistError, GGUFError
from alchemist.gguf_io import StringArray, read_gguf
from alchemist.gguf_io.reader import MAX_ELEMENTS

try:
    from tests import malformed
except ImportError:  # tests/ is not a package: pytest puts the tests folder itself on sys.path
    import malformed
ANY, IR_REJECT, OK, REJECT = malformed.ANY, malformed.IR_REJECT, malformed.OK, malformed.REJECT
Variant, generate_corpus, parse_layout = malformed.Variant, malformed.generate_corpus, malformed.parse_layout

TIME_LIMIT_S = 2.0  # per variant, measured
HARD_TIMEOUT_S = 10.0  # per variant, enforced with SIGALRM so a hang fails instead of blocking the run
PEAK_ALLOC_LIMIT = 16 << 20  # traced Python/numpy allocations during one variant (the files are ~150 KB)
RSS_GROWTH_LIMIT = 64 << 20
ADDRESS_SPACE_HEADROOM = 1 << 30  # while the corpus runs, any allocation beyond this fails with MemoryError


class VariantTimeout(BaseException):
    pass


@contextlib.contextmanager
def address_space_cap(headroom: int = ADDRESS_SPACE_HEADROOM):
    """Lower RLIMIT_AS to the current address-space size plus `headroom`, so an allocation sized by a
    claimed length (gigabytes) raises MemoryError, which run_one reports as a crash, instead of
    swapping the machine to death. Restored on exit; a no-op where the limit cannot be read or set."""
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * resource.getpagesize()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = current + headroom
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@dataclass
class Outcome:
    kind: str  # "read_error", "ir_error", "ok", "crash"
    message: str
    elapsed: float
    peak: int
    facts: object = None
    ir: object = None


def _alarm(signum, frame):
    raise VariantTimeout()


def run_one(path: Path) -> Outcome:
    """read_gguf then build_model_ir, timed and with traced allocations; never raises (but for ^C)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, HARD_TIMEOUT_S)
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    facts = ir = None
    try:
        try:
            facts = read_gguf(path)
            # touch everything lazy, so deferred failures count as part of the read
            for v in facts.metadata.values():
                if isinstance(v, StringArray):
                    v.to_list()
        except AlchemistError as e:
            return Outcome("read_error", str(e), time.perf_counter() - t0, _peak(base))
        try:
            ir = build_model_ir(facts)
        except AlchemistError as e:
            return Outcome("ir_error", str(e), time.perf_counter() - t0, _peak(base), facts)
        return Outcome("ok", "", time.perf_counter() - t0, _peak(base), facts, ir)
    except VariantTimeout:
        return Outcome("crash", f"no result after {HARD_TIMEOUT_S} s", time.perf_counter() - t0, _peak(base))
    except Exception:
        return Outcome("crash", traceback.format_exc(), time.perf_counter() - t0, _peak(base))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _peak(base: int) -> int:
    return tracemalloc.get_traced_memory()[1] - base


# --------------------------------------------------------------------------------------------------
# The independent oracle for reads that succeed


def _same(ours, theirs) -> bool:
    if isinstance(ours, StringArray):
        return ours.to_list() == theirs
    if isinstance(ours, np.ndarray):
        theirs = np.asarray(theirs, dtype=ours.dtype)
        return ours.shape == theirs.shape and np.array_equal(ours, theirs, equal_nan=ours.dtype.kind == "f")
    if isinstance(ours, float):
        return (math.isnan(ours) and math.isnan(theirs)) or ours == theirs
    return type(ours) is type(theirs) and ours == theirs or (isinstance(ours, int) and ours == theirs)


def check_against_oracle(path: Path, facts) -> None:
    """Everything read_gguf returned agrees with gguf-py's GGUFReader on the same bytes."""
    r = GGUFReader(str(path))
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(facts.metadata), "metadata keys differ"
    for k, f in fields.items():
        assert _same(facts.metadata[k], f.contents()), f"metadata {k!r}: {facts.metadata[k]!r} vs oracle"
    assert [t.name for t in r.tensors] == list(facts.tensors), "tensor names differ"
    for t in r.tensors:
        info = facts.tensors[t.name]
        assert info.ggml_type == t.tensor_type.name
        assert info.ne == tuple(int(x) for x in t.shape)
        assert facts.data_offset + info.offset == t.data_offset
        assert info.nbytes == t.n_bytes
        ours = facts.tensor_bytes(t.name)
        assert ours.nbytes == info.nbytes
        assert np.array_equal(ours, np.asarray(t.data).reshape(-1).view(np.uint8))


def check_ir(facts, ir) -> None:
    assert math.isfinite(ir.norm_eps) and ir.norm_eps > 0
    data_size = facts.file_size - facts.data_offset
    for b in ir.tensors:
        assert 0 <= b.offset and b.offset + b.nbytes <= data_size
    for layer in ir.layers:
        assert math.isfinite(layer.attention.rope.base) and layer.attention.rope.base > 0
        assert math.isfinite(layer.attention.rope.freq_scale) and layer.attention.rope.freq_scale > 0
        assert math.isfinite(layer.attention.rope.attn_factor) and layer.attention.rope.attn_factor > 0
        assert math.isfinite(layer.attention.score_scale)


def judge(v: Variant, path: Path, out: Outcome) -> list[str]:
    """Problems with one outcome (empty if the reader behaved)."""
    problems = []
    if out.kind == "crash":
        return [f"crashed:\n{out.message}"]
    if out.elapsed > TIME_LIMIT_S:
        problems.append(f"took {out.elapsed:.2f} s")
    if out.peak > PEAK_ALLOC_LIMIT:
        problems.append(f"allocated {out.peak / 2**20:.1f} MiB")
    if v.expect == REJECT and out.kind != "read_error":
        problems.append(f"read_gguf should have raised GGUFError, got {out.kind} {out.message}")
    if v.expect == IR_REJECT and out.kind != "ir_error":
        problems.append(f"read_gguf should succeed and build_model_ir fail, got {out.kind} {out.message}")
    if v.expect == OK and out.kind != "ok":
        problems.append(f"harmless mutation was refused: {out.message}")
    if v.mention and out.kind in ("read_error", "ir_error") and v.mention not in out.message:
        problems.append(f"error should mention {v.mention!r}: {out.message}")
    if out.facts is not None:
        try:
            check_against_oracle(path, out.facts)
        except Exception as e:  # noqa: BLE001 - any disagreement (or oracle failure) is a finding
            problems.append(f"read disagrees with GGUFReader: {type(e).__name__}: {e}")
    if out.ir is not None:
        try:
            check_ir(out.facts, out.ir)
        except AssertionError as e:
            problems.append(f"implausible IR: {e}")
    return problems


# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("malformed")
    bases, variants = generate_corpus(d)
    return d, bases, variants


def test_corpus_is_large_and_bases_are_valid(corpus):
    d, bases, variants = corpus
    assert len(variants) >= 200
    assert len({v.name for v in variants}) == len(variants)
    for arch in bases:
        facts = read_gguf(d / f"{arch}.gguf")
        build_model_ir(facts)
        check_against_oracle(d / f"{arch}.gguf", facts)


def test_malformed_corpus(corpus, capsys):
    d, _, variants = corpus
    tracemalloc.start()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    counts = {"read_error": 0, "ir_error": 0, "ok": 0, "crash": 0}
    failures = []
    try:
        for i, v in enumerate(variants):
            path = d / f"v{i:04d}.gguf"
            path.write_bytes(v.data)
            with address_space_cap():
                out = run_one(path)
            counts[out.kind] += 1
            problems = judge(v, path, out)
            if problems:
                failures.append(f"[{v.name}] ({v.expect}) " + "; ".join(problems))
            del out
            path.unlink()
    finally:
        tracemalloc.stop()
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    with capsys.disabled():
        print(
            f"\nmalformed GGUF corpus: {len(variants)} variants tried, "
            f"{counts['read_error'] + counts['ir_error']} clean errors "
            f"({counts['read_error']} from read_gguf, {counts['ir_error']} from build_model_ir), "
            f"{counts['ok']} harmless reads, {counts['crash']} crashes; peak RSS grew {rss_growth / 2**20:.1f} MiB"
        )
    assert not failures, f"{len(failures)} variants misbehaved:\n" + "\n".join(failures[:40])
    assert counts["crash"] == 0
    assert rss_growth < RSS_GROWTH_LIMIT


# --------------------------------------------------------------------------------------------------
# Random byte mutations (mostly in the header, where the parser's decisions are)

_TMP = Path(tempfile.mkdtemp(prefix="alchemist-hyp-"))
atexit.register(shutil.rmtree, _TMP, True)
_BASE: dict[str, object] = {}


def _base() -> tuple[bytes, int]:
    """The qwen2 fixture and the offset where its data section starts (end of the header region)."""
    if not _BASE:
        data = malformed.write_small_fixture(_TMP / "base.gguf", "qwen2").read_bytes()
        _BASE.update(data=data, header_end=parse_layout(data).data_offset)
    return _BASE["data"], _BASE["header_end"]


_mutation = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete", "set_u64", "set_u32"]),
    st.sampled_from(["header"] * 4 + ["anywhere"]),  # 4 in 5 land in the header
    st.floats(0, 1),
    st.integers(0, 255),
    st.sampled_from([0, 1, 2, 3, 0xFF, 0x7F, 0x80, 0xFFFFFFFF, (1 << 64) - 1, 1 << 32, 1 << 40, 32, 31]),
)


def _apply(data: bytes, header_end: int, mutations) -> bytes:
    b = bytearray(data)
    for op, region, frac, byte, big in mutations:
        if not b:
            break
        limit = min(header_end, len(b)) if region == "header" else len(b)
        at = min(int(frac * limit), len(b) - 1)
        if op == "flip":
            b[at] ^= 1 << (byte % 8)
        elif op == "set":
            b[at] = byte
        elif op == "insert":
            b[at:at] = bytes([byte]) * (1 + byte % 8)
        elif op == "delete":
            del b[at : at + 1 + byte % 8]
        elif op == "set_u64":
            b[at : at + 8] = (big % (1 << 64)).to_bytes(8, "little")
        else:
            b[at : at + 4] = (big % (1 << 32)).to_bytes(4, "little")
    return bytes(b)


_counter = [0]


@settings(
    max_examples=300,
    deadline=5000,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(_mutation, min_size=1, max_size=4))
def test_random_mutations(mutations):
    data, header_end = _base()
    mutated = _apply(data, header_end, mutations)
    _counter[0] += 1
    path = _TMP / f"m{_counter[0]}.gguf"
    path.write_bytes(mutated)
    tracemalloc.start()
    try:
        with address_space_cap():
            out = run_one(path)
    finally:
        tracemalloc.stop()
    event(out.kind)
    problems = judge(Variant("random", mutated, ANY), path, out)
    path.unlink()
    assert not problems, problems


# --------------------------------------------------------------------------------------------------
# The resource cap and a few direct checks


def test_element_cap_is_per_call(corpus):
    d, bases, _ = corpus
    p = d / "qwen2.gguf"
    facts = read_gguf(p)
    biggest = max(t.n_elements for t in facts.tensors.values())
    with pytest.raises(GGUFError, match="limit"):
        read_gguf(p, max_elements=biggest - 1)
    assert read_gguf(p, max_elements=biggest).tensors.keys() == facts.tensors.keys()
    assert MAX_ELEMENTS == 1 << 40


def test_trillion_element_tensor_refused_before_allocation(corpus, tmp_path):
    d, bases, _ = corpus
    L = parse_layout(bases["qwen2"])
    p = tmp_path / "t.gguf"
    p.write_bytes(malformed.replace_ti(L, 0, ne=(10**6, 10**6)))
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError, match="cannot fit"):
            read_gguf(p)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()
    with pytest.raises(GGUFError, match="limit"):
        read_gguf(p, max_elements=10**11)


def test_not_a_regular_file(tmp_path):
    import os

    with pytest.raises(GGUFError, match="regular file"):
        read_gguf(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(GGUFError, match="regular file"):
        read_gguf(fifo)  # would block in open() if it were opened
    with pytest.raises(GGUFError, match="cannot open"):
        read_gguf(tmp_path / "missing.gguf")


def test_gemma3_62_layers_with_more_heads_than_width(tmp_path):
    from alchemist.fixtures import FixtureConfig, write_fixture

    base = write_fixture(
        tmp_path / "g.gguf", "gemma3", config=FixtureConfig(arch="gemma3", n_layer=62, **malformed.SMALL)
    )
    L = parse_layout(base.read_bytes())
    p = tmp_path / "heads.gguf"
    p.write_bytes(malformed.replace_kv(L, "attention.head_count", malformed.U32, 64))
    with pytest.raises(AlchemistError):
        build_model_ir(read_gguf(p))


def test_string_arrays_decode_in_batches_exactly_as_one_by_one(monkeypatch):
    """StringArray's batched decode (one decode call per batch) gives what decoding each string gives, for
    empty, multibyte, NUL and replacement-character strings, batches of every size and non-adjacent
    strings; a string that is not UTF-8 is still named in the error."""
    from alchemist.gguf_io import reader

    strings = ["", "a", "", "", "héllo", "\x00", "日本語", "\ufffd", "🙂 x", "", "last"]
    raw = [s.encode() for s in strings]
    buf = bytearray(b"??")  # the strings sit at irregular offsets, with junk between them
    starts = []
    for i, b in enumerate(raw):
        buf += b"\xff" * (i % 3)
        starts.append(len(buf))
        buf += b
    starts_np, lengths_np = np.array(starts, np.int64), np.array([len(b) for b in raw], np.int64)
    for batch in (1, 2, 3, len(strings), 1000):
        monkeypatch.setattr(reader, "_DECODE_BATCH", batch)
        assert StringArray("f.gguf", "k", memoryview(bytes(buf)), starts_np, lengths_np).to_list() == strings
    monkeypatch.setattr(reader, "_DECODE_BATCH_BYTES", 3)  # batches over the byte budget: one by one
    assert StringArray("f.gguf", "k", memoryview(bytes(buf)), starts_np, lengths_np).to_list() == strings
    monkeypatch.setattr(reader, "_DECODE_BATCH_BYTES", 1 << 20)
    assert reader._decode_joined(bytes(buf), starts_np[:0], lengths_np[:0]) == []
    for bad in (b"\xff", b"\xc3", b"ok\xed\xb3\xbf"):  # 0xFF, a cut character, an encoded surrogate
        data = bytes(buf) + bad
        starts_bad, lengths_bad = np.append(starts_np, len(buf)), np.append(lengths_np, len(bad))
        arr = StringArray("f.gguf", "k", memoryview(data), starts_bad, lengths_bad)
        with pytest.raises(GGUFError, match=rf"k\[{len(strings)}\].*not valid UTF-8"):
            arr.to_list()


def test_string_array_offsets_are_remembered_only_for_the_same_bytes(tmp_path, monkeypatch):
    """A long string array's offsets are remembered on disk and read back instead of walking its length
    prefixes, but only while the bytes they span are the same: a changed string (here made invalid UTF-8,
    under the same lookup key) is parsed and checked afresh, and a damaged memo is ignored and rewritten."""
    from alchemist.fixtures import write_fixture
    from alchemist.gguf_io import reader

    monkeypatch.setenv("ALCHEMIST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(reader, "ENDS_MEMO_MIN_COUNT", 1)
    monkeypatch.setattr(reader, "ENDS_MEMO_KEY_BYTES", 16)  # so that a change further on keeps the key
    path = write_fixture(tmp_path / "qwen2.gguf", "qwen2")
    tokens = read_gguf(path).metadata["tokenizer.ggml.tokens"].to_list()
    memos = sorted((tmp_path / "cache" / "gguf").glob("*.ends"))
    assert len(memos) == 2  # the tokens and the merges

    def no_walk(*args):
        raise AssertionError("walked the length prefixes instead of reading the memo")

    with monkeypatch.context() as m:
        m.setattr(reader, "_string_ends", no_walk)
        assert read_gguf(path).metadata["tokenizer.ggml.tokens"].to_list() == tokens

    data = bytearray(path.read_bytes())
    last = tokens[-1].encode()
    at = data.index(last, data.index(b"tokenizer.ggml.tokens"))
    while data.find(last, at + 1) != -1 and data.find(last, at + 1) < data.index(b"tokenizer.ggml.merges"):
        at = data.find(last, at + 1)
    data[at] = 0xFF
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=rf"tokenizer\.ggml\.tokens\[{len(tokens) - 1}\].*not valid UTF-8"):
        read_gguf(bad)

    for memo in memos:
        memo.write_bytes(memo.read_bytes()[:-8])
    assert read_gguf(path).metadata["tokenizer.ggml.tokens"].to_list() == tokens
    with monkeypatch.context() as m:  # rewritten whole by that read
        m.setattr(reader, "_string_ends", no_walk)
        assert read_gguf(path).metadata["tokenizer.ggml.tokens"].to_list() == tokens
