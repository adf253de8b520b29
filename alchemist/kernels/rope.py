"""`RopeCacheGgml` and `RopeGgml`: ggml-cpu's RoPE (ggml_compute_forward_rope_f32), bit for bit on C.

ggml builds, per position p, a cache of (cos, sin) per rotated pair i (ggml_rope_cache_init / rope_yarn):

    theta_scale = powf(freq_base, -2.0f / n_dims)
    theta       = (float)p, then theta *= theta_scale after every pair (a running product, not p · scale^i)
    t_extrap    = theta / freq_factors[i]                 (llama3 / LongRoPE divisors, when present)
    t_interp    = freq_scale · t_extrap
    YaRN (ext_factor != 0): mix = ramp(i) · ext_factor, t = fma(t_interp, 1 - mix, t_extrap · mix),
                            mscale = attn_factor · fma(0.1f, logf(1 / freq_scale), 1)
    cos, sin    = cosf(t) · mscale, sinf(t) · mscale       (glibc's, the same libm llama.cpp calls)

then rotates each pair (x0, x1) (NEOX: dims i and i + n_dims/2; NORM: dims 2i and 2i+1). libggml-cpu.so is
compiled with FMA contraction, which fuses the rotation differently per path (read from its disassembly and
checked against llama.cpp's Qcur/Kcur):

    NEOX (a scalar loop) and NORM (vectorized, vfmaddsub):
                               y0 = fma(x0, cos, -(x1 · sin))     y1 = fma(x0, sin, x1 · cos)
    NORM, the last pair when n_dims/2 is odd (the vector loop's tail, vaddsubps, no fma):
                               y0 = x0 · cos - x1 · sin           y1 = x0 · sin + x1 · cos

The generated modules compute the angle as p · (scale · base^(-2i/n)) with numpy's float32 power and a
precomputed product, and cos/sin in PyTensor: ~30% of the rotated values differ from llama.cpp's by ulps. The
numerics="ggml" copies use these Ops: `RopeCacheGgml` turns positions into ggml's (T, n_dims/2, 2) cache,
`RopeGgml` rotates (T, heads, head_dim) with it. On C both are loops with fmaf written out (compiled with
-ffp-contract=off, so the compiler's flags cannot change them). Numba, JAX and MLX call the same C code
(kernels.numba_ops, jax_ffi, mlx_host). Without it they get the float32 formula as PyTensor ops (`expand_rope_ggml`,
a rewrite tagged "jax" and "mlx"; on Numba when the ops library cannot be built): their cos/sin are not glibc's.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import node_rewriter
from pytensor.link.c.op import COp

from alchemist.kernels.expansion import register_expansion
from alchemist.kernels.native import register_numba_expansion
from alchemist.kernels.sources import source

STYLES = ("neox", "norm")

ROPE_C = source("rope.cpp")

_C_VERSION = int(hashlib.sha256(ROPE_C.encode()).hexdigest()[:12], 16)
# fmaf() is correctly rounded whether it compiles to an instruction (PyTensor compiles with -march=native) or a call
_C_ARGS = ["-O3", "-ffp-contract=off", "-fno-fast-math"]


def _f32(v) -> float:
    return float(np.float32(v))


class RopeCacheGgml(COp):
    """positions int64 (T,) [, freq_factors float32 (>= n_dims/2,)] -> (T, n_dims/2, 2) float32 (cos, sin) per
    rotated pair, as ggml's ggml_rope_cache_init computes them (module docstring)."""

    computes_ggml_kernel = True  # kernels.expansion: JAX and MLX call its C code where they can

    __props__ = (
        "n_dims",
        "freq_base",
        "freq_scale",
        "ext_factor",
        "attn_factor",
        "beta_fast",
        "beta_slow",
        "n_ctx_orig",
    )

    def __init__(
        self,
        n_dims: int,
        freq_base: float,
        freq_scale: float = 1.0,
        ext_factor: float = 0.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        n_ctx_orig: int = 0,
    ):
        if n_dims < 2 or n_dims % 2:
            raise ValueError(f"RopeCacheGgml: n_dims must be even and >= 2, got {n_dims}")
        self.n_dims = int(n_dims)
        self.freq_base = _f32(freq_base)
        self.freq_scale = _f32(freq_scale)
        self.ext_factor = _f32(ext_factor)
        self.attn_factor = _f32(attn_factor)
        self.beta_fast = _f32(beta_fast)
        self.beta_slow = _f32(beta_slow)
        self.n_ctx_orig = int(n_ctx_orig)

    def make_node(self, positions, freq_factors=None):
        positions = pt.as_tensor_variable(positions)
        if positions.type.ndim != 1 or positions.type.dtype not in ("int64", "int32"):
            raise TypeError(f"RopeCacheGgml: positions must be an int vector, got {positions.type}")
        positions = pt.cast(positions, "int64")
        inputs = [positions]
        if freq_factors is not None:
            freq_factors = pt.cast(pt.as_tensor_variable(freq_factors), "float32")
            if freq_factors.type.ndim != 1:
                raise TypeError(f"RopeCacheGgml: freq_factors must be a vector, got {freq_factors.type}")
            inputs.append(freq_factors)
        out = pt.tensor(dtype="float32", shape=(positions.type.shape[0], self.n_dims // 2, 2))
        return Apply(self, inputs, [out])

    def infer_shape(self, node, shapes):
        return [(shapes[0][0], self.n_dims // 2, 2)]

    def perform(self, node, inputs, output_storage):
        # the Python linker only (C is the loops above); cos/sin are numpy's here, not glibc's
        positions = np.asarray(inputs[0], dtype=np.int64)
        ff = np.asarray(inputs[1], dtype=np.float32)[: self.n_dims // 2] if len(inputs) > 1 else None
        output_storage[0][0] = rope_cache_numpy(self, positions, ff)

    def c_support_code(self, **kwargs):
        return ROPE_C

    def c_compile_args(self, **kwargs):
        return _C_ARGS

    def c_code(self, node, name, inputs, outputs, sub):
        pos = inputs[0]
        ff = inputs[1] if len(inputs) > 1 else None
        (out,) = outputs
        fail = sub["fail"]
        n_pairs = self.n_dims // 2
        ff_check = (
            f"""
            if (PyArray_DIM({ff}, 0) < {n_pairs}) {{
                PyErr_Format(PyExc_ValueError, "RopeCacheGgml: %lld frequency factors for {n_pairs} pairs", (long long)PyArray_DIM({ff}, 0));
                Py_DECREF(pc_); {fail}
            }}"""
            if ff
            else ""
        )
        ff_ptr = f"(const float *)PyArray_DATA({ff})" if ff else "NULL"
        ff_stride = f"(long long)(PyArray_STRIDE({ff}, 0) / 4)" if ff else "1"
        return f"""
        {{
            PyArrayObject *pc_ = PyArray_GETCONTIGUOUS({pos});
            if (!pc_) {{ {fail} }}
            {ff_check}
            npy_intp dims_[3] = {{PyArray_DIM(pc_, 0), {n_pairs}, 2}};
            if (!{out} || PyArray_DIM({out}, 0) != dims_[0] || !PyArray_IS_C_CONTIGUOUS({out})) {{
                Py_XDECREF({out});
                {out} = (PyArrayObject *)PyArray_EMPTY(3, dims_, NPY_FLOAT32, 0);
                if (!{out}) {{ Py_DECREF(pc_); {fail} }}
            }}
            alchemist_rope::cache((const int64_t *)PyArray_DATA(pc_), (long long)dims_[0], {ff_ptr}, {ff_stride},
                {self.n_dims}, (float){self.freq_base!r}, (float){self.freq_scale!r}, (float){self.ext_factor!r},
                (float){self.attn_factor!r}, (float){self.beta_fast!r}, (float){self.beta_slow!r}, {self.n_ctx_orig},
                (float *)PyArray_DATA({out}));
            Py_DECREF(pc_);
        }}
        """

    def c_code_cache_version(self):
        return (1, _C_VERSION)


class RopeGgml(COp):
    """x float32 (T, heads, head_dim), cache (T, n_dims/2, 2) from RopeCacheGgml -> x with its first n_dims dims
    of every head rotated as ggml rotates them ("neox" or "norm" pairs; module docstring)."""

    computes_ggml_kernel = True  # kernels.expansion: JAX and MLX call its C code where they can

    __props__ = ("style", "n_dims")

    def __init__(self, style: str, n_dims: int):
        if style not in STYLES:
            raise ValueError(f"RopeGgml: style must be one of {STYLES}, got {style!r}")
        if n_dims < 2 or n_dims % 2:
            raise ValueError(f"RopeGgml: n_dims must be even and >= 2, got {n_dims}")
        self.style = style
        self.n_dims = int(n_dims)

    def make_node(self, x, cache):
        x = pt.as_tensor_variable(x)
        cache = pt.as_tensor_variable(cache)
        if x.type.dtype != "float32" or x.type.ndim != 3:
            raise TypeError(f"RopeGgml: x must be a float32 (tokens, heads, head_dim) tensor, got {x.type}")
        if cache.type.dtype != "float32" or cache.type.ndim != 3:
            raise TypeError(f"RopeGgml: cache must be a float32 (tokens, pairs, 2) tensor, got {cache.type}")
        if x.type.shape[2] is not None and x.type.shape[2] < self.n_dims:
            raise TypeError(f"RopeGgml: head_dim {x.type.shape[2]} < n_dims {self.n_dims}")
        return Apply(self, [x, cache], [x.type()])

    def infer_shape(self, node, shapes):
        return [shapes[0]]

    def perform(self, node, inputs, output_storage):
        x, cache = (np.asarray(v, dtype=np.float32) for v in inputs)
        output_storage[0][0] = rotate_numpy(x, cache, self.style, self.n_dims)

    def c_support_code(self, **kwargs):
        return ROPE_C

    def c_compile_args(self, **kwargs):
        return _C_ARGS

    def c_code(self, node, name, inputs, outputs, sub):
        x, cache = inputs
        (y,) = outputs
        fail = sub["fail"]
        n_pairs = self.n_dims // 2
        neox = int(self.style == "neox")
        return f"""
        {{
            PyArrayObject *xc_ = PyArray_GETCONTIGUOUS({x});
            if (!xc_) {{ {fail} }}
            PyArrayObject *cc_ = PyArray_GETCONTIGUOUS({cache});
            if (!cc_) {{ Py_DECREF(xc_); {fail} }}
            if (PyArray_DIM(cc_, 0) != PyArray_DIM(xc_, 0) || PyArray_DIM(cc_, 1) != {n_pairs} || PyArray_DIM(cc_, 2) != 2
                || PyArray_DIM(xc_, 2) < {self.n_dims}) {{
                PyErr_Format(PyExc_ValueError, "RopeGgml: x (%lld, %lld, %lld) and cache (%lld, %lld, %lld) do not match",
                    (long long)PyArray_DIM(xc_, 0), (long long)PyArray_DIM(xc_, 1), (long long)PyArray_DIM(xc_, 2),
                    (long long)PyArray_DIM(cc_, 0), (long long)PyArray_DIM(cc_, 1), (long long)PyArray_DIM(cc_, 2));
                Py_DECREF(xc_); Py_DECREF(cc_); {fail}
            }}
            if (!{y} || !PyArray_CompareLists(PyArray_DIMS({y}), PyArray_DIMS(xc_), 3) || !PyArray_IS_C_CONTIGUOUS({y})) {{
                Py_XDECREF({y});
                {y} = (PyArrayObject *)PyArray_EMPTY(3, PyArray_DIMS(xc_), NPY_FLOAT32, 0);
                if (!{y}) {{ Py_DECREF(xc_); Py_DECREF(cc_); {fail} }}
            }}
            alchemist_rope::rotate((const float *)PyArray_DATA(xc_), (const float *)PyArray_DATA(cc_),
                (float *)PyArray_DATA({y}), (long long)PyArray_DIM(xc_, 0), (long long)PyArray_DIM(xc_, 1),
                (long long)PyArray_DIM(xc_, 2), {self.n_dims}, {neox});
            Py_DECREF(xc_);
            Py_DECREF(cc_);
        }}
        """

    def c_code_cache_version(self):
        return (1, _C_VERSION)


# -- numpy versions (the Python linker; close to ggml's, not bit-exact: numpy's cos/sin, float64 for the fma) --
def _theta_extrap(op: RopeCacheGgml, positions: np.ndarray, ff) -> np.ndarray:
    n_pairs = op.n_dims // 2
    theta_scale = np.float32(np.float32(op.freq_base) ** np.float32(-2.0 / op.n_dims))
    steps = np.concatenate(
        [positions.astype(np.float32)[:, None], np.full((len(positions), n_pairs - 1), theta_scale)], 1
    )
    theta = np.cumprod(steps.astype(np.float32), axis=1, dtype=np.float32)  # sequential: ggml's running product
    return theta if ff is None else (theta / ff[None, :n_pairs]).astype(np.float32)


def rope_cache_numpy(op: RopeCacheGgml, positions: np.ndarray, ff=None) -> np.ndarray:
    extrap = _theta_extrap(op, positions, ff)
    theta = (np.float32(op.freq_scale) * extrap).astype(np.float32)
    mscale = np.float32(op.attn_factor)
    if op.ext_factor != 0.0:
        mix = _yarn_mix(op)[None, :]
        theta = (theta.astype(np.float64) * (1 - mix) + (extrap * mix).astype(np.float32)).astype(np.float32)
        mscale = np.float32(mscale * np.float32(1 + 0.1 * np.log(1 / np.float64(op.freq_scale))))
    return np.stack([np.cos(theta) * mscale, np.sin(theta) * mscale], axis=-1).astype(np.float32)


def _yarn_mix(op: RopeCacheGgml) -> np.ndarray:
    def corr_dim(n_rot):
        return op.n_dims * np.log(op.n_ctx_orig / (n_rot * 2 * np.pi)) / (2 * np.log(op.freq_base))

    low = max(0.0, np.floor(corr_dim(op.beta_fast)))
    high = min(op.n_dims - 1.0, np.ceil(corr_dim(op.beta_slow)))
    y = (np.arange(op.n_dims // 2) - low) / max(0.001, high - low)
    return ((1 - np.clip(y, 0, 1)) * op.ext_factor).astype(np.float32)


def rotate_numpy(x: np.ndarray, cache: np.ndarray, style: str, n_dims: int) -> np.ndarray:
    cos, sin = cache[:, None, :, 0], cache[:, None, :, 1]
    y = x.copy()
    if style == "neox":
        x0, x1 = x[..., : n_dims // 2], x[..., n_dims // 2 : n_dims]
    else:
        x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
    d = np.float64
    y0 = (x0.astype(d) * cos - (x1 * sin).astype(np.float32)).astype(np.float32)
    y1 = (x0.astype(d) * sin + (x1 * cos).astype(np.float32)).astype(np.float32)
    if style == "neox":
        y[..., : n_dims // 2], y[..., n_dims // 2 : n_dims] = y0, y1
    else:
        y[..., 0:n_dims:2], y[..., 1:n_dims:2] = y0, y1
    return y


# -- the same RoPE as float32 PyTensor ops (JAX, MLX) -----------------------------------------------------
def rope_cache_formula(op: RopeCacheGgml, positions, freq_factors=None):
    """ggml's cache as PyTensor ops: the running product of the angle (a cumprod), then cos/sin of the backend."""
    n_pairs = op.n_dims // 2
    theta_scale = np.float32(np.float32(op.freq_base) ** np.float32(-2.0 / op.n_dims))
    p = pt.cast(positions, "float32")[:, None]
    steps = pt.concatenate([p, pt.alloc(theta_scale, p.shape[0], n_pairs - 1)], axis=1)
    extrap = pt.cumprod(steps, axis=1)
    if freq_factors is not None:
        extrap = extrap / freq_factors[None, :n_pairs]
    theta = np.float32(op.freq_scale) * extrap
    mscale = np.float32(op.attn_factor)
    if op.ext_factor != 0.0:
        mix = _yarn_mix(op)[None, :]
        theta = theta * (np.float32(1) - mix) + extrap * mix
        mscale = np.float32(mscale * np.float32(1 + 0.1 * np.log(1 / np.float64(op.freq_scale))))
    return pt.stack([pt.cos(theta) * mscale, pt.sin(theta) * mscale], axis=-1)


def rope_formula(x, cache, style: str, n_dims: int):
    """The rotation as PyTensor ops (the generated modules' formula) with cos/sin read from `cache`."""
    cos, sin = cache[:, None, :, 0], cache[:, None, :, 1]
    if style == "neox":
        x1, x2 = x[:, :, : n_dims // 2], x[:, :, n_dims // 2 : n_dims]
        rotated = pt.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        pairs = x[:, :, :n_dims].reshape((x.shape[0], x.shape[1], n_dims // 2, 2))
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rotated = pt.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(
            (x.shape[0], x.shape[1], n_dims)
        )
    if x.type.shape[2] == n_dims:
        return rotated
    return pt.concatenate([rotated, x[:, :, n_dims:]], axis=-1)


def rope_cache_ggml(positions, n_dims: int, freq_base: float, freq_factors=None, **params):
    """ggml's (T, n_dims/2, 2) (cos, sin) cache at `positions` (the Op; its formula where no C code runs it)."""
    return RopeCacheGgml(n_dims, freq_base, **params)(positions, freq_factors)


def rope_ggml(x, cache, style: str, n_dims: int):
    """x (T, heads, head_dim) rotated with a cache from rope_cache_ggml, as ggml rotates ("neox" or "norm")."""
    return RopeGgml(style, n_dims)(x, cache)


@node_rewriter([RopeCacheGgml, RopeGgml])
def expand_rope_ggml(fgraph, node):
    if isinstance(node.op, RopeCacheGgml):
        return [rope_cache_formula(node.op, *node.inputs)]
    return [rope_formula(*node.inputs, node.op.style, node.op.n_dims)]


register_expansion("alchemist_expand_rope_ggml", expand_rope_ggml, backends=("jax", "mlx"))
# on Numba only without the ops library (otherwise Numba calls the C code: kernels.numba_ops)
register_numba_expansion("alchemist_expand_rope_ggml_numba", expand_rope_ggml)


# -- a generated module's rope_angles() / rope() computing as ggml does ------------------------------------
def yarn_attn_factor(freq_scale: float, attn_factor: float) -> float:
    """The attn_factor llama.cpp hands ggml_rope_ext for YaRN (llama_context: get_mscale(factor, 1) times
    1 / (1 + 0.1 ln factor), times rope.scaling.attn_factor; libllama is compiled without FMA contraction)."""
    from alchemist.libm import f32 as libm_f32

    logf, f = libm_f32("logf"), np.float32
    factor = f(1) / f(freq_scale)
    mscale = f(1) if factor <= 1 else f(f(f(0.1) * f(logf(factor))) + f(1))
    return float(f(f(mscale * f(f(1) / f(f(f(0.1) * f(logf(factor))) + f(1)))) * f(attn_factor)))


def rope_style(module) -> str | None:
    """ "neox" or "norm" as the module's rope() docstring says (the templates rope_neox.j2 / rope_norm.j2)."""
    doc = getattr(getattr(module, "rope", None), "__doc__", None) or ""
    return "neox" if "NEOX style" in doc else "norm" if "NORM style" in doc else None


def ggml_rope_functions(module):
    """(rope_angles, rope) for `module` computing ggml's cache and rotation, or None when the module's RoPE is
    not one these Ops reproduce (no rope()/rope_angles(), or an unknown style)."""
    import inspect

    style = rope_style(module)
    if style is None or not hasattr(module, "rope_angles"):
        return None
    n_dims = module.ROPE_DIM  # an int, or one per layer (heads whose sizes differ by layer)
    dims_of = (lambda il: int(n_dims[il])) if isinstance(n_dims, tuple) else (lambda il: int(n_dims))
    factor_layers = getattr(module, "ROPE_FACTOR_LAYERS", None)  # the layers that divide by rope_freqs, if not all
    tensors = getattr(module, "TENSORS", {})
    attn = float(getattr(module, "ROPE_ATTN_FACTOR", 1.0))
    yarn = hasattr(module, "YARN_EXT_FACTOR")
    longrope = len(inspect.signature(module.rope_angles).parameters) == 4  # (w, il, positions, n_ctx)
    if hasattr(module, "ROPE_GGML_ATTN_FACTOR"):  # the factor the family hands ggml's rope, as the module says
        attn = float(module.ROPE_GGML_ATTN_FACTOR)
    elif yarn:
        # the module's ROPE_ATTN_FACTOR is mscale(factor) · attn_factor; llama.cpp rounds its pieces apart
        scale = float(module.ROPE_FREQ_SCALE[0])
        attn = yarn_attn_factor(scale, attn / (1.0 + 0.1 * np.log(1.0 / scale)) if scale < 1.0 else attn)

    def params(il: int) -> dict:
        p = dict(freq_scale=module.ROPE_FREQ_SCALE[il], attn_factor=attn)
        if yarn:
            p.update(
                ext_factor=module.YARN_EXT_FACTOR,
                beta_fast=module.YARN_BETA_FAST,
                beta_slow=module.YARN_BETA_SLOW,
                n_ctx_orig=module.ROPE_ORIG_CTX,
            )
        return p

    def factors(w, il: int, n_ctx=None):
        if longrope:
            return w["rope_factors_long.weight" if n_ctx > module.ROPE_ORIG_CTX else "rope_factors_short.weight"]
        if factor_layers is not None and not factor_layers[il]:
            return None
        return w["rope_freqs.weight"] if "rope_freqs.weight" in tensors else None

    if longrope:

        def rope_angles(w, il: int, positions, n_ctx: int):
            """ggml's (tokens, ROPE_DIM/2, 2) (cos, sin) cache of layer il (alchemist.kernels.rope)."""
            return rope_cache_ggml(positions, dims_of(il), module.ROPE_BASE[il], factors(w, il, n_ctx), **params(il))

    else:

        def rope_angles(w, il: int, positions):
            """ggml's (tokens, ROPE_DIM/2, 2) (cos, sin) cache of layer il (alchemist.kernels.rope)."""
            return rope_cache_ggml(positions, dims_of(il), module.ROPE_BASE[il], factors(w, il), **params(il))

    def rope(x, angles):
        """x (tokens, heads, HEAD_DIM) rotated with rope_angles' cache, as ggml rotates (alchemist.kernels.rope)."""
        return rope_ggml(x, angles, style, 2 * int(angles.type.shape[1]))  # the cache (T, n_dims / 2, 2)

    return rope_angles, rope
