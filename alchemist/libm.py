"""The C library's float32 functions (logf, expf, tanhf): the very ones llama.cpp and ggml call, whose roundings
numpy's float32 functions do not always share. Loaded once per process."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache


@lru_cache(maxsize=None)
def f32(name: str):
    """libm's `name` (float -> float) as a ctypes function; OSError or AttributeError where there is none."""
    fn = getattr(ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6"), name)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn
