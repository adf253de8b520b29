"""CausalAttentionGgml (alchemist.kernels.attention): the ggml copy's causal_attention, llama.cpp's attention bit
for bit on C (its own loops in numpy, and llama.cpp's kqv_out from llama.cpp's Q, K, V, prompt and decode step),
the generated formula on the other backends."""

from __future__ import annotations

import numpy as np
import pytest

from alchemist.pytensor_ext.host import configure_pytensor

configure_pytensor()

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

from alchemist.kernels.attention import (  # noqa: E402
    CausalAttentionGgml,
    SlotAttentionGgml,
    attention_ggml_reference,
    attention_variant,
    causal_attention_formula,
    v_expf_reference,
    vec_dot_reference,
)
from alchemist.runtime.backends import get_mode  # noqa: E402

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500]  # 12 tokens: crosses the fixtures' window of 8
CONTEXT = 64


class PortableAttention(CausalAttentionGgml):
    """The same Op compiled without its AVX2 intrinsics (the scalar fmaf code other CPUs run)."""

    def c_compile_args(self, **kwargs):
        return [*super().c_compile_args(**kwargs), "-DALCHEMIST_ATTN_PORTABLE"]


def _bits_differ(a, b) -> int:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32).reshape(np.shape(a))
    return int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))


def _symbols(with_sinks=False):
    names = [("q", "float32", 3), ("keys", "float32", 4), ("values", "float32", 4)]
    names += [("q_positions", "int64", 2), ("key_positions", "int64", 2)]
    out = [pt.tensor(n, dtype=d, shape=(None,) * nd) for n, d, nd in names]
    return out + ([pt.vector("sinks", dtype="float32")] if with_sinks else [])


def _case(rng, n_seq, n_tok, n_keys, n_head, n_kv_head, dim, empty_rows=0):
    """Random q/k/v of B sequences whose T queries are the last T of their S keys; the last `empty_rows` key rows
    of sequence 1 hold nothing (negative positions, as the serving step's ring caches mark them)."""
    q = (rng.standard_normal((n_seq * n_tok, n_head, dim)) * 2).astype(np.float32)
    k = rng.standard_normal((n_seq, n_keys, n_kv_head, dim)).astype(np.float32)
    v = rng.standard_normal((n_seq, n_keys, n_kv_head, dim)).astype(np.float32)
    q_pos = np.tile(np.arange(n_keys - n_tok, n_keys), (n_seq, 1)).astype(np.int64)
    k_pos = np.tile(np.arange(n_keys), (n_seq, 1)).astype(np.int64)
    if empty_rows:
        k_pos[1, :empty_rows] = -1
    return [q, k, v, q_pos, k_pos]


def _run_cases(fn, rng, name):
    """For each case of CASES[name]: (case, args, fn(*args), attention_ggml_reference(*args, ...))."""
    (n_head, n_kv_head, dim, window, scale, softcap, has_sinks), cases = CASES[name]
    for case in cases:
        args = _case(rng, *case[:3], n_head, n_kv_head, dim, case[3])
        if has_sinks:
            args.append(rng.standard_normal(n_head).astype(np.float32))
        want = attention_ggml_reference(*args[:5], window, scale, softcap, args[5] if has_sinks else None)
        yield case, args, np.asarray(fn(*args)), want


# (props, cases): props (n_head, n_kv_head, head_dim, window, scale, softcap, sinks); cases (B, T, S, empty rows).
# T >= 2 is tinyBLAS's kqv, T == 1 ggml_vec_dot_f32's; head dims 40, 100 and 19 take vec_dot's tails (blocks of
# 8 and 4, then fma), 19 also kqv by vec_dot at T >= 2 (tinyBLAS needs the head dim a multiple of 4)
CASES = {
    "gqa": ((4, 2, 64, 0, 0.125, 0.0, False), [(1, 6, 6, 0), (1, 1, 41, 0), (2, 3, 37, 5)]),
    "window": ((4, 1, 40, 7, 0.3, 0.0, False), [(1, 5, 40, 0), (1, 1, 45, 0)]),
    "tails": ((2, 2, 100, 0, 1.0, 0.0, False), [(1, 1, 45, 0), (2, 4, 20, 3)]),
    "odd": ((2, 1, 19, 0, 0.5, 0.0, False), [(1, 4, 20, 0), (2, 1, 9, 2)]),
    "softcap+sinks": ((4, 2, 32, 0, 0.125, 5.0, True), [(1, 6, 6, 0), (1, 1, 13, 0)]),
}


@pytest.mark.parametrize("op_class", (CausalAttentionGgml, PortableAttention), ids=("avx2", "portable"))
@pytest.mark.parametrize("name", list(CASES))
def test_attention_op_is_ggmls_loops_bit_for_bit(name, op_class):
    """The C loops equal their numpy transcription of ggml's (vec_dot scores, v_expf softmax with its double sum,
    sgemm or vec_dot kqv) to the bit, and the generated formula to float32 rounding."""
    (n_head, n_kv_head, dim, window, scale, softcap, has_sinks), _ = CASES[name]
    if op_class is PortableAttention and name not in ("gqa", "odd"):
        pytest.skip("the portable build on two of the cases is enough")
    rng = np.random.default_rng(len(name))
    op = op_class(n_head, n_kv_head, dim, window, scale, softcap, has_sinks)
    symbols = _symbols(has_sinks)
    fn = pytensor.function(symbols, op(*symbols), mode=get_mode("c"))
    sinks_v = symbols[5] if has_sinks else None
    formula = causal_attention_formula(*symbols[:5], n_head, n_kv_head, dim, window, scale, softcap, sinks_v)
    formula_fn = pytensor.function(symbols, formula, mode=get_mode("c"))
    for (n_seq, n_tok, n_keys, _), args, got, want in _run_cases(fn, rng, name):
        assert got.shape == (n_seq * n_tok, n_head * dim)
        assert _bits_differ(got, want) == 0, (name, n_seq, n_tok, n_keys)
        np.testing.assert_allclose(got, np.asarray(formula_fn(*args)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ("gqa", "softcap+sinks", "odd"))
def test_slot_attention_reads_in_place_what_the_op_reads_gathered(name):
    """SlotAttentionGgml(q, caches, ..., slots) equals CausalAttentionGgml(q, caches[:, :S][slots], ...) to the bit
    (C and perform), for slots in any order, S below the cache's rows, padding rows; a slot outside the cache is a
    ValueError, not a read past it."""
    (n_head, n_kv_head, dim, window, scale, softcap, has_sinks), cases = CASES[name]
    rng = np.random.default_rng(7)
    symbols = _symbols(has_sinks)
    slots = pt.vector("slots", dtype="int64")
    gathered = [symbols[1][:, : symbols[4].shape[1]][slots], symbols[2][:, : symbols[4].shape[1]][slots]]
    props = (n_head, n_kv_head, dim, window, scale, softcap, has_sinks)
    want_fn = pytensor.function(
        [*symbols, slots], CausalAttentionGgml(*props)(symbols[0], *gathered, *symbols[3:]), mode=get_mode("c")
    )
    in_place = SlotAttentionGgml(*props)(*symbols[:5], slots, *symbols[5:])
    fns = [
        pytensor.function([*symbols, slots], in_place, mode=m)
        for m in (get_mode("c"), pytensor.compile.mode.Mode(linker="py", optimizer=None))
    ]
    for n_seq, n_tok, n_keys, empty in cases:
        n_slots, n_rows = n_seq + 2, n_keys + 5
        q, _, _, q_pos, k_pos = _case(rng, n_seq, n_tok, n_keys, n_head, n_kv_head, dim, empty)
        caches = [rng.standard_normal((n_slots, n_rows, n_kv_head, dim)).astype(np.float32) for _ in range(2)]
        slot_ids = rng.permutation(n_slots)[:n_seq].astype(np.int64)
        args = [q, *caches, q_pos, k_pos] + ([rng.standard_normal(n_head).astype(np.float32)] if has_sinks else [])
        want = np.asarray(want_fn(*args, slot_ids))
        for fn in fns:
            assert _bits_differ(fn(*args, slot_ids), want) == 0, (name, n_seq, n_tok, n_keys)
            with pytest.raises(ValueError):
                fn(*args, np.full(n_seq, n_slots, np.int64))


def test_the_slot_op_is_not_taken_for_the_gathered_one():
    """SlotAttentionGgml and CausalAttentionGgml share a base, neither derives from the other: a backend's per-Op
    registry (Numba's, JAX's, MLX's funcify, keyed by class) never runs the gathered Op's code on the slot Op's
    inputs. On Numba, which has no conversion of the slot Op, it runs its perform (the same bits as C)."""
    assert not issubclass(SlotAttentionGgml, CausalAttentionGgml) and not issubclass(
        CausalAttentionGgml, SlotAttentionGgml
    )
    pytest.importorskip("numba")
    (n_head, n_kv_head, dim, window, scale, softcap, has_sinks), cases = CASES["gqa"]
    rng = np.random.default_rng(9)
    symbols = _symbols(has_sinks)
    slots = pt.vector("slots", dtype="int64")
    out = SlotAttentionGgml(n_head, n_kv_head, dim, window, scale, softcap, has_sinks)(*symbols[:5], slots)
    c_fn, numba_fn = (pytensor.function([*symbols, slots], out, mode=get_mode(b)) for b in ("c", "numba"))
    n_seq, n_tok, n_keys, empty = cases[-1]
    q, _, _, q_pos, k_pos = _case(rng, n_seq, n_tok, n_keys, n_head, n_kv_head, dim, empty)
    caches = [rng.standard_normal((n_seq + 1, n_keys + 3, n_kv_head, dim)).astype(np.float32) for _ in range(2)]
    slot_ids = np.array([2, 0], np.int64)
    assert _bits_differ(numba_fn(q, *caches, q_pos, k_pos, slot_ids), c_fn(q, *caches, q_pos, k_pos, slot_ids)) == 0


def test_v_expf_and_vec_dot_transcriptions():
    """ggml_v_expf is exp to about 1.5 ulp over its range, +0 at -inf; vec_dot is the dot product (its tail too)."""
    x = np.concatenate([np.linspace(-103, 88, 20001), [0.0, -1e-30, 1e-30]]).astype(np.float32)
    got = v_expf_reference(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) < 2.0
    assert v_expf_reference(np.float32([-np.inf])).view(np.uint32)[0] == 0  # +0: masked cells add nothing
    rng = np.random.default_rng(3)
    for n in (19, 32, 44, 100, 256):
        a, b = rng.standard_normal((2, n)).astype(np.float32)
        assert abs(float(vec_dot_reference(a, b)) - float(a.astype(np.float64) @ b)) < 1e-5 * n


# --------------------------------------------------------------------------- against llama.cpp's own tensors
def _our_attention(module, il, q, keys, values, positions, sinks):
    variant = attention_variant(module)
    window = int(module.SLIDING_WINDOW[il]) if hasattr(module, "SLIDING_WINDOW") else 0
    op = CausalAttentionGgml(module.N_HEAD, module.N_KV_HEAD, module.HEAD_DIM, window, **variant)
    symbols = _symbols(variant["has_sinks"])
    args = [q, keys[None], values[None], positions[None], np.arange(len(keys), dtype=np.int64)[None]]
    if variant["has_sinks"]:
        args.append(sinks)
    ours = np.asarray(pytensor.function(symbols, op(*symbols), mode=get_mode("c"))(*args))
    s = symbols[5] if variant["has_sinks"] else None
    formula = causal_attention_formula(
        *symbols[:5], op.n_head, op.n_kv_head, op.head_dim, window, op.scale, op.softcap, s
    )
    return ours, np.asarray(pytensor.function(symbols, formula, mode=get_mode("c"))(*args))


@pytest.mark.parametrize("arch", ("llama", "gemma3", "gemma2", "gpt-oss"))
def test_attention_is_llamacpps_bit_for_bit(llamacpp_bits, fixture_files, arch):
    """kqv_out computed from llama.cpp's own Qcur, Kcur, Vcur is llama.cpp's, bit for bit: a 12-token prompt (kqv by
    tinyBLAS) and the decode step after it (T=1 at position 12: by ggml_vec_dot_f32); gemma3 and gemma2 slide a
    window of 8 on every other layer, gemma2 caps its logits, gpt-oss adds attention sinks. The generated
    formula on the same inputs is not (the test can fail)."""
    pytest.importorskip("llama_cpp")
    from alchemist.harness import LlamaCppOracle
    from alchemist.harness.validate import load_for_validation

    path = str(fixture_files(arch, "F32"))
    module = load_for_validation(path, numerics="exact").module
    assert attention_variant(module)["softcap"] == (5.0 if arch == "gemma2" else 0.0)
    assert attention_variant(module)["has_sinks"] == (arch == "gpt-oss")
    names = ["Qcur-*", "Kcur-*", "Vcur-*", "kqv_out-*"]
    with LlamaCppOracle(path, n_ctx=CONTEXT, n_threads=1) as oracle:
        prompt = oracle.intermediates(PROMPT, names)
        step = oracle.intermediates([77], names, prefix=PROMPT)
    weights = module.load_weights(path) if arch == "gpt-oss" else {}
    shape = (-1, module.N_KV_HEAD, module.HEAD_DIM)
    formula_differing = 0
    for il in range(module.N_LAYER):
        sinks = weights.get(f"blk.{il}.attn_sinks.weight")
        q_shape = (-1, module.N_HEAD, module.HEAD_DIM)
        k, v = prompt[f"Kcur-{il}"].reshape(shape), prompt[f"Vcur-{il}"].reshape(shape)
        positions = np.arange(len(PROMPT), dtype=np.int64)
        ours, formula = _our_attention(module, il, prompt[f"Qcur-{il}"].reshape(q_shape), k, v, positions, sinks)
        assert _bits_differ(ours, prompt[f"kqv_out-{il}"]) == 0, f"prompt, layer {il}"
        formula_differing += _bits_differ(formula, prompt[f"kqv_out-{il}"])
        k = np.concatenate([k, step[f"Kcur-{il}"].reshape(shape)])
        v = np.concatenate([v, step[f"Vcur-{il}"].reshape(shape)])
        positions = np.array([len(PROMPT)], np.int64)
        ours, formula = _our_attention(module, il, step[f"Qcur-{il}"].reshape(q_shape), k, v, positions, sinks)
        assert _bits_differ(ours, step[f"kqv_out-{il}"]) == 0, f"decode step, layer {il}"
        formula_differing += _bits_differ(formula, step[f"kqv_out-{il}"])
    assert formula_differing > 0


# ---------------------------------------------------------------------------------- the ggml primitives
def test_the_ggml_primitives_attend_with_the_op(tiny_module):
    from alchemist.runtime.numerics import primitives

    exact, _ = tiny_module("llama")
    ggml = primitives(exact, "ggml")
    assert attention_variant(exact) == {
        "scale": float(np.float32(exact.SCORE_SCALE)),
        "softcap": 0.0,
        "has_sinks": False,
    }
    assert ggml.causal_attention is not exact.causal_attention
    n_head, n_kv, dim = exact.N_HEAD, exact.N_KV_HEAD, exact.HEAD_DIM
    q = pt.tensor("q", dtype="float32", shape=(3, n_head, dim))
    kv = [pt.tensor(n, dtype="float32", shape=(1, 5, n_kv, dim)) for n in ("k", "v")]
    out = ggml.causal_attention(q, *kv, pt.as_tensor(np.arange(2, 5)[None]), pt.as_tensor(np.arange(5)[None]), 0)
    assert isinstance(out.owner.op, CausalAttentionGgml) and out.type.shape == (3, n_head * dim)


@pytest.mark.parametrize("backend", ("jax", "mlx"))
@pytest.mark.parametrize("kernels", (True, False), ids=("kernels", "formula"))
@pytest.mark.parametrize("name", ("gqa", "softcap+sinks", "window"))
def test_the_op_on_jax_and_mlx(c_kernels_on, name, kernels, backend):
    """JAX and MLX call the C loops (alchemist.kernels.jax_ffi, mlx_host): ggml's bits, the cache's unseen rows
    and negative positions included; without the C kernels they compute the formula."""
    c_kernels_on(backend, kernels)
    op = CausalAttentionGgml(*CASES[name][0])
    symbols = _symbols(op.has_sinks)
    fn = pytensor.function(symbols, op(*symbols), mode=get_mode(backend))
    for (n_seq, n_tok, n_keys, _), _, got, want in _run_cases(fn, np.random.default_rng(5), name):
        if kernels:
            assert _bits_differ(got, want) == 0, (name, n_seq, n_tok, n_keys)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
