"""Serving, engine side: one model used from several threads, and the SlotEngine's batched steps.

Tiny fixtures only; the compiled functions are shared through session-scoped fixtures (a compile takes
10-20 s even for a tiny model)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from alchemist import inference, load_llm
from slot_runs import run_in_slots  # noqa: E402

PROMPTS = [[2, 7, 11, 5, 3], [9, 4], [13, 6, 8, 1, 1, 2, 40], [100, 3, 17], [5, 5, 5, 5]]


@pytest.fixture(scope="session")
def llama_model(tiny_gguf, tiny_dir):
    return load_llm(tiny_gguf("llama"), backend="c", context=64, generated_dir=tiny_dir / "serving", progress=False)


def test_concurrent_inference_equals_sequential(llama_model):
    """Five threads generating on one model give what five calls in a row give (the KV cache is one
    buffer: without the engine lock their steps interleave and overwrite each other's positions)."""
    sequential = [inference(llama_model, p, max_tokens=8).output_token_ids for p in PROMPTS]
    assert len({tuple(s) for s in sequential}) > 1  # the prompts lead to different answers
    results: list = [None] * len(PROMPTS)
    errors: list = []
    start = threading.Barrier(len(PROMPTS))

    def work(i):
        try:
            start.wait()
            results[i] = inference(llama_model, PROMPTS[i], max_tokens=8).output_token_ids
        except Exception as exc:  # reported by the assert below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == sequential


# -- SlotEngine ------------------------------------------------------------------------------------------
# Tiny shapes keep the compiles few: 3 slots, chunk 4, decode buckets (2, 4), so a step is one of
# decode (2, 1), decode (4, 1) or prefill (1, 4). The gemma3 fixture has a sliding window of 8 on layer 0
# (ring of 8 + 4 rows), so sequences of 13-27 tokens wrap it.
CAPACITY = 32
SLOT_CASES = [
    ("gemma3", "Q8_0", "c"),
    ("gemma3", "Q8_0", "numba"),
    ("qwen2", "F32", "c"),
    ("qwen2", "F32", "numba"),
    # the temperature factor by position; dense and expert layers beside convolutions
    ("mistral3", "F32", "c"),
    ("lfm2moe", "F32", "c"),
    # RoPE-less and chunked layers, one expert weighting its input, a shared expert
    ("llama4", "F32", "c"),
    # latent attention: one cached row per position for every head; group-limited routing
    ("deepseek2", "F32", "c"),
    # caches of two row shapes (sliding and global heads), two of them shared by later layers; per-layer inputs
    ("gemma4", "F32", "c"),
    # experts beside the dense MLP, each branch with its own norms; a router reading its own scaled input
    ("gemma4:moe", "F32", "c"),
]


@pytest.fixture(scope="session")
def slot_module(tiny_gguf, tmp_path_factory):
    """slot_module(arch, weight_type) -> (generated module, gguf path); Q8_0 puts the kernel Ops in the graph."""
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import import_generated

    root = tmp_path_factory.mktemp("slots")
    cache = {}

    def get(arch, weight_type):
        if (arch, weight_type) not in cache:
            path = tiny_gguf(arch)
            if weight_type != "F32":
                pytest.importorskip("llama_cpp")
                from alchemist.harness import quantize_fixture

                path = root / f"{arch}-{weight_type}.gguf"
                quantize_fixture(tiny_gguf(arch), path, weight_type, nthread=1)
            module = import_generated(write_generated(build_model_ir(read_gguf(path)), root / arch))
            cache[arch, weight_type] = (module, path)
        return cache[arch, weight_type]

    return get


@pytest.fixture(scope="session")
def slot_engines(slot_module):
    """slot_engines(arch, weight_type, backend[, numerics]) -> a warmed-up SlotEngine (3 slots, chunk 4, buckets
    (2, 4))."""
    from alchemist.runtime.engine import Engine
    from alchemist.runtime.slot_engine import SlotEngine

    cache = {}

    def get(arch, weight_type, backend, numerics="exact"):
        key = (arch, weight_type, backend, numerics)
        if key not in cache:
            module, path = slot_module(arch, weight_type)
            engine = Engine(module, module.load_weights(str(path), quantized=True), backend, CAPACITY, numerics)
            slots = SlotEngine(engine, 3, chunk=4, decode_buckets=(2, 4))
            slots.warm_up()
            # stale values everywhere: a step must never read a row its sequence has not written
            rng = np.random.default_rng(1)
            for pair in slots.cache:
                for sv in pair:
                    data = sv.get_value(borrow=True)
                    data[...] = rng.standard_normal(data.shape).astype(np.float32)
            cache[key] = slots
        return cache[key]

    return get


@pytest.fixture(scope="session")
def reference_logits(slot_module):
    """reference_logits(arch, weight_type, ids[, numerics]) -> the single-sequence Engine's logits of every
    position (C)."""
    from alchemist.runtime.engine import Engine

    engines = {}

    def get(arch, weight_type, ids, numerics="exact"):
        key = (arch, weight_type, numerics)
        if key not in engines:
            module, path = slot_module(arch, weight_type)
            weights = module.load_weights(str(path), quantized=True)
            engines[key] = Engine(module, weights, "c", CAPACITY, numerics)
        engine = engines[key]
        engine.reset()
        return engine.run(ids, 0, all_logits=True)

    return get


def _sequences(n_vocab, lengths=(20, 13, 27), seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, n_vocab, n)] for n in lengths]


@pytest.mark.parametrize("arch,weight_type,backend", SLOT_CASES)
def test_batched_logits_equal_unbatched(slot_engines, reference_logits, arch, weight_type, backend):
    """Three sequences in three slots: chunked prefills of different lengths (a partial last chunk), then
    decode steps of 3, 2 and 1 rows (padded to buckets 4 and 2) at different positions of each sequence. Every
    row's logits equal the single-sequence engine's for that sequence; on gemma3 the sliding-window ring wraps."""
    se = slot_engines(arch, weight_type, backend)
    seqs = _sequences(se.n_vocab)
    prefilled = [6, 9, 5]
    got, sizes = run_in_slots(se, seqs, prefilled)
    assert all(v.shape == (se.n_vocab,) and v.dtype == np.float32 for rows in got.values() for v in rows.values())
    assert sizes == {1, 2, 3}
    if arch == "gemma3":
        assert min(se.rows) < max(len(s) for s in seqs) - 4  # the ring wrapped (more than once)
    for i, seq in enumerate(seqs):
        want = reference_logits(arch, weight_type, seq)
        rows = sorted(got[i])
        assert rows == [b - 1 for _, b in se.chunk_plan(prefilled[i])] + list(range(prefilled[i], len(seq)))
        ours = np.stack([got[i][r] for r in rows])
        np.testing.assert_allclose(ours, want[rows], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(ours.argmax(1), want[rows].argmax(1))


def test_ggml_attention_reads_each_slots_rows_in_place(slot_engines, reference_logits):
    """ggml numerics on C: every layer's attention is SlotAttentionGgml over the whole slot caches (no gathered
    copy of any sequence's rows), and the batched steps (the sliding-window ring wrapping) give the single-sequence
    ggml engine's logits."""
    from pytensor.tensor.subtensor import AdvancedSubtensor

    from alchemist.kernels.attention import SlotAttentionGgml

    se = slot_engines("gemma3", "Q8_0", "c", "ggml")
    seqs = _sequences(se.n_vocab)
    got, _ = run_in_slots(se, seqs, [6, 9, 5])
    for shape in se.stats.compiled_shapes:
        nodes = _fgraph_nodes(se.step_function(*shape))
        assert not [node for node in nodes if isinstance(node.op, AdvancedSubtensor) and node.inputs[0].ndim == 4]
        assert sum(isinstance(node.op, SlotAttentionGgml) for node in nodes) == se.module.N_LAYER, shape
    for i, seq in enumerate(seqs):
        want = reference_logits("gemma3", "Q8_0", seq, "ggml")
        rows = sorted(got[i])
        ours = np.stack([got[i][r] for r in rows])
        np.testing.assert_allclose(ours, want[rows], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(ours.argmax(1), want[rows].argmax(1))


def test_a_prompt_in_pieces_gives_what_it_gives_in_chunks(slot_engines):
    """Prefilled in pieces (half chunks: the scheduler's steps beside decoding streams) or in whole chunks, a
    sequence ends with the same logits and continues the same, also when only the last step computes logits (the
    others give None and skip the output projection); a piece starts at a multiple of the piece and never runs
    past its chunk (its padding included); a piece must divide the chunk."""
    from alchemist.errors import AlchemistError
    from alchemist.runtime.slot_engine import SlotEngine

    engine = slot_engines("gemma3", "Q8_0", "c").engine
    se = SlotEngine(engine, 2, chunk=8, decode_buckets=(2,), piece=4)
    assert se.prefill_sizes == (4, 8) and se.chunk_plan(13, pieces=True) == [(0, 4), (4, 8), (8, 12), (12, 13)]
    assert se.chunk_plan(20, 4) == [(4, 8), (8, 16), (16, 20)]  # begun in pieces: on to the chunk's end in pieces
    seq = _sequences(se.n_vocab, lengths=(13,))[0]
    pieces = [se.prefill(0, seq[a:b], a) for a, b in se.chunk_plan(len(seq), pieces=True)][-1]
    chunks = [se.prefill(1, seq[a:b], a, logits=b == len(seq)) for a, b in se.chunk_plan(len(seq))]
    assert chunks[0] is None and chunks[-1].shape == (se.n_vocab,)
    np.testing.assert_allclose(pieces, chunks[-1], rtol=1e-5, atol=1e-5)
    both = se.decode([0, 1], [5, 5], [13, 13])
    np.testing.assert_allclose(both[0], both[1], rtol=1e-5, atol=1e-5)
    ones = SlotEngine(engine, 2, chunk=8, decode_buckets=(2,), piece=1)  # a one-token step is the one-row decode's
    assert ones.prefill(0, seq[:1], 0, logits=False) is None and ones.prefill(0, seq[1:2], 1).shape == (se.n_vocab,)
    with pytest.raises(AlchemistError, match="multiple of the prefill piece"):
        se.prefill(0, seq[:2], 2)
    with pytest.raises(AlchemistError, match="ends within its chunk"):
        se.prefill(0, seq[:6], 4)
    with pytest.raises(AlchemistError, match="must divide the chunk"):
        SlotEngine(engine, 2, chunk=8, piece=3)


def test_a_prefill_of_every_row_gives_every_positions_logits(slot_engines, reference_logits):
    """all_rows (a scored prompt): each chunk's prefill gives the logits of every real token, those of the
    single-sequence engine at every position, and the last one is what the last-row prefill gives."""
    se = slot_engines("qwen2", "F32", "c")
    seq = _sequences(se.n_vocab, (11,), seed=5)[0]  # chunks of 4, 4 and 3
    rows = [se.prefill(0, seq[a:b], a, all_rows=True) for a, b in se.chunk_plan(len(seq))]
    assert [r.shape for r in rows] == [(4, se.n_vocab), (4, se.n_vocab), (3, se.n_vocab)]
    ours, want = np.concatenate(rows), reference_logits("qwen2", "F32", seq)
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(ours.argmax(1), want.argmax(1))
    last = [se.prefill(1, seq[a:b], a) for a, b in se.chunk_plan(len(seq))][-1]
    np.testing.assert_allclose(last, rows[-1][-1], rtol=1e-5, atol=1e-5)
    assert (1, 4, "all rows") in se.stats.compiled_shapes


def _snapshot(se):
    return [sv.get_value().copy() for pair in se.cache for sv in pair]  # (slots + 1, rows, kv, dim) each


def test_padded_rows_do_not_touch_other_slots(slot_engines):
    se = slot_engines("gemma3", "Q8_0", "c")
    before = _snapshot(se)
    se.decode([1], [5], [13])  # bucket 2: one padding row, in the pad slot
    se.prefill(2, [7, 8, 9], 4)  # padded to a chunk of 4: positions 4..7 of slot 2
    after = _snapshot(se)
    written = {1: {13}, 2: {4, 5, 6, 7}}
    for old, new in zip(before, after):
        rows = old.shape[1]
        for slot in range(se.n_slots):
            touched = {r for r in range(rows) if not np.array_equal(old[slot, r], new[slot, r])}
            assert touched == {p % rows for p in written.get(slot, ())}, (slot, touched)


def test_copy_prefix_then_continue_equals_cold_prefill(slot_engines):
    se = slot_engines("gemma3", "Q8_0", "c")
    old, fresh = _sequences(se.n_vocab, (10, 6), seed=3)
    new = old[:9] + fresh  # 15 tokens sharing 9 with what slot 0 will hold
    for a, b in se.chunk_plan(len(old)):
        se.prefill(0, old[a:b], a)
    n = se.reusable_prefix(cached_len=len(old), lcp=9, prompt_len=len(new))
    assert n == 8  # whole chunks only
    se.copy_prefix(0, 1, n)
    warm = [se.prefill(1, new[a:b], a) for a, b in se.chunk_plan(len(new), n)]
    cold = [se.prefill(2, new[a:b], a) for a, b in se.chunk_plan(len(new))]
    np.testing.assert_array_equal(warm[-1], cold[-1])
    both = se.decode([1, 2], [11, 11], [len(new), len(new)])
    np.testing.assert_array_equal(both[0], both[1])


def test_ring_layers_refuse_unsafe_reuse(slot_engines):
    """Slot 0 held 14 positions: its padded last chunk wrote position 15 into the ring row of position 3, which
    a query at position 8 still reads. reusable_prefix says 0, and reusing anyway would change the logits."""
    se = slot_engines("gemma3", "Q8_0", "c")
    old, fresh = _sequences(se.n_vocab, (14, 6), seed=4)
    new = old[:10] + fresh
    for a, b in se.chunk_plan(len(old)):
        se.prefill(0, old[a:b], a)
    assert se.reusable_prefix(cached_len=len(old), lcp=10, prompt_len=len(new)) == 0
    se.copy_prefix(0, 1, 8)
    unsafe = [se.prefill(1, new[a:b], a) for a, b in se.chunk_plan(len(new), 8)][-1]
    cold = [se.prefill(2, new[a:b], a) for a, b in se.chunk_plan(len(new))][-1]
    assert np.abs(unsafe - cold).max() > 1e-3


def _fgraph_nodes(fn):
    return fn.maker.fgraph.toposort()


@pytest.mark.parametrize("backend", ["c", "numba"])
def test_slot_steps_run_every_node_in_c_and_in_place(slot_engines, backend):
    """On C every node of every slot step has C code (the cache writes are lowered to flat 1-D writes); on both
    backends every cache write is in place, so a step never copies a slot cache."""
    from pytensor.compile.ops import DeepCopyOp
    from pytensor.tensor.subtensor import AdvancedIncSubtensor

    se = slot_engines("gemma3", "Q8_0", backend)
    for shape in se.stats.compiled_shapes:
        fn = se.step_function(*shape)
        if backend == "c":
            python = [str(node) for node, thunk in zip(fn.vm.nodes, fn.vm.thunks) if not hasattr(thunk, "cthunk")]
            assert not python, (shape, python[:5])
        writes = [node for node in _fgraph_nodes(fn) if isinstance(node.op, AdvancedIncSubtensor)]
        assert len(writes) == 2 * len(se.cache), shape
        assert all(node.op.destroy_map == {0: [0]} for node in writes), shape
        if backend == "c":
            assert all(node.inputs[0].ndim == 1 for node in writes), shape  # the flat form
        big = [node for node in _fgraph_nodes(fn) if isinstance(node.op, DeepCopyOp) and node.inputs[0].ndim >= 3]
        assert not big, (shape, big)
    buffers = [sv.get_value(borrow=True).__array_interface__["data"][0] for pair in se.cache for sv in pair]
    se.decode([0, 1, 2], [1, 2, 3], [0, 1, 2])
    se.prefill(0, [4, 5], 0)
    assert buffers == [sv.get_value(borrow=True).__array_interface__["data"][0] for pair in se.cache for sv in pair]


def test_no_compile_after_warm_up(slot_engines):
    se = slot_engines("gemma3", "Q8_0", "c")
    shapes = [(2, 1), (4, 1), (1, 4)]
    assert se.stats.compiled_shapes == shapes
    compiles = se.stats.compile_count
    for n in (1, 2, 3):
        se.decode(list(range(n)), [1] * n, [5] * n)
    se.prefill(0, [1], 0)
    se.prefill(0, [1, 2, 3, 4], 4)
    assert se.stats.compile_count == compiles == len(shapes)
    assert se.stats.compiled_shapes == shapes


def test_warm_up_links_from_the_graph_cache(slot_engines):
    """A second SlotEngine of the same shapes links every step from the rewritten-graph cache (no rewrites)
    and computes what the first one does."""
    from alchemist.runtime import graph_cache
    from alchemist.runtime.slot_engine import SlotEngine

    if not graph_cache.enabled():
        pytest.skip("graph cache turned off")
    first = slot_engines("gemma3", "Q8_0", "c")
    second = SlotEngine(first.engine, 3, chunk=4, decode_buckets=(2, 4))
    messages = []
    second.warm_up(messages.append)
    assert second.stats.graph_cache_hits == 3 and second.stats.compiled_shapes == first.stats.compiled_shapes
    assert messages == ["step 1/3: decode of 2", "step 2/3: decode of 4", "step 3/3: prefill of 4"]
    ids = _sequences(first.n_vocab, (7,), seed=5)[0]
    for se in (first, second):
        se.prefill(0, ids[:4], 0)
    np.testing.assert_array_equal(first.prefill(0, ids[4:], 4), second.prefill(0, ids[4:], 4))


def test_slot_engine_rules(slot_module):
    """Plans, reuse rules, cache sizes and bad calls, without compiling anything."""
    from alchemist.errors import AlchemistError
    from alchemist.runtime.engine import Engine
    from alchemist.runtime.slot_engine import SlotEngine

    module, path = slot_module("gemma3", "F32")
    engine = Engine(module, module.load_weights(str(path)), "c", CAPACITY)
    se = SlotEngine(engine, 3, chunk=4, decode_buckets=(1, 2, 4, 8))
    assert se.decode_buckets == (1, 2, 4)  # 8 could only ever hold padding
    assert se.rows == (12, 32) and se.capacity == CAPACITY and se.lock is engine.lock
    assert [sv.get_value(borrow=True).shape for sv in se.cache[0]] == [(4, 12, 2, 64)] * 2
    assert se.bytes_per_slot == 2 * (12 + 32) * 2 * 64 * 4
    assert se.chunk_plan(10) == [(0, 4), (4, 8), (8, 10)]
    assert se.chunk_plan(10, 8) == [(8, 10)] and se.chunk_plan(8, 8) == []
    assert se.reusable_prefix(cached_len=10, lcp=9, prompt_len=15) == 8
    assert se.reusable_prefix(cached_len=10, lcp=9, prompt_len=8) == 4  # one token must remain
    assert se.reusable_prefix(cached_len=10, lcp=3, prompt_len=15) == 0
    assert se.reusable_prefix(cached_len=14, lcp=10, prompt_len=15) == 0  # the ring no longer holds position 3
    full = SlotEngine(engine, 3, chunk=4, full_window=True)
    assert full.rows == (32, 32) and full.reusable_prefix(cached_len=14, lcp=10, prompt_len=15) == 8
    odd = SlotEngine(Engine(module, module.load_weights(str(path)), "c", 30), 2, chunk=4)
    assert odd.rows == (12, 32)  # whole chunks: the padded tail of the last chunk never wraps onto row 0
    for call, match in [
        (lambda: se.prefill(0, [1, 2], 2), "multiple of the prefill piece"),
        (lambda: se.prefill(0, [1] * 5, 0), "ends within its chunk"),
        (lambda: se.prefill(0, [1, 2], 28 + 4), "context overflow"),
        (lambda: se.prefill(3, [1], 0), "slot 3 out of range"),
        (lambda: se.prefill(0, [10**6], 0), "token ids out of range"),
        (lambda: se.decode([0, 0], [1, 1], [3, 4]), "distinct"),
        (lambda: se.decode([0], [1], [CAPACITY]), "outside the context"),
        (lambda: se.decode([0, 1, 2, 0, 1], [1] * 5, [1] * 5), "largest decode bucket"),
        (lambda: SlotEngine(engine, 0), "at least 1"),
    ]:
        with pytest.raises(AlchemistError, match=match):
            call()
    assert se.stats.compile_count == 0


def test_slot_engine_refuses_longrope(tiny_module):
    from alchemist.errors import AlchemistError
    from alchemist.runtime.engine import Engine
    from alchemist.runtime.slot_engine import SlotEngine

    module, path = tiny_module("phi3")
    with pytest.raises(AlchemistError, match="LongRoPE"):
        SlotEngine(Engine(module, module.load_weights(str(path)), "c", CAPACITY), 2)


@pytest.mark.slow
def test_reference_model_batched_greedy_equals_inference(reference_models):
    """gemma-3-270m: three prompts decoded together (one decode bucket of 4, a padding row) give the greedy
    tokens that inference() gives for each alone."""
    from alchemist.runtime.slot_engine import SlotEngine

    model = load_llm(reference_models["gemma-3-270m"], backend="c", context=256, progress=False)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
    ids = [model.tokenizer.encode(p) for p in prompts]
    want = [inference(model, p, max_tokens=8).output_token_ids for p in ids]
    se = SlotEngine(model.engine, 3, chunk=32, decode_buckets=(4,))
    got = [[] for _ in prompts]
    for slot, p in enumerate(ids):
        for a, b in se.chunk_plan(len(p)):
            logits = se.prefill(slot, p[a:b], a)
        got[slot].append(int(np.argmax(logits)))
    for step in range(7):
        out = se.decode([0, 1, 2], [g[-1] for g in got], [len(p) + step for p in ids])
        for slot in range(3):
            got[slot].append(int(np.argmax(out[slot])))
    assert got == want
