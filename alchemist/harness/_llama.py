"""Low-level glue to llama.cpp through llama-cpp-python's ctypes bindings (`llama_cpp.llama_cpp`).

Everything that touches raw pointers lives here: the quiet log callback, one-time backend init, the
`ggml_tensor` struct (mirrored from the vendored `ggml/include/ggml.h`), and the few libggml-base
functions the graph-evaluation callback needs (`ggml_nbytes`, `ggml_get_name`, `ggml_n_dims`,
`ggml_op_name`, `ggml_backend_tensor_get`), plus ggml's row quantizer and dequantizers for fixtures and tests.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

import numpy as np

try:  # imported lazily by callers through `load()` so that alchemist works without the oracle extra
    import llama_cpp
    import llama_cpp.llama_cpp as llc
except ImportError:  # pragma: no cover - exercised only without llama-cpp-python
    llama_cpp = None
    llc = None

from alchemist.errors import AlchemistError


class OracleError(AlchemistError):
    """llama.cpp refused to load, decode or quantize; carries llama.cpp's last error log lines."""


def require() -> None:
    if llc is None:
        raise OracleError("llama-cpp-python is not installed: pip install 'alchemist[oracle]'")


# --------------------------------------------------------------------------------------------------
# Logging: llama.cpp logs every load/quantize step to stderr. Keep errors (and their continuation
# lines), remember the last few messages for error reports, drop the rest unless ALCHEMIST_ORACLE_VERBOSE.

GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5
_log_lock = threading.Lock()
_recent: list[str] = []
_last_level = 0
_verbose = bool(os.environ.get("ALCHEMIST_ORACLE_VERBOSE"))


def _log(level: int, text: bytes, _user_data) -> None:
    global _last_level
    try:
        msg = text.decode("utf-8", "replace") if text else ""
        eff = _last_level if level == GGML_LOG_LEVEL_CONT else level
        _last_level = eff
        with _log_lock:
            _recent.append(msg)
            del _recent[:-64]
        if _verbose or eff == GGML_LOG_LEVEL_ERROR:
            sys.stderr.write(msg)
    except Exception:  # never let an exception cross into C
        pass


_log_cb = None
_init_done = False
_init_lock = threading.Lock()


def init() -> None:
    """Install the quiet log callback and initialise the llama.cpp backend (once per process)."""
    global _log_cb, _init_done
    require()
    with _init_lock:
        if _init_done:
            return
        _log_cb = llc.llama_log_callback(_log)  # keep a reference: C holds the pointer forever
        llc.llama_log_set(_log_cb, ctypes.c_void_p(0))
        llc.llama_backend_init()
        _init_done = True


def recent_log(n: int = 8) -> str:
    with _log_lock:
        return "".join(_recent[-n:]).strip()


def clear_log() -> None:
    with _log_lock:
        _recent.clear()


# --------------------------------------------------------------------------------------------------
# ggml tensors

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` from ggml/include/ggml.h (ggml 0.25.x)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_I32 = 26
GGML_TYPE_BF16 = 30
# element types a callback can copy out as plain arrays (quantized intermediates never occur on CPU)
_NP_DTYPES = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16, GGML_TYPE_I32: np.int32}


class _Ggml:
    """The handful of libggml-base functions used on graph tensors."""

    def __init__(self) -> None:
        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        candidates = sorted(lib_dir.glob("libggml-base.*")) + sorted(lib_dir.glob("ggml-base.*"))
        lib = None
        for cand in candidates:
            try:
                lib = ctypes.CDLL(str(cand))
                break
            except OSError:
                continue
        if lib is None:  # fall back to symbols reachable through libllama's dependencies
            lib = llc._lib
        self.lib = lib
        p = ctypes.c_void_p
        self.nbytes = self._bind("ggml_nbytes", [p], ctypes.c_size_t)
        self.get_name = self._bind("ggml_get_name", [p], ctypes.c_char_p)
        self.n_dims = self._bind("ggml_n_dims", [p], ctypes.c_int)
        self.op_name = self._bind("ggml_op_name", [ctypes.c_int], ctypes.c_char_p)
        self.type_name = self._bind("ggml_type_name", [ctypes.c_int], ctypes.c_char_p)
        self.tensor_get = self._bind("ggml_backend_tensor_get", [p, p, ctypes.c_size_t, ctypes.c_size_t], None)
        i64 = ctypes.c_int64
        # ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row, imatrix): llama.cpp's quantizer, any type
        self.quantize_chunk = self._bind("ggml_quantize_chunk", [ctypes.c_int, p, p, i64, i64, i64, p], ctypes.c_size_t)

    def dequantize_row(self, ggml_type: str):
        """ggml's dequantize_row_<type>(blocks, float *out, n_values): llama.cpp's own dequantizer."""
        return self._bind(
            f"dequantize_row_{ggml_type.lower()}", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
        )

    def _bind(self, name, argtypes, restype):
        fn = getattr(self.lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
        return fn


_ggml: _Ggml | None = None


def ggml() -> _Ggml:
    global _ggml
    if _ggml is None:
        require()
        _ggml = _Ggml()
    return _ggml


def tensor_name(ptr: int) -> str:
    raw = ggml().get_name(ptr)
    return raw.decode("utf-8", "replace") if raw else ""


def tensor_to_numpy(ptr: int, rank: int = 2) -> tuple[np.ndarray, dict]:
    """Copy a computed graph tensor out as a numpy array (ne reversed), float32 for float types.

    Trailing size-1 dimensions are dropped down to `max(ggml_n_dims, rank)` dimensions, so a
    (n_embd, n_tokens) activation stays 2-D even for a single token.
    Strided views are honoured through `nb` (the bytes between the first and last element are read
    with `ggml_backend_tensor_get`, which works for host and device buffers alike).
    """
    g = ggml()
    t = GgmlTensor.from_address(ptr)
    ttype = int(t.type)
    info = {
        "type": g.type_name(ttype).decode(),
        "op": g.op_name(int(t.op)).decode(),
        "ne": tuple(int(x) for x in t.ne),
        "nb": tuple(int(x) for x in t.nb),
    }
    dtype = _NP_DTYPES.get(ttype)
    if dtype is None:
        raise OracleError(f"cannot copy tensor {tensor_name(ptr)!r} of type {info['type']}")
    n = g.nbytes(ptr)
    buf = np.empty(max(int(n), 1), dtype=np.uint8)
    if n:
        g.tensor_get(ptr, buf.ctypes.data, 0, n)
    k = max(int(g.n_dims(ptr)), rank)
    k = min(k, GGML_MAX_DIMS)
    ne = info["ne"][:k]
    nb = info["nb"][:k]
    view = np.ndarray(shape=ne[::-1], dtype=dtype, buffer=buf, offset=0, strides=nb[::-1])
    out = view.astype(np.float32 if dtype is not np.int32 else np.int32, copy=True)
    return out, info


# --------------------------------------------------------------------------------------------------
# ggml-cpu's own matmul pieces (activation quantizers, per-row dot products, the GELU table): the
# reference the numerics="ggml" kernels are tested against.

# vec_dot_type per weight type (ggml-cpu.c type_traits_cpu) and that type's (block values, block bytes)
VEC_DOT_TYPE = {
    "Q8_0": "q8_0", "Q4_0": "q8_0", "Q5_0": "q8_0", "MXFP4": "q8_0", "IQ4_NL": "q8_0", "NVFP4": "q8_0", "Q1_0": "q8_0",
    "Q4_1": "q8_1",
    "Q5_1": "q8_1",
}  # fmt: skip
ACTIVATION_BLOCKS = {"q8_0": (32, 34), "q8_1": (32, 36), "q8_K": (256, 4 + 256 + 32)}


class GgmlCpu:
    """libggml-cpu's quantize_row_q8_* / ggml_vec_dot_<type>_q8_*, ggml_vec_silu_f32 / ggml_vec_swiglu_f32 and
    ggml_table_gelu_f16, through ctypes."""

    def __init__(self) -> None:
        require()
        lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
        lib.ggml_cpu_init()
        self.lib = lib

    @staticmethod
    def activation_type(ggml_type: str) -> str:
        return VEC_DOT_TYPE.get(ggml_type, "q8_K")

    def quantize_row(self, ggml_type: str, x: np.ndarray) -> np.ndarray:
        """x (n,) float32 -> the bytes of ggml's activation blocks for a `ggml_type` weight."""
        kind = self.activation_type(ggml_type)
        qk, bs = ACTIVATION_BLOCKS[kind]
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros(x.size // qk * bs, np.uint8)
        fn = getattr(self.lib, f"quantize_row_{kind}")
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
        fn(x.ctypes.data, out.ctypes.data, x.size)
        return out

    def vec_dot(self, ggml_type: str, w_row: np.ndarray, xq: np.ndarray, n: int) -> float:
        """ggml_vec_dot_<type>_<vec_dot_type>: one weight row (GGUF bytes) . quantized activations."""
        name = f"ggml_vec_dot_{ggml_type.lower().replace('_k', '_K')}_{self.activation_type(ggml_type)}"
        fn = getattr(self.lib, name)
        p, sz = ctypes.c_void_p, ctypes.c_size_t
        fn.argtypes, fn.restype = [ctypes.c_int, p, sz, p, sz, p, sz, ctypes.c_int], None
        w_row, xq = np.ascontiguousarray(w_row), np.ascontiguousarray(xq)
        s = np.zeros(1, np.float32)
        fn(n, s.ctypes.data, 0, w_row.ctypes.data, 0, xq.ctypes.data, 0, 1)
        return float(s[0])

    def vec_swiglu(self, x: np.ndarray, g: np.ndarray | None = None) -> np.ndarray:
        """ggml_vec_swiglu_f32 of one row: silu(x) * g (ggml_vec_silu_f32, silu(x) alone, when g is None)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty_like(x)
        p = ctypes.c_void_p
        if g is None:
            fn = self.lib.ggml_vec_silu_f32
            fn.argtypes, fn.restype = [ctypes.c_int, p, p], None
            fn(x.size, y.ctypes.data, x.ctypes.data)
        else:
            g = np.ascontiguousarray(g, dtype=np.float32)
            fn = self.lib.ggml_vec_swiglu_f32
            fn.argtypes, fn.restype = [ctypes.c_int, p, p, p], None
            fn(x.size, y.ctypes.data, x.ctypes.data, g.ctypes.data)
        return y

    def gelu_table(self) -> np.ndarray:
        """ggml_table_gelu_f16 as float32 (index: the fp16 bit pattern)."""
        table = (ctypes.c_uint16 * 65536).in_dll(self.lib, "ggml_table_gelu_f16")
        return np.ctypeslib.as_array(table).copy().view(np.float16).astype(np.float32)


_ggml_cpu: GgmlCpu | None = None


def ggml_cpu() -> GgmlCpu:
    global _ggml_cpu
    if _ggml_cpu is None:
        _ggml_cpu = GgmlCpu()
    return _ggml_cpu
