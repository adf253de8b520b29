"""Numba kernels for `QuantizedMatmul` and their registration with PyTensor's Numba backend.

A QuantizedMatmul compiled for Numba calls the C backend's kernels when they could be built into a shared
library (alchemist.kernels.native); the kernels below serve when they could not (no C++ compiler) or
ALCHEMIST_NUMBA_NATIVE=0 asks for them.

Output rows are split into `prange` chunks. Per row: the row is dequantized into a float32 buffer exactly as
gguf-py does it (same float32 operations: d * q, d * q + m, dl * q - ml), then dotted with each token.
The dequantization runs with fastmath=False; the dot alone is compiled with fastmath={"reassoc"} so that
LLVM may vectorize its float32 sum (without it Numba runs ~5x slower; no nnan/ninf flags, so nan and inf
propagate as usual). So results equal dequantize-then-matmul up to float32 summation order.
One cached driver serves every type (`kind` selects the decoder), so Numba compiles it once per machine.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numba
import numpy as np
from numba import prange

from alchemist.kernels import activations, formats
from alchemist.kernels import iq_grids
from alchemist.kernels.native import TYPE_INDEX

KINDS = TYPE_INDEX  # one driver serves every type; the C kernels' library takes the same indices
_QK = np.array([formats.BLOCK_SIZES[t][0] for t in formats.SUPPORTED_TYPES], dtype=np.int64)
K_Q4_0, K_Q4_1, K_Q5_0, K_Q5_1, K_Q8_0, K_Q2_K, K_Q3_K, K_Q4_K, K_Q5_K, K_Q6_K, K_MXFP4 = (
    KINDS[t] for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
)
K_IQ4_NL, K_IQ4_XS, K_TQ2_0, K_TQ1_0 = KINDS["IQ4_NL"], KINDS["IQ4_XS"], KINDS["TQ2_0"], KINDS["TQ1_0"]
K_IQ2_XXS, K_IQ2_XS, K_IQ2_S, K_IQ3_XXS, K_IQ3_S, K_IQ1_S, K_IQ1_M = (KINDS[t] for t in iq_grids.GRID_TYPES)
K_NVFP4, K_Q1_0 = KINDS["NVFP4"], KINDS["Q1_0"]
_TQ1_0_DIGITS = formats.TQ1_0_DIGITS
# the grid i-quants' tables (alchemist.kernels.iq_grids): magnitudes per grid row, KSIGNS' sign bytes
_IQ2_XXS_GRID, _IQ2_XS_GRID, _IQ2_S_GRID, _IQ3_XXS_GRID, _IQ3_S_GRID, _IQ1_S_GRID = (
    iq_grids.grid(t).astype(np.float32) for t in iq_grids.GRIDS
)
_KSIGNS = iq_grids.KSIGNS.astype(np.int64)

_jit = numba.njit(cache=True, fastmath=False)
# inlined at Numba IR level into the kernel, where LLVM can see that the row buffer is a fresh allocation
# that aliases nothing: the dequantization loops then vectorize without run-time alias checks (~3x faster)
_jit_inline = numba.njit(cache=True, fastmath=False, inline="always")


_F16 = formats.F16_TABLE  # 256 KB, embedded as a constant (a table lookup is ~3x faster than ldexp here)
_E8M0_HALF = formats.E8M0_HALF_TABLE  # MXFP4 block scale byte -> 2^(e - 128), exact
_KVALUES_MXFP4 = formats.KVALUES_MXFP4.astype(np.float32)  # MXFP4 4-bit code -> doubled E2M1 value
_KVALUES_IQ4NL = formats.KVALUES_IQ4NL.astype(np.float32)  # IQ4_NL / IQ4_XS 4-bit code -> grid value
_UE4M3_HALF = formats.UE4M3_HALF_TABLE  # NVFP4 sub-block scale byte -> its E4M3 value halved, exact


@_jit_inline
def _f16(lo, hi):
    return _F16[np.int64(lo) | (np.int64(hi) << 8)]


@_jit_inline
def _k_scale_min(j, r, s):
    """K-quant 6-bit scale and min j of 8, the 12 packed bytes at r[s:s+12]."""
    if j < 4:
        return np.int64(r[s + j] & 63), np.int64(r[s + j + 4] & 63)
    sc = (np.int64(r[s + j + 4]) & 0xF) | ((np.int64(r[s + j - 4]) >> 6) << 4)
    mn = (np.int64(r[s + j + 4]) >> 4) | ((np.int64(r[s + j]) >> 6) << 4)
    return sc, mn


@_jit_inline
def _int8(v):
    return v - ((v >> 7) << 8)


# One function per format (LLVM optimizes each on its own: ~3x faster than one function with every branch).
# n16 is 16, passed at run time: with constant trip counts LLVM unrolls the inner loops and then vectorizes
# the loop over blocks with gathers, ~3x slower. Each writes y (float32, nb * QK) from row r (uint8) with
# gguf-py's float32 operations.


@_jit_inline
def _dq_q8_0(kind, r, nb, y, n16):
    n32 = 2 * n16
    r8 = r.view(np.int8)
    for b in range(nb):
        p, o = 34 * b, 32 * b
        d = _f16(r[p], r[p + 1])
        for j in range(n32):
            y[o + j] = np.float32(r8[p + 2 + j]) * d


@_jit_inline
def _dq_q4_0_q5_0(kind, r, nb, y, n16):
    n32 = 2 * n16
    bs = 18 if kind == K_Q4_0 else 22
    for b in range(nb):
        p, o = bs * b, 32 * b
        d = _f16(r[p], r[p + 1])
        if kind == K_Q4_0:
            qh = np.int64(0)
            off = 8
            qs = p + 2
        else:
            qh = (
                np.int64(r[p + 2]) | (np.int64(r[p + 3]) << 8) | (np.int64(r[p + 4]) << 16) | (np.int64(r[p + 5]) << 24)
            )
            off = 16
            qs = p + 6
        for j in range(n16):
            v = np.int64(r[qs + j])
            y[o + j] = d * np.float32(((v & 0xF) | (((qh >> j) & 1) << 4)) - off)
            y[o + j + 16] = d * np.float32(((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off)


@_jit_inline
def _dq_q4_1_q5_1(kind, r, nb, y, n16):
    n32 = 2 * n16
    bs = 20 if kind == K_Q4_1 else 24
    for b in range(nb):
        p, o = bs * b, 32 * b
        d = _f16(r[p], r[p + 1])
        m = _f16(r[p + 2], r[p + 3])
        if kind == K_Q4_1:
            qh = np.int64(0)
            qs = p + 4
        else:
            qh = (
                np.int64(r[p + 4]) | (np.int64(r[p + 5]) << 8) | (np.int64(r[p + 6]) << 16) | (np.int64(r[p + 7]) << 24)
            )
            qs = p + 8
        for j in range(n16):
            v = np.int64(r[qs + j])
            y[o + j] = d * np.float32((v & 0xF) | (((qh >> j) & 1) << 4)) + m
            y[o + j + 16] = d * np.float32((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m


@_jit_inline
def _dq_q2_k(kind, r, nb, y, n16):
    n32 = 2 * n16
    for b in range(nb):
        p, o = 84 * b, 256 * b
        d = _f16(r[p + 80], r[p + 81])
        dmin = _f16(r[p + 82], r[p + 83])
        for h in range(2):
            for s in range(4):
                for half in range(2):
                    sc = np.int64(r[p + h * 8 + s * 2 + half])
                    dl = d * np.float32(sc & 0xF)
                    ml = dmin * np.float32(sc >> 4)
                    q0 = p + 16 + h * 32 + half * 16
                    o0 = o + h * 128 + s * 32 + half * 16
                    for l in range(n16):
                        y[o0 + l] = dl * np.float32((np.int64(r[q0 + l]) >> (2 * s)) & 3) - ml


@_jit_inline
def _dq_q3_k(kind, r, nb, y, n16):
    n32 = 2 * n16
    for b in range(nb):
        p, o = 110 * b, 256 * b
        d = _f16(r[p + 108], r[p + 109])
        for h in range(2):
            for s in range(4):
                i = h * 4 + s
                for half in range(2):
                    k = h * 8 + s * 2 + half
                    if k < 8:
                        low = np.int64(r[p + 96 + k]) & 0xF
                    else:
                        low = np.int64(r[p + 96 + k - 8]) >> 4
                    high = (np.int64(r[p + 104 + (k & 3)]) >> (2 * (k >> 2))) & 3
                    dl = d * np.float32((low | (high << 4)) - 32)
                    q0 = p + 32 + h * 32 + half * 16
                    m0 = p + half * 16
                    o0 = o + h * 128 + s * 32 + half * 16
                    for l in range(n16):
                        v = ((np.int64(r[q0 + l]) >> (2 * s)) & 3) - 4 + 4 * ((np.int64(r[m0 + l]) >> i) & 1)
                        y[o0 + l] = dl * np.float32(v)


@_jit_inline
def _dq_q4_k_q5_k(kind, r, nb, y, n16):
    n32 = 2 * n16
    bs = 144 if kind == K_Q4_K else 176
    for b in range(nb):
        p, o = bs * b, 256 * b
        d = _f16(r[p], r[p + 1])
        dmin = _f16(r[p + 2], r[p + 3])
        qs = p + 16 if kind == K_Q4_K else p + 48
        for c in range(4):
            for a in range(2):
                j = 2 * c + a
                sc, mn = _k_scale_min(j, r, p + 4)
                dl = d * np.float32(sc)
                ml = dmin * np.float32(mn)
                for l in range(n32):
                    v = (np.int64(r[qs + c * 32 + l]) >> (4 * a)) & 0xF
                    if kind == K_Q5_K:
                        v |= ((np.int64(r[p + 16 + l]) >> j) & 1) << 4
                    y[o + j * 32 + l] = dl * np.float32(v) - ml


@_jit_inline
def _dq_q6_k(kind, r, nb, y, n16):
    n32 = 2 * n16
    for b in range(nb):
        p, o = 210 * b, 256 * b
        d = _f16(r[p + 208], r[p + 209])
        for h in range(2):
            for s in range(4):
                for half in range(2):
                    sc = np.int64(r[p + 192 + h * 8 + s * 2 + half])
                    dl = d * np.float32(_int8(sc))
                    lo0 = p + h * 64 + (s & 1) * 32 + half * 16
                    hi0 = p + 128 + h * 32 + half * 16
                    o0 = o + h * 128 + s * 32 + half * 16
                    sh_lo, sh_hi = 4 * (s >> 1), 2 * s
                    for l in range(n16):
                        lo = (np.int64(r[lo0 + l]) >> sh_lo) & 0xF
                        hi = (np.int64(r[hi0 + l]) >> sh_hi) & 3
                        y[o0 + l] = dl * np.float32((lo | (hi << 4)) - 32)


@_jit_inline
def _dq_mxfp4(kind, r, nb, y, n16):
    for b in range(nb):
        p, o = 17 * b, 32 * b
        d = _E8M0_HALF[r[p]]
        for j in range(n16):
            v = np.int64(r[p + 1 + j])
            y[o + j] = _KVALUES_MXFP4[v & 0xF] * d
            y[o + j + 16] = _KVALUES_MXFP4[v >> 4] * d


@_jit_inline
def _dq_q1_0(kind, r, nb, y, n16):
    for b in range(nb):
        p, o = 18 * b, 128 * b
        d = _f16(r[p], r[p + 1])
        for j in range(8 * n16):
            y[o + j] = d if (np.int64(r[p + 2 + j // 8]) >> (j % 8)) & 1 else -d


@_jit_inline
def _dq_nvfp4(kind, r, nb, y, n16):
    for b in range(nb):
        p, o = 36 * b, 64 * b
        for s in range(4):
            d = _UE4M3_HALF[r[p + s]]
            for j in range(n16 // 2):
                v = np.int64(r[p + 4 + 8 * s + j])
                y[o + 16 * s + j] = _KVALUES_MXFP4[v & 0xF] * d
                y[o + 16 * s + j + 8] = _KVALUES_MXFP4[v >> 4] * d


@_jit_inline
def _dq_iq4_nl(kind, r, nb, y, n16):
    for b in range(nb):
        p, o = 18 * b, 32 * b
        d = _f16(r[p], r[p + 1])
        for j in range(n16):
            v = np.int64(r[p + 2 + j])
            y[o + j] = d * _KVALUES_IQ4NL[v & 0xF]
            y[o + j + 16] = d * _KVALUES_IQ4NL[v >> 4]


@_jit_inline
def _dq_iq4_xs(kind, r, nb, y, n16):
    for b in range(nb):
        p = 136 * b
        d = _f16(r[p], r[p + 1])
        scales_h = np.int64(r[p + 2]) | (np.int64(r[p + 3]) << 8)
        for s in range(8):
            ls = ((np.int64(r[p + 4 + s // 2]) >> (4 * (s & 1))) & 0xF) | (((scales_h >> (2 * s)) & 3) << 4)
            dl = d * np.float32(ls - 32)
            q0, o = p + 8 + 16 * s, 256 * b + 32 * s
            for j in range(n16):
                v = np.int64(r[q0 + j])
                y[o + j] = dl * _KVALUES_IQ4NL[v & 0xF]
                y[o + j + 16] = dl * _KVALUES_IQ4NL[v >> 4]


@_jit_inline
def _dq_tq2_0(kind, r, nb, y, n16):
    for b in range(nb):
        p = 66 * b
        d = _f16(r[p + 64], r[p + 65])
        for j in range(2):
            for n in range(4):
                o = 256 * b + 128 * j + 32 * n
                for c in range(2 * n16):
                    y[o + c] = d * np.float32(((np.int64(r[p + 32 * j + c]) >> (2 * n)) & 3) - 1)


@_jit_inline
def _dq_tq1_0(kind, r, nb, y, n16):
    for b in range(nb):
        p = 54 * b
        d = _f16(r[p + 52], r[p + 53])
        o = 256 * b
        for n in range(5):
            for m in range(2 * n16):
                y[o + 32 * n + m] = d * np.float32(_TQ1_0_DIGITS[n, r[p + m]] - 1)
            for m in range(n16):
                y[o + 160 + 16 * n + m] = d * np.float32(_TQ1_0_DIGITS[n, r[p + 32 + m]] - 1)
        for n in range(4):
            for j in range(4):
                y[o + 240 + 4 * n + j] = d * np.float32(_TQ1_0_DIGITS[n, r[p + 48 + j]] - 1)


@_jit_inline
def _put_group(y, o, row, bits, n, dl):
    """y[o:o+n] = dl * magnitudes `row` with the signs of `bits` (bit j: weight j negative)."""
    for j in range(n):
        y[o + j] = dl * (-row[j] if (bits >> j) & 1 else row[j])


@_jit_inline
def _dq_grid(kind, r, nb, y, n16):
    """The grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): d * MULT * (2 ls + 1) * sign * magnitude, the
    factor d * (2 ls + 1) * MULT computed first as gguf-py and ggml do (alchemist.kernels.formats)."""
    if kind == K_IQ1_S or kind == K_IQ1_M:
        _dq_iq1(kind, r, nb, y)
        return
    bs = (
        66
        if kind == K_IQ2_XXS
        else 74 if kind == K_IQ2_XS else 82 if kind == K_IQ2_S else 98 if kind == K_IQ3_XXS else 110
    )
    mult = np.float32(0.25) if kind == K_IQ3_XXS else np.float32(1.0) if kind == K_IQ3_S else np.float32(0.125)
    for b in range(nb):
        p, o = bs * b, 256 * b
        d = _f16(r[p], r[p + 1])
        for s in range(8):
            if kind == K_IQ2_XXS or kind == K_IQ3_XXS:
                a = p + 2 + 8 * s if kind == K_IQ2_XXS else p + 66 + 4 * s
                aux = np.int64(r[a + (4 if kind == K_IQ2_XXS else 0)])
                aux |= np.int64(r[a + (5 if kind == K_IQ2_XXS else 1)]) << 8
                aux |= np.int64(r[a + (6 if kind == K_IQ2_XXS else 2)]) << 16
                aux |= np.int64(r[a + (7 if kind == K_IQ2_XXS else 3)]) << 24
                dl = d * np.float32(2 * (aux >> 28) + 1) * mult
                for j in range(4):
                    signs = _KSIGNS[(aux >> (7 * j)) & 127]
                    if kind == K_IQ2_XXS:
                        _put_group(y, o + 32 * s + 8 * j, _IQ2_XXS_GRID[r[p + 2 + 8 * s + j]], signs, 8, dl)
                    else:
                        g = p + 2 + 8 * s + 2 * j
                        _put_group(y, o + 32 * s + 8 * j, _IQ3_XXS_GRID[r[g]], signs, 4, dl)
                        _put_group(y, o + 32 * s + 8 * j + 4, _IQ3_XXS_GRID[r[g + 1]], signs >> 4, 4, dl)
            elif kind == K_IQ2_XS or kind == K_IQ2_S:
                sc = np.int64(r[p + (66 if kind == K_IQ2_XS else 74) + s])
                for j in range(4):
                    dl = d * np.float32(2 * ((sc >> (4 * (j // 2))) & 15) + 1) * mult
                    if kind == K_IQ2_XS:
                        q = np.int64(r[p + 2 + 8 * s + 2 * j]) | (np.int64(r[p + 3 + 8 * s + 2 * j]) << 8)
                        _put_group(y, o + 32 * s + 8 * j, _IQ2_XS_GRID[q & 511], _KSIGNS[q >> 9], 8, dl)
                    else:
                        index = np.int64(r[p + 2 + 4 * s + j]) | ((np.int64(r[p + 66 + s]) << (8 - 2 * j)) & 0x300)
                        _put_group(y, o + 32 * s + 8 * j, _IQ2_S_GRID[index], np.int64(r[p + 34 + 4 * s + j]), 8, dl)
            else:  # IQ3_S
                ls = (np.int64(r[p + 106 + s // 2]) >> (4 * (s & 1))) & 15
                dl = d * np.float32(2 * ls + 1) * mult
                for j in range(8):
                    index = np.int64(r[p + 2 + 8 * s + j]) | ((np.int64(r[p + 66 + s]) << (8 - j)) & 256)
                    bits = np.int64(r[p + 74 + 4 * s + j // 2]) >> (4 * (j & 1))
                    _put_group(y, o + 32 * s + 4 * j, _IQ3_S_GRID[index], bits, 4, dl)


@_jit_inline
def _dq_iq1(kind, r, nb, y):
    """IQ1_S / IQ1_M: d * (2 ls + 1) * 0.125 * (8 g +- 1), g from the grid of -1, 0, 1 (alchemist.kernels.formats)."""
    bs = 50 if kind == K_IQ1_S else 56
    for b in range(nb):
        p, o = bs * b, 256 * b
        if kind == K_IQ1_S:
            d = _f16(r[p], r[p + 1])
        else:
            h = (np.int64(r[p + 49]) >> 4) | (np.int64(r[p + 51]) & 0xF0)
            h |= ((np.int64(r[p + 53]) >> 4) << 8) | ((np.int64(r[p + 55]) & 0xF0) << 8)
            d = _f16(h & 0xFF, h >> 8)
        for s in range(8):
            for l in range(4):
                if kind == K_IQ1_S:
                    h = np.int64(r[p + 34 + 2 * s]) | (np.int64(r[p + 35 + 2 * s]) << 8)
                    index = np.int64(r[p + 2 + 4 * s + l]) | (((h >> (3 * l)) & 7) << 8)
                    delta = -1 if h & 0x8000 else 1
                    ls = (h >> 12) & 7
                else:
                    nib = (np.int64(r[p + 32 + 2 * s + l // 2]) >> (4 * (l & 1))) & 15
                    index = np.int64(r[p + 4 * s + l]) | ((nib & 7) << 8)
                    delta = -1 if nib & 8 else 1
                    v = (np.int64(r[p + 48 + 2 * (s // 2)]) | (np.int64(r[p + 49 + 2 * (s // 2)]) << 8)) >> (
                        6 * (s & 1)
                    )
                    ls = (v >> (3 * (l // 2))) & 7
                dl = d * np.float32(2 * ls + 1) * np.float32(0.125)
                row = _IQ1_S_GRID[index]
                for j in range(8):
                    y[o + 32 * s + 8 * l + j] = dl * (np.float32(8) * row[j] + np.float32(delta))


@numba.njit(cache=True, fastmath={"reassoc"})
def _dot(a, b):
    """float32 dot of two contiguous vectors; LLVM may reassociate (vectorize) the sum."""
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


BLAS_MIN_T = 16  # from this many tokens on: dequantize panels of rows, multiply them with np.dot (BLAS)


@_jit
def _chunks(n_out):
    return min(n_out, 64)


@_jit
def _panel_rows(n_in, n_out):
    """Rows per dequantized panel: ~4 MB of float32."""
    return max(16, min(n_out, (1048576 // n_in) // 16 * 16))


# One driver per format, so that each is compiled (and cached) on its own, only when used. In each, for
# T < BLAS_MIN_T: output rows in prange chunks; a chunk dequantizes one row at a time into `row`, then dots
# it with every token. For T >= BLAS_MIN_T (prefill): panels of rows are dequantized (prange over rows)
# and multiplied with np.dot. n16 = 16 at run time (see above).


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_q8_0(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_q8_0(K_Q8_0, w[o0 + r], n_in // 32, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_q8_0(K_Q8_0, w[o], n_in // 32, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_q4_0(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_q4_0_q5_0(K_Q4_0, w[o0 + r], n_in // 32, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_q4_0_q5_0(K_Q4_0, w[o], n_in // 32, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_q5_0(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_q4_0_q5_0(K_Q5_0, w[o0 + r], n_in // 32, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_q4_0_q5_0(K_Q5_0, w[o], n_in // 32, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_q4_1(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_q4_1_q5_1(K_Q4_1, w[o0 + r], n_in // 32, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_q4_1_q5_1(K_Q4_1, w[o], n_in // 32, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_q5_1(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_q4_1_q5_1(K_Q5_1, w[o0 + r], n_in // 32, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_q4_1_q5_1(K_Q5_1, w[o], n_in // 32, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_q2_k(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_q2_k(K_Q2_K, w[o0 + r], n_in // 256, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_q2_k(K_Q2_K, w[o], n_in // 256, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_q3_k(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_q3_k(K_Q3_K, w[o0 + r], n_in // 256, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_q3_k(K_Q3_K, w[o], n_in // 256, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_q4_k(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_q4_k_q5_k(K_Q4_K, w[o0 + r], n_in // 256, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_q4_k_q5_k(K_Q4_K, w[o], n_in // 256, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_q5_k(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_q4_k_q5_k(K_Q5_K, w[o0 + r], n_in // 256, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_q4_k_q5_k(K_Q5_K, w[o], n_in // 256, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_q6_k(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_q6_k(K_Q6_K, w[o0 + r], n_in // 256, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_q6_k(K_Q6_K, w[o], n_in // 256, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_mxfp4(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_mxfp4(K_MXFP4, w[o0 + r], n_in // 32, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_mxfp4(K_MXFP4, w[o], n_in // 32, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_iq4_nl(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_iq4_nl(K_IQ4_NL, w[o0 + r], n_in // 32, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_iq4_nl(K_IQ4_NL, w[o], n_in // 32, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_iq4_xs(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_iq4_xs(K_IQ4_XS, w[o0 + r], n_in // 256, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_iq4_xs(K_IQ4_XS, w[o], n_in // 256, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_tq2_0(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_tq2_0(K_TQ2_0, w[o0 + r], n_in // 256, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_tq2_0(K_TQ2_0, w[o], n_in // 256, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def qmatmul_tq1_0(x, w):
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                _dq_tq1_0(K_TQ1_0, w[o0 + r], n_in // 256, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            _dq_tq1_0(K_TQ1_0, w[o], n_in // 256, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@numba.njit(cache=True, parallel=True, fastmath=False)
def _qmatmul_rows(x, w, kind):
    """The driver of the grid i-quants, NVFP4 and Q1_0 (one for all: dq_row dispatches on `kind`, once per row).
    Callers pass `kind` as np.int64(K): a bare constant would be typed as a literal, and Numba would compile this
    whole parallel function again for every type (about a minute each)."""
    n_tokens, n_in = x.shape
    n_out, n16 = w.shape[0], 16 + (n_in >> 62)
    y = np.empty((n_tokens, n_out), dtype=np.float32)
    if n_tokens >= BLAS_MIN_T:
        panel = _panel_rows(n_in, n_out)
        buf = np.empty((panel, n_in), dtype=np.float32)
        for o0 in range(0, n_out, panel):
            rows = min(panel, n_out - o0)
            for r in prange(rows):
                dq_row(kind, w[o0 + r], n_in, buf[r], n16)
            y[:, o0 : o0 + rows] = np.dot(x, buf[:rows].T)
        return y
    n_chunks = _chunks(n_out)
    for ch in prange(n_chunks):
        row = np.empty(n_in, dtype=np.float32)
        for o in range(ch * n_out // n_chunks, (ch + 1) * n_out // n_chunks):
            dq_row(kind, w[o], n_in, row, n16)
            for t in range(n_tokens):
                y[t, o] = _dot(row, x[t])
    return y


@_jit
def qmatmul_iq2_xxs(x, w):
    return _qmatmul_rows(x, w, np.int64(K_IQ2_XXS))


@_jit
def qmatmul_iq2_xs(x, w):
    return _qmatmul_rows(x, w, np.int64(K_IQ2_XS))


@_jit
def qmatmul_iq2_s(x, w):
    return _qmatmul_rows(x, w, np.int64(K_IQ2_S))


@_jit
def qmatmul_iq3_xxs(x, w):
    return _qmatmul_rows(x, w, np.int64(K_IQ3_XXS))


@_jit
def qmatmul_iq3_s(x, w):
    return _qmatmul_rows(x, w, np.int64(K_IQ3_S))


@_jit
def qmatmul_iq1_s(x, w):
    return _qmatmul_rows(x, w, np.int64(K_IQ1_S))


@_jit
def qmatmul_iq1_m(x, w):
    return _qmatmul_rows(x, w, np.int64(K_IQ1_M))


@_jit
def qmatmul_nvfp4(x, w):
    return _qmatmul_rows(x, w, np.int64(K_NVFP4))


@_jit
def qmatmul_q1_0(x, w):
    return _qmatmul_rows(x, w, np.int64(K_Q1_0))


DRIVERS = {
    "Q4_0": qmatmul_q4_0,
    "Q4_1": qmatmul_q4_1,
    "Q5_0": qmatmul_q5_0,
    "Q5_1": qmatmul_q5_1,
    "Q8_0": qmatmul_q8_0,
    "Q2_K": qmatmul_q2_k,
    "Q3_K": qmatmul_q3_k,
    "Q4_K": qmatmul_q4_k,
    "Q5_K": qmatmul_q5_k,
    "Q6_K": qmatmul_q6_k,
    "MXFP4": qmatmul_mxfp4,
    "IQ4_NL": qmatmul_iq4_nl,
    "IQ4_XS": qmatmul_iq4_xs,
    "TQ2_0": qmatmul_tq2_0,
    "TQ1_0": qmatmul_tq1_0,
    "IQ2_XXS": qmatmul_iq2_xxs,
    "IQ2_XS": qmatmul_iq2_xs,
    "IQ2_S": qmatmul_iq2_s,
    "IQ3_XXS": qmatmul_iq3_xxs,
    "IQ3_S": qmatmul_iq3_s,
    "IQ1_S": qmatmul_iq1_s,
    "IQ1_M": qmatmul_iq1_m,
    "NVFP4": qmatmul_nvfp4,
    "Q1_0": qmatmul_q1_0,
}


# Called, not inlined: inlined at both of _qmatmul_rows's call sites, every type's loops made it ~3x larger, and Numba
# re-optimizes a callee's whole module in every caller (about a minute per grid type, cold; now 15 s)
@numba.njit(cache=True, fastmath=False)
def dq_row(kind, row, n_in, out, n16):
    """Dequantize one row of n_in weights of type `kind` into out: the one dispatch of the embedding and the experts."""
    if kind == K_Q8_0:
        _dq_q8_0(kind, row, n_in // 32, out, n16)
    elif kind == K_Q4_0 or kind == K_Q5_0:
        _dq_q4_0_q5_0(kind, row, n_in // 32, out, n16)
    elif kind == K_Q4_1 or kind == K_Q5_1:
        _dq_q4_1_q5_1(kind, row, n_in // 32, out, n16)
    elif kind == K_Q2_K:
        _dq_q2_k(kind, row, n_in // 256, out, n16)
    elif kind == K_Q3_K:
        _dq_q3_k(kind, row, n_in // 256, out, n16)
    elif kind == K_Q4_K or kind == K_Q5_K:
        _dq_q4_k_q5_k(kind, row, n_in // 256, out, n16)
    elif kind == K_MXFP4:
        _dq_mxfp4(kind, row, n_in // 32, out, n16)
    elif kind == K_IQ4_NL:
        _dq_iq4_nl(kind, row, n_in // 32, out, n16)
    elif kind == K_IQ4_XS:
        _dq_iq4_xs(kind, row, n_in // 256, out, n16)
    elif kind == K_TQ2_0:
        _dq_tq2_0(kind, row, n_in // 256, out, n16)
    elif kind == K_TQ1_0:
        _dq_tq1_0(kind, row, n_in // 256, out, n16)
    elif kind == K_NVFP4:
        _dq_nvfp4(kind, row, n_in // 64, out, n16)
    elif kind == K_Q1_0:
        _dq_q1_0(kind, row, n_in // 128, out, n16)
    elif K_IQ2_XXS <= kind <= K_IQ1_M:  # the grid i-quants (alchemist.kernels.iq_grids.GRID_TYPES), in order
        _dq_grid(kind, row, n_in // 256, out, n16)
    else:
        _dq_q6_k(kind, row, n_in // 256, out, n16)


@numba.njit(cache=True, fastmath=False)
def embed(kind, w, idx, n_in):
    """Rows idx of w (uint8 GGUF rows) dequantized exactly: (len(idx), n_in) float32 (one driver, all types)."""
    n_rows = w.shape[0]
    n16 = 16 + (n_in >> 62)
    y = np.empty((idx.shape[0], n_in), dtype=np.float32)
    for t in range(idx.shape[0]):
        r = idx[t]
        if r < -n_rows or r >= n_rows:
            raise IndexError("QuantizedEmbedding: index out of bounds")
        row = w[r if r >= 0 else r + n_rows]
        dq_row(kind, row, n_in, y[t], n16)
    return y


def qmatmul(ggml_type: str, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(T, n_in) float32 @ dequant(w (n_out, row_bytes) uint8).T -> (T, n_out) float32 (from Python)."""
    return DRIVERS[ggml_type](np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(w, dtype=np.uint8))


def register_numba():
    """Register the kernels with PyTensor's Numba backend (idempotent; imports numba's dispatch)."""
    global _registered
    if _registered:
        return
    from alchemist.kernels.native import matmul_kernel
    from alchemist.kernels.op import QuantizedEmbedding, QuantizedMatmul
    from alchemist.pytensor_ext.pytensor_internals import (
        numba_launch_threads,
        numba_njit,
        register_funcify_default_op_cache_key,
    )

    @register_funcify_default_op_cache_key(QuantizedEmbedding)
    def numba_funcify_QuantizedEmbedding(op, node=None, **kwargs):
        kind, n_rows, n_in, row_bytes = KINDS[op.ggml_type], op.n_rows, op.n_in, op.row_bytes

        @numba_njit(fastmath=False)  # exact rounding: see kernels.rms_norm.register_numba
        def quantized_embedding(w, idx):
            if w.shape[0] != n_rows or w.shape[1] != row_bytes:
                raise ValueError("QuantizedEmbedding: w does not have the shape the Op was built for")
            # np.int64: plain integers, not literals, so one compiled `embed` serves every type and width
            return embed(np.int64(kind), np.ascontiguousarray(w), idx, np.int64(n_in))

        return quantized_embedding, _SOURCE_VERSION

    @register_funcify_default_op_cache_key(QuantizedMatmul)
    def numba_funcify_QuantizedMatmul(op, node=None, **kwargs):
        # PyTensor may load the whole compiled graph (our prange driver linked in) from its own cache; Numba
        # then never starts its threading layer and the first prange segfaults. Start it here (idempotent).
        n_out, n_in, row_bytes, ggml = op.n_out, op.n_in, op.row_bytes, op.numerics == "ggml"
        native = matmul_kernel()
        if native is not None:  # the C backend's own kernels, from one shared library (alchemist.kernels.native)
            c_matmul, c_version = native
            type_index, use_ggml = KINDS[op.ggml_type], int(ggml)

            @numba_njit(fastmath=False)  # exact rounding: see kernels.rms_norm.register_numba
            def quantized_matmul_c(x, w):
                if x.shape[1] != n_in or w.shape[0] != n_out or w.shape[1] != row_bytes:
                    raise ValueError("QuantizedMatmul: x or w does not have the shape the Op was built for")
                xc, wc = np.ascontiguousarray(x), np.ascontiguousarray(w)
                y = np.empty((xc.shape[0], n_out), dtype=np.float32)
                status = c_matmul(
                    type_index, use_ggml, wc.ctypes.data, n_out, n_in, xc.ctypes.data, xc.shape[0], y.ctypes.data
                )
                if status != 0:
                    raise MemoryError("QuantizedMatmul: the C kernel could not allocate its work buffers")
                return y

            return quantized_matmul_c, _SOURCE_VERSION ^ c_version

        numba_launch_threads()
        driver = DRIVERS[op.ggml_type]
        round_rows, kind = activations.round_rows_numba(), activations.activation_kind(op.ggml_type)

        @numba_njit(fastmath=False)  # exact rounding: see kernels.rms_norm.register_numba
        def quantized_matmul(x, w):
            if x.shape[1] != n_in or w.shape[0] != n_out or w.shape[1] != row_bytes:
                raise ValueError("QuantizedMatmul: x or w does not have the shape the Op was built for")
            xc = round_rows(np.ascontiguousarray(x), kind) if ggml else np.ascontiguousarray(x)
            return driver(xc, np.ascontiguousarray(w))

        # PyTensor caches the compiled wrapper (with our driver linked in) under a key made of the Op's props
        # and this integer: salt it with this file's source, so that editing the kernels invalidates it.
        return quantized_matmul, _SOURCE_VERSION

    _registered = True


_registered = False
_SOURCE_VERSION = int(hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12], 16)
