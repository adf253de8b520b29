"""alchemist.kernels.rope: ggml's RoPE (cos/sin cache and rotation) bit for bit on C, against a plain-Python
transcription of ggml's loops (glibc's sincosf/powf/logf/fmaf through ctypes: numpy's float32 cos is not glibc's)
and against llama.cpp's own ROPE nodes on tiny fixtures (NORM, NEOX, YaRN, llama3 factors, LongRoPE)."""

from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np
import pytest

from alchemist.pytensor_ext.host import configure_pytensor

configure_pytensor()

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

from alchemist.kernels.rope import RopeCacheGgml, rope_cache_ggml, rope_formula, rope_ggml  # noqa: E402
from alchemist.runtime.backends import get_mode  # noqa: E402

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500]
F = ctypes.c_float
f32 = np.float32


@pytest.fixture(scope="module")
def libm():
    lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    for name, n in (("powf", 2), ("logf", 1), ("floorf", 1), ("ceilf", 1), ("fmaf", 3)):
        getattr(lib, name).restype, getattr(lib, name).argtypes = F, [F] * n
    lib.sincosf.restype, lib.sincosf.argtypes = None, [F, ctypes.POINTER(F), ctypes.POINTER(F)]
    return lib


def ref_cache(lib, op: RopeCacheGgml, positions, ff=None) -> np.ndarray:
    """ggml_compute_forward_rope_flt's ggml_rope_cache_init / rope_yarn, a float32 operation at a time."""
    n, P = op.n_dims, op.n_dims // 2
    theta_scale = f32(lib.powf(F(op.freq_base), F(f32(-2.0) / f32(n))))

    def corr_dim(n_rot):  # ggml_rope_yarn_corr_dim
        inner = f32(f32(op.n_ctx_orig) / f32(f32(f32(n_rot) * f32(2)) * f32(math.pi)))
        return f32(f32(f32(n) * f32(lib.logf(F(inner)))) / f32(f32(2) * f32(lib.logf(F(op.freq_base)))))

    low = max(f32(0), f32(lib.floorf(F(corr_dim(op.beta_fast)))))
    high = min(f32(n - 1), f32(lib.ceilf(F(corr_dim(op.beta_slow)))))
    out = np.empty((len(positions), P, 2), np.float32)
    for t, p in enumerate(positions):
        theta = f32(p)
        for i in range(P):
            extrap = theta if ff is None else f32(theta / ff[i])
            interp = f32(f32(op.freq_scale) * extrap)
            th, mscale = interp, f32(op.attn_factor)
            if op.ext_factor != 0:
                y = f32(f32(f32(i) - low) / max(f32(0.001), f32(high - low)))
                mix = f32(f32(f32(1) - min(f32(1), max(f32(0), y))) * f32(op.ext_factor))
                th = f32(lib.fmaf(F(interp), F(f32(1) - mix), F(f32(extrap * mix))))
                log = f32(lib.logf(F(f32(f32(1) / f32(op.freq_scale)))))
                mscale = f32(mscale * f32(lib.fmaf(F(0.1), F(log), F(1.0))))
            s, c = F(), F()
            lib.sincosf(F(th), ctypes.byref(s), ctypes.byref(c))
            out[t, i] = f32(f32(c.value) * mscale), f32(f32(s.value) * mscale)
            theta = f32(theta * theta_scale)
    return out


def ref_rotate(lib, x, cache, style, n_dims) -> np.ndarray:
    """rotate_pairs as libggml-cpu.so runs it (FMA-contracted; NORM's odd last pair in the vector loop's tail)."""
    y = x.copy()
    P = n_dims // 2
    for t, h in np.ndindex(x.shape[:2]):
        for i in range(P):
            c, s = cache[t, i]
            a, b = (i, i + P) if style == "neox" else (2 * i, 2 * i + 1)
            x0, x1 = x[t, h, a], x[t, h, b]
            if style == "neox" or i < P // 2 * 2:
                y[t, h, a] = lib.fmaf(F(x0), F(c), F(-f32(x1 * s)))
                y[t, h, b] = lib.fmaf(F(x0), F(s), F(f32(x1 * c)))
            else:
                y[t, h, a] = f32(x0 * c) - f32(x1 * s)
                y[t, h, b] = f32(x0 * s) + f32(x1 * c)
    return y


CACHES = {
    "plain": (dict(n_dims=64, freq_base=10000.0), False),
    "gemma-global": (dict(n_dims=256, freq_base=1e6), False),
    "factors-linear": (dict(n_dims=32, freq_base=500000.0, freq_scale=0.25, attn_factor=1.2), True),
    "yarn": (
        dict(n_dims=64, freq_base=10000.0, freq_scale=0.25, ext_factor=1.0, attn_factor=0.9, n_ctx_orig=32),
        False,
    ),
}


@pytest.mark.parametrize("case", list(CACHES))
def test_rope_cache_is_ggmls_bit_for_bit(libm, case):
    params, with_factors = CACHES[case]
    positions = np.array([0, 1, 2, 7, 100, 511, 4097, 30011], dtype=np.int64)
    ff = np.random.default_rng(3).uniform(1, 40, params["n_dims"] // 2 + 3).astype(np.float32) if with_factors else None
    p = pt.vector("p", dtype="int64")
    v = pt.vector("ff", dtype="float32")
    inputs, args = ([p, v], (positions, ff)) if with_factors else ([p], (positions,))
    n_dims, base = params.pop("n_dims"), params.pop("freq_base")
    cache = rope_cache_ggml(p, n_dims, base, v if with_factors else None, **params)
    got = pytensor.function(inputs, cache, mode=get_mode("c"))(*args)
    want = ref_cache(libm, RopeCacheGgml(n_dims, base, **params), positions, ff)
    assert got.shape == (len(positions), n_dims // 2, 2)
    assert np.array_equal(got, want), f"{np.sum(got != want)} of {want.size} differ"
    if case == "plain":  # the test can fail: the exact modules' angles (p times a precomputed power) differ
        steps = np.full(n_dims // 2, f32(base) ** f32(-2.0 / n_dims), np.float32)
        steps[0] = 1
        angles = np.float32(positions)[:, None] * np.cumprod(steps, dtype=np.float32)[None, :]
        assert not np.array_equal(np.cos(angles), want[..., 0])


@pytest.mark.parametrize(
    "style, n_dims, head_dim",
    [("neox", 64, 64), ("norm", 64, 64), ("norm", 34, 34), ("norm", 10, 16), ("norm", 2, 2), ("neox", 16, 24)],
)
def test_rope_rotation_is_ggmls_bit_for_bit(libm, style, n_dims, head_dim):
    rng = np.random.default_rng(n_dims)
    x = (rng.standard_normal((5, 3, head_dim)) * 3).astype(np.float32)
    positions = np.array([0, 3, 17, 300, 9000], dtype=np.int64)
    xv, p = pt.tensor3("x", dtype="float32"), pt.vector("p", dtype="int64")
    cache = rope_cache_ggml(p, n_dims, 10000.0)
    got, c = pytensor.function([xv, p], [rope_ggml(xv, cache, style, n_dims), cache], mode=get_mode("c"))(x, positions)
    want = ref_rotate(libm, x, c, style, n_dims)
    assert np.array_equal(got, want), f"{np.sum(got != want)} of {want.size} differ"
    assert np.array_equal(got[..., n_dims:], x[..., n_dims:])
    # the plain formula (separately rounded products) differs from the fused rotation somewhere
    plain = pytensor.function([xv, p], rope_formula(xv, cache, style, n_dims), mode=get_mode("c"))(x, positions)
    assert not np.array_equal(plain, want)
    np.testing.assert_allclose(plain, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ("jax", "mlx"))
@pytest.mark.parametrize("kernels", (True, False), ids=("kernels", "formula"))
@pytest.mark.parametrize("style", ("neox", "norm"))
def test_rope_on_jax_and_mlx(c_kernels_on, style, kernels, backend):
    """JAX and MLX call the C loops (alchemist.kernels.jax_ffi, mlx_host): the C backend's bits, frequency factors
    and a partial rotation included; without the C kernels the float32 formula."""
    c_kernels_on(backend, kernels)
    x = np.random.default_rng(4).standard_normal((4, 2, 32)).astype(np.float32)
    factors = np.linspace(1.0, 4.0, 12, dtype=np.float32)
    xv, p = pt.tensor3("x", dtype="float32"), pt.vector("p", dtype="int64")
    positions = np.array([0, 7, 300, 4095])
    for ff in (None, factors):
        out = rope_ggml(xv, rope_cache_ggml(p, 24, 10000.0, freq_factors=ff), style, 24)
        want = pytensor.function([xv, p], out, mode=get_mode("c"))(x, positions)
        got = np.asarray(pytensor.function([xv, p], out, mode=get_mode(backend))(x, positions))
        if kernels:
            assert np.array_equal(got, want)
        else:  # the formula's float32 angles drift from ggml's running product at large positions (4095)
            np.testing.assert_allclose(got[:3], want[:3], rtol=1e-5, atol=1e-5)


def test_rope_cache_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        RopeCacheGgml(5, 10000.0)
    with pytest.raises(TypeError, match="int vector"):
        rope_cache_ggml(pt.vector("p", dtype="float32"), 4, 10000.0)
    with pytest.raises(TypeError, match="head_dim"):
        rope_ggml(pt.tensor("x", dtype="float32", shape=(None, 2, 4)), pt.tensor3("c", dtype="float32"), "neox", 8)


# -- against llama.cpp's own ROPE nodes ------------------------------------------------------------------
def _rope_nodes(monkeypatch, path, n_ctx):
    """{name: (llama.cpp's input to its ROPE node, the ROPE node's output)} for every Qcur-il / Kcur-il."""
    from alchemist.harness import _llama
    from alchemist.harness.oracle import LlamaCppOracle

    seen: dict[str, list] = {}
    original = _llama.tensor_to_numpy

    def record(t, rank=2):
        arr, info = original(t, rank)
        seen.setdefault(_llama.tensor_name(t), []).append((info["op"], np.array(arr)))
        return arr, info

    monkeypatch.setattr(_llama, "tensor_to_numpy", record)
    with LlamaCppOracle(str(path), n_ctx=n_ctx) as oracle:
        oracle.intermediates(PROMPT, ["Qcur-*", "Kcur-*"])
    nodes = {}
    for name, entries in seen.items():
        ops = [op for op, _ in entries]
        if "ROPE" in ops and ops.index("ROPE") > 0:
            i = ops.index("ROPE")
            nodes[name] = (entries[i - 1][1].reshape(entries[i][1].shape), entries[i][1])
    return nodes


@pytest.mark.parametrize("arch", ["llama", "llama@34", "qwen2", "qwen2:yarn", "llama:llama3", "llama:linear", "phi3"])
def test_rope_is_llamacpps_bit_for_bit(fixture_files, tmp_path, monkeypatch, arch):
    """llama.cpp's own input to each ROPE node, rotated by the ggml copy's rope_angles/rope on C, gives llama.cpp's
    output bit for bit (NORM: llama; NEOX: qwen2; YaRN; llama3 rope_freqs; linear; phi3's LongRoPE on 48 of 64
    dims; llama@34: 17 pairs, an odd count, whose last pair ggml rotates without fma). The exact module does not."""
    import inspect

    pytest.importorskip("llama_cpp")
    import gguf

    from alchemist.fixtures import FixtureConfig, write_fixture
    from alchemist.runtime.api import load_llm
    from alchemist.runtime.numerics import primitives

    if "@" in arch:
        name, _, hd = arch.partition("@")
        path = write_fixture(
            tmp_path / "f.gguf", name, config=FixtureConfig(name, head_dim=int(hd), n_embd=4 * int(hd))
        )
    else:
        path = fixture_files(arch, "F32")
    n_ctx = 64
    nodes = _rope_nodes(monkeypatch, path, n_ctx)
    assert len(nodes) >= 4
    exact = load_llm(str(path), backend="c", numerics="exact").module
    ggml = primitives(exact, "ggml")
    w = {
        t.name: pt.constant(np.array(t.data, np.float32))
        for t in gguf.GGUFReader(str(path)).tensors
        if "rope" in t.name
    }
    extra = (n_ctx,) if len(inspect.signature(exact.rope_angles).parameters) == 4 else ()
    x, p = pt.tensor3("x", dtype="float32"), pt.vector("p", dtype="int64")
    positions = np.arange(len(PROMPT), dtype=np.int64)
    n_exact_differing = 0
    for name, (before, after) in nodes.items():
        il = int(name.rsplit("-", 1)[1])
        outs = [ops.rope(x, ops.rope_angles(w, il, p, *extra)) for ops in (ggml, exact.EXACT)]
        ours, formula = pytensor.function([x, p], outs, mode=get_mode("c"))(before.astype(np.float32), positions)
        assert np.array_equal(ours, after), f"{name}: {np.sum(ours != after)} of {after.size} differ"
        n_exact_differing += int(np.sum(formula != after))
    assert n_exact_differing > 0


def test_gemma3_qk_after_rope_are_op_exact(fixture_files):
    """--fed-ops on gemma3 (NEOX, per-layer bases): Qcur/Kcur computed from llama.cpp's Qcur_normed/Kcur_normed
    are llama.cpp's to the bit."""
    pytest.importorskip("llama_cpp")
    from alchemist.harness.validate import diff_model

    diff = diff_model(str(fixture_files("gemma3", "F32")), "c", PROMPT[:6], fed="ops")
    rows = {r["tensor"]: r for r in diff["fed"]["rows"]}
    names = [n for n in rows if n.split("-")[0] in ("Qcur", "Kcur")]
    assert len(names) >= 4
    for name in names:
        assert rows[name]["op_differing"] == 0, name
