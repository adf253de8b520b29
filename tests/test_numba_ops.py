"""Numba computes ggml's RoPE, attention, SiLU and GELU with the C backend's own code (alchemist.kernels.numba_ops,
the ops library of alchemist.kernels.native): bit for bit the C Ops' results, which tests/test_rope.py and
test_attention_ggml.py check against ggml's loops; without the library, Numba gets their float32 formulas."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from alchemist.runtime import engine as _engine  # noqa: F401, E402 - configures PyTensor before it is imported

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

from alchemist.kernels import native  # noqa: E402
from alchemist.kernels.attention import CausalAttentionGgml  # noqa: E402
from alchemist.kernels.gelu import GeluTable  # noqa: E402
from alchemist.kernels.rope import RopeCacheGgml, RopeGgml, rope_cache_ggml, rope_ggml  # noqa: E402
from alchemist.kernels.silu import SiluGgml  # noqa: E402
from alchemist.runtime.backends import get_mode  # noqa: E402

from tests.test_attention_ggml import CASES, _case, _symbols  # noqa: E402

GGML_OPS = (RopeCacheGgml, RopeGgml, CausalAttentionGgml, SiluGgml, GeluTable)


@pytest.fixture(scope="module", autouse=True)
def library():
    if native.ops_kernels() is None:
        pytest.skip("no C++ compiler: Numba expands these Ops (test_without_the_library_numba_gets_the_formulas)")


def _both(inputs, outputs, args):
    """The outputs on C and on Numba, and the Numba graph's op types."""
    results = []
    for backend in ("c", "numba"):
        fn = pytensor.function(inputs, outputs, mode=get_mode(backend), on_unused_input="ignore")
        results.append([np.asarray(v) for v in fn(*args)])
    return results[0], results[1], {type(n.op) for n in fn.maker.fgraph.apply_nodes}


def _assert_bits_equal(c, numba):
    for i, (a, b) in enumerate(zip(c, numba, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype == np.float32, i
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"output {i}: {np.sum(a != b)} values differ"


def test_rope_on_numba_is_the_c_code():
    """Caches with and without frequency factors (YaRN, linear scaling), rotations NEOX and NORM, an odd number of
    pairs (NORM's unfused last pair) and a partial rotation (n_dims < head_dim)."""
    rng = np.random.default_rng(7)
    p, ff = pt.vector("p", dtype="int64"), pt.vector("ff", dtype="float32")
    x64, x34, x16 = (pt.tensor3(n, dtype="float32") for n in ("x64", "x34", "x16"))
    yarn = rope_cache_ggml(p, 64, 10000.0, None, freq_scale=0.25, ext_factor=1.0, attn_factor=0.9, n_ctx_orig=32)
    factors = rope_cache_ggml(p, 32, 500000.0, ff, freq_scale=0.25, attn_factor=1.2)
    c64, c34, c10 = (rope_cache_ggml(p, n, 10000.0) for n in (64, 34, 10))
    outputs = [
        yarn,
        factors,
        rope_ggml(x64, c64, "neox", 64),
        rope_ggml(x64, yarn, "norm", 64),
        rope_ggml(x34, c34, "norm", 34),
        rope_ggml(x16, c10, "norm", 10),
        rope_ggml(x16, c10, "neox", 10),
    ]
    positions = np.array([0, 1, 7, 100, 4097], dtype=np.int64)
    args = [positions, rng.uniform(1, 40, 19).astype(np.float32)]
    args += [(rng.standard_normal((5, 3, d)) * 3).astype(np.float32) for d in (64, 34, 16)]
    c, numba, ops = _both([p, ff, x64, x34, x16], outputs, args)
    assert {RopeCacheGgml, RopeGgml} <= ops  # called, not expanded into the formula
    _assert_bits_equal(c, numba)
    assert np.array_equal(numba[5][..., 10:], args[4][..., 10:])  # the dims past n_dims pass through


@pytest.mark.parametrize("name", list(CASES))
def test_attention_on_numba_is_the_c_code(name):
    """Every case of test_attention_ggml (GQA, a window, vec_dot's tails, an odd head dim, softcap and sinks), with
    several sequences, one query (vec_dot's kqv) and several (tinyBLAS's), and empty cache rows."""
    (n_head, n_kv_head, dim, window, scale, softcap, has_sinks), cases = CASES[name]
    rng = np.random.default_rng(len(name))
    op = CausalAttentionGgml(n_head, n_kv_head, dim, window, scale, softcap, has_sinks)
    symbols = _symbols(has_sinks)
    fns = {b: pytensor.function(symbols, op(*symbols), mode=get_mode(b)) for b in ("c", "numba")}
    assert CausalAttentionGgml in {type(n.op) for n in fns["numba"].maker.fgraph.apply_nodes}
    for n_seq, n_tok, n_keys, empty in cases:
        args = _case(rng, n_seq, n_tok, n_keys, n_head, n_kv_head, dim, empty)
        if has_sinks:
            args.append(rng.standard_normal(n_head).astype(np.float32))
        _assert_bits_equal([fns["c"](*args)], [fns["numba"](*args)])
    bad = _case(rng, 1, 2, 5, n_head, n_kv_head, dim)
    bad[1] = bad[1][..., :-1].copy()  # keys with the wrong head dim: an error, not a read past the end
    with pytest.raises(ValueError, match="inconsistent shapes"):
        fns["numba"](*bad, *([np.zeros(n_head, np.float32)] if has_sinks else []))


def test_silu_on_numba_is_the_c_code():
    """Rows of 8k lanes and with a tail (ggml's vector loop, then expf), one and several rows."""
    rng = np.random.default_rng(3)
    xs = [pt.tensor(n, dtype="float32", shape=(None,) * nd) for n, nd in (("a", 1), ("b", 2), ("c", 3))]
    args = [(rng.standard_normal(s) * 6).astype(np.float32) for s in ((37,), (5, 64), (2, 3, 13))]
    c, numba, ops = _both(xs, [SiluGgml()(x) for x in xs], args)
    assert SiluGgml in ops
    _assert_bits_equal(c, numba)


def test_gelu_on_numba_is_the_c_code():
    """ggml's fp16 table over its whole range: both saturations (|x| >= 10), every fp16 value between, and
    non-contiguous input."""
    x = pt.matrix("x", dtype="float32")
    halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    values = np.concatenate([halves[np.isfinite(halves)], np.float32([-10, 10, -10.5, 11, 9.999, -9.999, 0])])
    values = np.resize(values, (len(values) // 64 + 1) * 64).reshape(-1, 64)
    c, numba, ops = _both([x], [GeluTable()(x), GeluTable()(x.T)], [values])
    assert GeluTable in ops
    _assert_bits_equal(c, numba)


def test_rope_shape_errors_on_numba():
    xv, cv = pt.tensor3("x", dtype="float32"), pt.tensor3("c", dtype="float32")
    fn = pytensor.function([xv, cv], RopeGgml("neox", 8)(xv, cv), mode=get_mode("numba"))
    with pytest.raises(ValueError, match="do not match"):
        fn(np.zeros((3, 2, 8), np.float32), np.zeros((2, 4, 2), np.float32))  # 3 tokens, a cache for 2
    p, ff = pt.vector("p", dtype="int64"), pt.vector("ff", dtype="float32")
    fn = pytensor.function([p, ff], rope_cache_ggml(p, 8, 10000.0, ff), mode=get_mode("numba"))
    with pytest.raises(ValueError, match="fewer frequency factors"):
        fn(np.arange(3), np.ones(3, np.float32))


def test_without_the_library_numba_gets_the_formulas(monkeypatch, tmp_path):
    """ALCHEMIST_NUMBA_NATIVE=0 (as without a compiler): the Ops are expanded into float32 PyTensor ops, equal to the
    C code's results up to rounding, and a step graph is cached under another key."""
    monkeypatch.setenv("ALCHEMIST_NUMBA_NATIVE", "0")
    x, p = pt.tensor3("x", dtype="float32"), pt.vector("p", dtype="int64")
    out = [GeluTable()(SiluGgml()(rope_ggml(x, rope_cache_ggml(p, 16, 10000.0), "neox", 16)))]
    args = [np.random.default_rng(1).standard_normal((4, 2, 16)).astype(np.float32), np.arange(4)]
    c, numba, ops = _both([x, p], out, args)
    assert not ops & set(GGML_OPS)
    np.testing.assert_allclose(numba[0], c[0], rtol=1e-5, atol=1e-6)

    from alchemist.runtime import graph_cache

    def key():
        return graph_cache.step_key("sha", "numba", get_mode("numba"), {}, {"n_tokens": 1})

    without = key()
    monkeypatch.setenv("ALCHEMIST_NUMBA_NATIVE", "1")
    assert key() != without
