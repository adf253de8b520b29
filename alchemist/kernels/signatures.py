"""The kernel libraries' C entry points, written once: the C declarations (the libraries' exported wrappers and the
JAX handlers' extern declarations), MLX's ctypes signatures and Numba's external-function types all come from
ENTRY_POINTS (a leaf module: alchemist.kernels.native, jax_ffi and mlx_host read it).

Arrays cross as addresses (`ptr`: uintptr_t in C, so Numba and ctypes pass integers), sizes as `i64`.
"""

from __future__ import annotations

# entry point -> (return type, ((argument, type), ...)); types: int (C int), i64 (long long), f32, ptr, void
ENTRY_POINTS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "matmul": (
        "int",
        (("type_index", "int"), ("ggml", "int"), ("W", "ptr"), ("n_out", "i64"), ("n_in", "i64"), ("X", "ptr"),
         ("T", "i64"), ("Y", "ptr")),
    ),  # fmt: skip
    "rms_norm": ("void", (("x", "ptr"), ("w", "ptr"), ("y", "ptr"), ("rows", "i64"), ("n", "i64"), ("eps", "f32"))),
    "rope_cache": (
        "void",
        (("pos", "ptr"), ("n_pos", "i64"), ("ff", "ptr"), ("ff_stride", "i64"), ("n_dims", "int"),
         ("freq_base", "f32"), ("freq_scale", "f32"), ("ext_factor", "f32"), ("attn_factor", "f32"),
         ("beta_fast", "f32"), ("beta_slow", "f32"), ("n_ctx_orig", "int"), ("out", "ptr")),
    ),  # fmt: skip
    "rope": (
        "void",
        (("x", "ptr"), ("cache", "ptr"), ("y", "ptr"), ("n_pos", "i64"), ("n_head", "i64"), ("head_dim", "i64"),
         ("n_dims", "int"), ("neox", "int")),
    ),  # fmt: skip
    "attention": (
        "int",
        (("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("qpos", "ptr"), ("kpos", "ptr"), ("sinks", "ptr"), ("out", "ptr"),
         ("B", "i64"), ("T", "i64"), ("S", "i64"), ("H", "i64"), ("KVH", "i64"), ("D", "i64"), ("window", "i64"),
         ("scale", "f32"), ("softcap", "f32")),
    ),  # fmt: skip
    "silu": ("void", (("x", "ptr"), ("y", "ptr"), ("rows", "i64"), ("n", "i64"))),
    "gelu": ("void", (("x", "ptr"), ("y", "ptr"), ("n", "i64"))),
}

_C = {"int": "int", "i64": "long long", "f32": "float", "ptr": "uintptr_t", "void": "void"}


def c_declaration(name: str, symbol: str) -> str:
    """`ret symbol(type arg, ...)`: the entry point `name` exported (or declared) under `symbol`."""
    ret, args = ENTRY_POINTS[name]
    return f"{_C[ret]} {symbol}(" + ", ".join(f"{_C[t]} {a}" for a, t in args) + ")"


def ctypes_signature(name: str) -> tuple[object, list]:
    """(restype, argtypes) for ctypes."""
    import ctypes

    types = {"int": ctypes.c_int, "i64": ctypes.c_longlong, "f32": ctypes.c_float, "ptr": ctypes.c_void_p}
    ret, args = ENTRY_POINTS[name]
    return (None if ret == "void" else types[ret]), [types[t] for _, t in args]


def numba_signature(name: str):
    """The Numba function type an ExternalFunction of the entry point takes."""
    from numba import types

    kinds = {"int": types.int32, "i64": types.int64, "f32": types.float32, "ptr": types.uintp, "void": types.void}
    ret, args = ENTRY_POINTS[name]
    return kinds[ret](*(kinds[t] for _, t in args))
