"""GGUF block formats: sizes, and a dequantizer written once for both numpy and PyTensor.

A GGUF weight row of n_in values is n_in / QK consecutive blocks of BS bytes; each block holds QK weights
as small integers plus fp16 scale(s) (MXFP4: 4-bit E2M1 codes and one E8M0 exponent byte). Layouts follow
gguf-py's `gguf/quants.py` (numpy reference) and llama.cpp's `ggml-quants.c`.

`dequantize_blocks(xp, blocks, ggml_type)` maps uint8 blocks (..., n_blocks, BS) to float32 values
(..., n_blocks * QK) using only reshapes, slices, integer `//` and `%`, products, sums, concatenation
and a table lookup, so the same code runs with `xp=numpy` (checked against gguf-py) and `xp=pytensor.tensor`
(the dequantize-then-dot fallback that compiles on every PyTensor backend, JAX and MLX included).
"""

from __future__ import annotations

import numpy as np

# ggml type -> (QK: weights per block, BS: bytes per block)
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "MXFP4": (32, 17),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
    "TQ2_0": (256, 66),
    "TQ1_0": (256, 54),
    "IQ2_XXS": (256, 66),
    "IQ2_XS": (256, 74),
    "IQ2_S": (256, 82),
    "IQ3_XXS": (256, 98),
    "IQ3_S": (256, 110),
    "IQ1_S": (256, 50),
    "IQ1_M": (256, 56),
    "NVFP4": (64, 36),
    "Q1_0": (128, 18),
}

SUPPORTED_TYPES: tuple[str, ...] = tuple(BLOCK_SIZES)
# the supported types gguf-py writes but cannot dequantize: their reference is this module's numpy dequantizer
# (tests/test_quant_types.py holds it to llama.cpp's dequantize_row_<type>)
NOT_IN_GGUF_PY = frozenset({"Q1_0"})

# every fp16 bit pattern (lo byte + 256 * hi byte) as float32: exact, handles subnormals, inf and nan
F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

# MXFP4 (OCP microscaling FP4): the E2M1 code of each 4-bit quant, doubled so that it is an integer
# (ggml-common.h kvalues_mxfp4; bit 3 is the sign), and the block's E8M0 exponent byte e as the float32
# scale 2^(e - 128) that goes with the doubled codes (ggml-impl.h ggml_e8m0_to_fp32_half; e < 2 are the
# subnormals 2^-128 and 2^-127). Both exact: a weight is KVALUES_MXFP4[q] * E8M0_HALF_TABLE[e].
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_E8M0 = np.arange(256, dtype=np.uint32)
E8M0_HALF_TABLE = (
    np.where(_E8M0 < 2, np.uint32(0x00200000) << _E8M0, (_E8M0 - 1) << 23).astype(np.uint32).view(np.float32)
)


# NVFP4: 64 weights as 4 sub-blocks of 16, each an unsigned E4M3 scale byte (bias 7, halved to go with the doubled
# E2M1 codes of KVALUES_MXFP4; 0 and 0x7F, its NaN, decode to 0) over 16 four-bit codes: ggml-impl.h
# ggml_ue4m3_to_fp32, exact in float32. A weight is KVALUES_MXFP4[q] * UE4M3_HALF_TABLE[d].
_UE4M3_EXP, _UE4M3_MAN = (np.arange(256) >> 3) & 15, (np.arange(256) & 7).astype(np.float64)
UE4M3_HALF_TABLE = np.where(
    (np.arange(256) == 0) | (np.arange(256) == 0x7F),
    0.0,
    np.where(_UE4M3_EXP == 0, _UE4M3_MAN * 2.0**-9, (1 + _UE4M3_MAN / 8) * 2.0 ** (_UE4M3_EXP - 7.0)) * 0.5,
).astype(np.float32)


# IQ4_NL / IQ4_XS: each 4-bit code indexes a non-linear grid of int8 values (ggml-common.h kvalues_iq4nl); a
# weight is d * KVALUES_IQ4NL[q] (IQ4_NL: one fp16 d per 32) or (d * (ls - 32)) * KVALUES_IQ4NL[q] (IQ4_XS: one
# fp16 d per 256 and a 6-bit scale ls per 32, its low 4 bits in scales_l and high 2 in scales_h)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
# TQ1_0_DIGITS[n][q]: base-3 digit n (0, 1, 2) of a TQ1_0 byte q, as ggml's dequantize_row_tq1_0 reads it: the top
# of 3 * (q * 3^n mod 256) in 8.8 fixed point
_BYTES = np.arange(256, dtype=np.uint32)
TQ1_0_DIGITS = np.stack([(((_BYTES * 3**n) % 256) * 3 >> 8).astype(np.int8) for n in range(5)])


def row_bytes(ggml_type: str, n_in: int) -> int:
    """Bytes of one row of n_in weights."""
    qk, bs = block_size(ggml_type)
    if n_in % qk:
        raise ValueError(f"{ggml_type}: a row of {n_in} weights is not a whole number of {qk}-weight blocks")
    return n_in // qk * bs


def block_size(ggml_type: str) -> tuple[int, int]:
    try:
        return BLOCK_SIZES[ggml_type]
    except KeyError:
        raise NotImplementedError(
            f"no quantized kernel for ggml type {ggml_type!r}; supported: {', '.join(SUPPORTED_TYPES)}"
        ) from None


class _Ops:
    """The few array operations the dequantizer needs, for numpy or pytensor.tensor."""

    def __init__(self, xp):
        self.xp = xp
        self.symbolic = xp is not np

    def concat(self, parts, axis=-1):
        return self.xp.concatenate(parts, axis=axis)

    def stack(self, parts, axis):
        return self.xp.stack(parts, axis=axis)

    def f16(self, lo_hi):
        """(..., 2) int bytes -> (...,) float32, via the exact table."""
        bits = lo_hi[..., 0] + 256 * lo_hi[..., 1]
        table = self.xp.as_tensor(F16_TABLE) if self.symbolic else F16_TABLE
        return table[bits]

    def f32(self, a):
        return a.astype("float32")

    def lookup(self, table: np.ndarray, index):
        """table[index] for a constant numpy table."""
        return (self.xp.as_tensor(table) if self.symbolic else table)[index]


def _bits(ops, a, shifts, width, axis=-2):
    """(..., n) ints -> (..., len(shifts), n) (or (..., n, len(shifts)) for axis=-1): (a >> s) & (2**width - 1)."""
    return ops.stack([(a // (1 << s)) % (1 << width) for s in shifts], axis=axis)


def _int8(a):
    return a - 256 * (a // 128)


def _k_scale_min(ops, s):
    """Q4_K / Q5_K: 12 bytes (..., 12) -> 8 six-bit scales and 8 six-bit mins (..., 8)."""
    d_, m_, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = ops.concat([d_ % 64, md % 16 + (d_ // 64) * 16])
    mn = ops.concat([m_ % 64, md // 16 + (m_ // 64) * 16])
    return sc, mn


def dequantize_blocks(xp, blocks, ggml_type: str):
    """uint8 blocks (n_rows, n_blocks, BS) -> float32 (n_rows, n_blocks * QK); xp is numpy or pytensor.tensor.

    Shapes must be static (ints) for pytensor inputs: `blocks.type.shape` is used.
    """
    ops = _Ops(xp)
    qk, bs = block_size(ggml_type)
    lead = tuple(int(n) for n in (blocks.type.shape if ops.symbolic else blocks.shape)[:-1])
    b = blocks.astype("int32")
    f32 = ops.f32

    def flat(v):  # (n_rows, n_blocks, anything...) -> (n_rows, n_blocks * QK)
        return v.reshape((*lead[:-1], lead[-1] * qk))

    if ggml_type in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = ops.f16(b[..., 0:2])[..., None]
        if ggml_type == "Q8_0":
            return flat(d * f32(_int8(b[..., 2:34])))
        has_min = ggml_type in ("Q4_1", "Q5_1")
        m = ops.f16(b[..., 2:4])[..., None] if has_min else None
        pos = 4 if has_min else 2
        if ggml_type in ("Q5_0", "Q5_1"):
            qh = b[..., pos : pos + 4]
            pos += 4
        qs = b[..., pos : pos + 16]
        q = ops.concat([qs % 16, qs // 16])  # element j < 16: low nibble of byte j; j >= 16: high nibble
        if ggml_type in ("Q5_0", "Q5_1"):
            hbits = _bits(ops, qh, range(8), 1, axis=-1)  # (..., 4, 8): bit s of byte k is the 5th bit of element 8k+s
            q = q + 16 * hbits.reshape((*lead, 32))
        if has_min:
            return flat(d * f32(q) + m)
        return flat(d * f32(q - (16 if ggml_type == "Q5_0" else 8)))

    if ggml_type == "Q2_K":
        scales, qs = b[..., 0:16], b[..., 16:80]
        d, dmin = ops.f16(b[..., 80:82])[..., None], ops.f16(b[..., 82:84])[..., None]
        dl = (d * f32(scales % 16))[..., None]
        ml = (dmin * f32(scales // 16))[..., None]
        q = _bits(ops, qs.reshape((*lead, 2, 32)), (0, 2, 4, 6), 2)  # (..., 2, 4, 32)
        q = f32(q.reshape((*lead, 16, 16)))
        return flat(dl * q - ml)

    if ggml_type == "Q3_K":
        hmask, qs, sc = b[..., 0:32], b[..., 32:96], b[..., 96:108]
        d = ops.f16(b[..., 108:110])[..., None]
        low = ops.concat([sc[..., 0:8] % 16, sc[..., 0:8] // 16])
        high = _bits(ops, sc[..., 8:12], (0, 2, 4, 6), 2).reshape((*lead, 16))
        scales = f32(low + 16 * high - 32)
        dl = (d * scales)[..., None]
        ql = _bits(ops, qs.reshape((*lead, 2, 32)), (0, 2, 4, 6), 2).reshape((*lead, 16, 16))
        qh = _bits(ops, hmask, range(8), 1).reshape((*lead, 16, 16))
        q = f32(ql - 4 * (1 - qh))
        return flat(dl * q)

    if ggml_type in ("Q4_K", "Q5_K"):
        d, dmin = ops.f16(b[..., 0:2])[..., None], ops.f16(b[..., 2:4])[..., None]
        sc, mn = _k_scale_min(ops, b[..., 4:16])
        dl = (d * f32(sc))[..., None]
        ml = (dmin * f32(mn))[..., None]
        qs = b[..., 16:144] if ggml_type == "Q4_K" else b[..., 48:176]
        q = _bits(ops, qs.reshape((*lead, 4, 32)), (0, 4), 4).reshape((*lead, 8, 32))
        if ggml_type == "Q5_K":
            q = q + 16 * _bits(ops, b[..., 16:48], range(8), 1)
        return flat(dl * f32(q) - ml)

    if ggml_type == "Q6_K":
        ql, qh, sc = b[..., 0:128], b[..., 128:192], b[..., 192:208]
        d = ops.f16(b[..., 208:210])[..., None]
        dl = (d * f32(_int8(sc)))[..., None]
        lo = _bits(ops, ql.reshape((*lead, 2, 64)), (0, 4), 4).reshape((*lead, 8, 32))
        hi = _bits(ops, qh.reshape((*lead, 2, 32)), (0, 2, 4, 6), 2).reshape((*lead, 8, 32))
        q = f32(lo + 16 * hi - 32).reshape((*lead, 16, 16))
        return flat(dl * q)

    if ggml_type == "MXFP4":
        d = ops.lookup(E8M0_HALF_TABLE, b[..., 0])[..., None]
        qs = b[..., 1:17]
        q = ops.concat([qs % 16, qs // 16])  # like Q4_0: element j < 16 is the low nibble of byte j
        return flat(d * f32(ops.lookup(KVALUES_MXFP4, q)))

    if ggml_type == "Q1_0":  # one sign bit per weight (bit j % 8 of byte j / 8): +d or -d
        d = ops.f16(b[..., 0:2])[..., None]
        bits = _bits(ops, b[..., 2:18], range(8), 1, axis=-1).reshape((*lead, 128))
        return flat(d * f32(2 * bits - 1))

    if ggml_type == "NVFP4":
        d = ops.lookup(UE4M3_HALF_TABLE, b[..., 0:4])[..., None]  # (..., 4, 1): one scale per 16
        qs = b[..., 4:36].reshape((*lead, 4, 8))
        q = ops.concat([qs % 16, qs // 16])  # per 16: element j < 8 is the low nibble of byte j
        return flat(d * f32(ops.lookup(KVALUES_MXFP4, q)))

    if ggml_type == "IQ4_NL":
        d = ops.f16(b[..., 0:2])[..., None]
        qs = b[..., 2:18]
        q = ops.concat([qs % 16, qs // 16])  # like Q4_0: element j < 16 is the low nibble of byte j
        return flat(d * f32(ops.lookup(KVALUES_IQ4NL, q)))

    if ggml_type == "IQ4_XS":
        d = ops.f16(b[..., 0:2])[..., None]
        scales_h = (b[..., 2] + 256 * b[..., 3])[..., None]  # uint16: 2 bits per sub-block
        low = _bits(ops, b[..., 4:8], (0, 4), 4, axis=-1).reshape((*lead, 8))  # sub-block 2i: low nibble of byte i
        high = _bits(ops, scales_h, range(0, 16, 2), 2, axis=-1).reshape((*lead, 8))
        dl = (d * f32(low + 16 * high - 32))[..., None]
        qs = b[..., 8:136].reshape((*lead, 8, 16))
        q = ops.concat([qs % 16, qs // 16])  # (..., 8, 32): per sub-block as IQ4_NL
        return flat(dl * f32(ops.lookup(KVALUES_IQ4NL, q)))

    if ggml_type == "TQ2_0":
        # ternary: 2-bit codes 0, 1, 2 for -1, 0, 1; byte b of 32-byte chunk j holds elements 128j + 32n + b
        qs = b[..., 0:64].reshape((*lead, 2, 32))
        d = ops.f16(b[..., 64:66])[..., None]
        q = _bits(ops, qs, (0, 2, 4, 6), 2)  # (..., 2, 4, 32)
        return flat(d * f32(q.reshape((*lead, 256)) - 1))

    if ggml_type == "TQ1_0":
        # ternary in base-3 digits: byte m of the first 32 holds elements 32n + m (digits n = 0..4), of the next 16
        # elements 160 + 16n + m, of the last 4 elements 240 + 4n + m (n = 0..3); digit 0, 1, 2 is -1, 0, 1
        d = ops.f16(b[..., 52:54])[..., None]
        parts = [
            ops.concat([ops.lookup(TQ1_0_DIGITS[n], b[..., lo:hi]) for n in range(digits)])
            for lo, hi, digits in ((0, 32, 5), (32, 48, 5), (48, 52, 4))
        ]
        return flat(d * f32(ops.concat(parts) - 1))

    if ggml_type in GRID_MULT:
        # weight = d * MULT * (2 ls + 1) * sign * magnitude (the grid i-quants; alchemist.kernels.iq_grids)
        w, scales = _grid_codes(ops, b, ggml_type, lead)  # (..., 16, 16) signed magnitudes, (..., 16) scales
        if ggml_type == "IQ1_M":  # the fp16 d in the top nibbles of the 4 uint16 of scales
            top = b[..., 49:56:2] // 16  # (..., 4)
            d = ops.f16(ops.stack([top[..., 0] + 16 * top[..., 1], top[..., 2] + 16 * top[..., 3]], axis=-1))
        else:
            d = ops.f16(b[..., 0:2])
        dl = d[..., None] * f32(scales) * np.float32(GRID_MULT[ggml_type])
        return flat(dl[..., None] * f32(w))

    raise NotImplementedError(ggml_type)


# the grid i-quants' factor on d * (2 ls + 1) (ggml's dequantize_row_<type>: d * (0.5 + ls) * 0.25 is that times 0.125)
GRID_MULT = {
    "IQ2_XXS": 0.125,
    "IQ2_XS": 0.125,
    "IQ2_S": 0.125,
    "IQ3_XXS": 0.25,
    "IQ3_S": 1.0,
    "IQ1_S": 0.125,
    "IQ1_M": 0.125,
}


def _field(v, shift: int, width: int):
    return (v // (1 << shift)) % (1 << width)


def _sign_indices(ops, p):
    """(..., 4) bytes of a little-endian uint32 -> (..., 4) its four 7-bit sign indices, (...) its top 4 bits."""
    low = p[..., 0] + 256 * p[..., 1] + 65536 * p[..., 2]  # bits 0..23 (an int32 holds them)
    third = _field(p[..., 2], 5, 3) + 8 * _field(p[..., 3], 0, 4)  # bits 21..27
    return ops.stack([_field(low, 0, 7), _field(low, 7, 7), _field(low, 14, 7), third], axis=-1), p[..., 3] // 16


def _grid_codes(ops, b, ggml_type: str, lead):
    """A grid i-quant block's signed magnitudes (..., 16, 16) and the scale 2 ls + 1 of each 16 (..., 16)."""
    from alchemist.kernels.iq_grids import KSIGNS, grid

    table, ksigns = grid(ggml_type).astype(np.int32), KSIGNS.astype(np.int32)  # int32: signs make negatives

    def signed(index, sign_bytes, n):  # (..., g) grid rows with (..., g) sign bytes (bit j: weight j) -> (..., g, n)
        return ops.lookup(table, index) * (1 - 2 * _bits(ops, sign_bytes, range(n), 1, axis=-1))

    if ggml_type in ("IQ2_XXS", "IQ3_XXS"):
        if ggml_type == "IQ2_XXS":
            qs = b[..., 2:66].reshape((*lead, 8, 8))
            index, (signs, ls) = qs[..., 0:4], _sign_indices(ops, qs[..., 4:8])
            w = signed(index, ops.lookup(ksigns, signs), 8)
        else:
            index = b[..., 2:66].reshape((*lead, 8, 8))  # 8 entries of 4 per 32; signs per 8
            signs, ls = _sign_indices(ops, b[..., 66:98].reshape((*lead, 8, 4)))
            sign8 = ops.lookup(ksigns, signs)  # (..., 8, 4): entry 2j takes the low nibble, 2j + 1 the high
            w = signed(index, ops.stack([sign8 % 16, sign8 // 16], axis=-1).reshape((*lead, 8, 8)), 4)
        scales = ops.stack([2 * ls + 1, 2 * ls + 1], axis=-1)  # (..., 8, 2)
    elif ggml_type == "IQ2_XS":
        q = b[..., 2:66:2] + 256 * b[..., 3:66:2]  # (..., 32)
        w = signed(q % 512, ops.lookup(ksigns, q // 512), 8)
        sc = b[..., 66:74]
        scales = ops.stack([2 * (sc % 16) + 1, 2 * (sc // 16) + 1], axis=-1)
    elif ggml_type == "IQ2_S":
        qh = b[..., 66:74][..., None]  # (..., 8, 1): 2 top bits per entry
        index = b[..., 2:34].reshape((*lead, 8, 4)) + 256 * ops.concat(
            [_field(qh, 2 * j, 2) for j in range(4)], axis=-1
        )
        w = signed(index, b[..., 34:66].reshape((*lead, 8, 4)), 8)
        sc = b[..., 74:82]
        scales = ops.stack([2 * (sc % 16) + 1, 2 * (sc // 16) + 1], axis=-1)
    elif ggml_type == "IQ1_S":  # w = 8 g +- 1 (the delta's sign in bit 15 of the 32's uint16)
        qh = b[..., 34:50:2] + 256 * b[..., 35:50:2]  # (..., 8)
        index = b[..., 2:34].reshape((*lead, 8, 4)) + 256 * ops.stack([_field(qh, 3 * j, 3) for j in range(4)], axis=-1)
        delta = 1 - 2 * _field(qh, 15, 1)  # (..., 8)
        w = 8 * ops.lookup(table, index) + delta[..., None, None]
        ls = _field(qh, 12, 3)
        scales = ops.stack([2 * ls + 1, 2 * ls + 1], axis=-1)
    elif ggml_type == "IQ1_M":  # per 8 weights 3 index bits and the delta's sign in a nibble; 3-bit ls per 16
        nib = ops.stack([b[..., 32:48] % 16, b[..., 32:48] // 16], axis=-1).reshape((*lead, 8, 4))
        index = b[..., 0:32].reshape((*lead, 8, 4)) + 256 * (nib % 8)
        w = 8 * ops.lookup(table, index) + (1 - 2 * (nib // 8))[..., None]
        sc = b[..., 48:56:2] + 256 * b[..., 49:56:2]  # (..., 4) uint16
        scales = 2 * ops.stack([_field(sc, 3 * j, 3) for j in range(4)], axis=-1) + 1
    else:  # IQ3_S
        qh = b[..., 66:74][..., None]  # (..., 8, 1): the top bit of each of a 32's 8 entries
        index = b[..., 2:66].reshape((*lead, 8, 8)) + 256 * ops.concat([_field(qh, j, 1) for j in range(8)], axis=-1)
        sign_bytes = b[..., 74:106].reshape((*lead, 8, 4))
        w = signed(index, ops.stack([sign_bytes % 16, sign_bytes // 16], axis=-1).reshape((*lead, 8, 8)), 4)
        sc = b[..., 106:110]
        ls = ops.stack([sc % 16, sc // 16], axis=-1).reshape((*lead, 8))
        scales = ops.stack([2 * ls + 1, 2 * ls + 1], axis=-1)
    return w.reshape((*lead, 16, 16)), scales.reshape((*lead, 16))


def dequantize_rows(xp, w_blocks, ggml_type: str, n_out: int, n_in: int):
    """uint8 rows (n_out, row_bytes) -> float32 weights (n_out, n_in); xp is numpy or pytensor.tensor."""
    qk, bs = block_size(ggml_type)
    if xp is not np:
        from pytensor.tensor import specify_shape

        w_blocks = specify_shape(w_blocks, (n_out, row_bytes(ggml_type, n_in)))
    blocks = w_blocks.reshape((n_out, n_in // qk, bs))
    return dequantize_blocks(xp, blocks, ggml_type).reshape((n_out, n_in))


def reference_dequantize(w_blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    """gguf-py's dequantizer (the exact reference; NOT_IN_GGUF_PY: the numpy one above): uint8 rows
    (n_out, row_bytes) -> float32 (n_out, n_in)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if ggml_type in NOT_IN_GGUF_PY:
        w = np.asarray(w_blocks)
        n_out, qk = w.shape[0], block_size(ggml_type)[0]
        return dequantize_rows(np, w, ggml_type, n_out, w.shape[1] // block_size(ggml_type)[1] * qk)

    return np.ascontiguousarray(dequantize(np.asarray(w_blocks), GGMLQuantizationType[ggml_type]), dtype=np.float32)
