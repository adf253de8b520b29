"""Quantizing fixtures with llama.cpp's own quantizer (`llama_model_quantize`), so that quantized
test files are exactly what llama.cpp would produce, type mixture included.

`quantize_fixture(src, dst, "Q4_K")` maps a bare type to llama.cpp's ftype (K-types to their `_M`
mixture, as real models ship: Q4_K -> LLAMA_FTYPE_MOSTLY_Q4_K_M) and returns a `QuantizeReport`
with the type each tensor actually got. llama.cpp keeps 1-D tensors (norms, biases) in F32, may
give token_embd / output / attn_v / ffn_down other types, and falls back to a compatible type
for rows that are not a multiple of the block size. Pass an ftype name ("Q4_K_S", "Q3_K_L") for
another mixture, or `pure=True` to put every quantizable tensor in the default type.
MXFP4: llama.cpp's only MXFP4 ftype, MOSTLY_MXFP4_MOE, gives MXFP4 to 3-D expert tensors and Q8_0 to
everything else; a bare "MXFP4" therefore quantizes pure (every 2-D/3-D weight whose rows are whole
32-blocks in MXFP4, as `llama-quantize --pure ... MXFP4_MOE` does), "MXFP4_MOE" gives the mixture.

`quantize_array(values, "MXFP4")` quantizes a float array of any rank (a 3-D expert stack too) with
llama.cpp's own row quantizer (ggml_quantize_chunk), for fixtures written directly; `dequantize_array`
is llama.cpp's dequantizer, the reference the tests compare against.
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from alchemist.harness import _llama
from alchemist.harness._llama import OracleError

# bare ggml type -> llama_ftype name
QTYPE_TO_FTYPE = {
    "F16": "F16",
    "BF16": "BF16",
    "Q8_0": "Q8_0",
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q5_0": "Q5_0",
    "Q5_1": "Q5_1",
    "Q2_K": "Q2_K",
    "Q3_K": "Q3_K_M",
    "Q4_K": "Q4_K_M",
    "Q5_K": "Q5_K_M",
    "Q6_K": "Q6_K",
    "MXFP4": "MXFP4_MOE",
    "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS",
    "TQ2_0": "TQ2_0",
    "TQ1_0": "TQ1_0",
    "Q1_0": "Q1_0",
}
# bare types whose ftype's mixture would not use them on 2-D weights: quantized pure
PURE_QTYPES = frozenset({"MXFP4"})
FTYPES = (
    "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "MXFP4_MOE", "IQ4_NL", "IQ4_XS", "TQ2_0", "TQ1_0", "Q1_0",
)  # fmt: skip
# the types the fixtures are exercised with
FIXTURE_QTYPES = (
    "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "MXFP4", "IQ4_NL", "IQ4_XS", "TQ2_0", "TQ1_0"
)  # fmt: skip
# the types llama_model_quantize will not write here: without an importance matrix, which llama-cpp-python cannot
# hand it (the grid i-quants), or at all (NVFP4, which this build refuses as an output type); their fixtures are
# quantized tensor by tensor (write_quantized_fixture)
TENSOR_BY_TENSOR_QTYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "NVFP4")


@dataclass(frozen=True)
class QuantizeReport:
    path: Path
    qtype: str  # as asked
    ftype: str  # llama.cpp ftype used, e.g. "Q4_K_M"
    pure: bool
    tensor_types: dict[str, str]  # tensor name -> ggml type actually written
    seconds: float

    @property
    def type_counts(self) -> dict[str, int]:
        return dict(Counter(self.tensor_types.values()))

    def types_of(self, suffix: str) -> set[str]:
        """Types used by tensors whose name ends with `suffix`, e.g. "attn_v.weight"."""
        return {t for n, t in self.tensor_types.items() if n.endswith(suffix)}

    def __str__(self) -> str:
        counts = ", ".join(f"{k}×{v}" for k, v in sorted(self.type_counts.items()))
        return f"{self.path.name}: {self.qtype} via LLAMA_FTYPE_MOSTLY_{self.ftype}{' (pure)' if self.pure else ''}: {counts}"


def ftype_for(qtype: str) -> str:
    q = qtype.upper()
    if q.startswith("MOSTLY_"):
        q = q[len("MOSTLY_") :]
    if q in QTYPE_TO_FTYPE:
        return QTYPE_TO_FTYPE[q]
    if q in FTYPES:
        return q
    raise ValueError(
        f"unknown quantization type {qtype!r} (choose from {', '.join(sorted(set(QTYPE_TO_FTYPE) | set(FTYPES)))})"
    )


def quantize_fixture(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    qtype: str,
    *,
    pure: bool = False,
    nthread: int | None = None,
) -> QuantizeReport:
    """Quantize the F32/F16 GGUF `src` into `dst` with llama.cpp; report the types it produced."""
    import time

    from alchemist.gguf_io import read_gguf

    _llama.init()
    llc = _llama.llc
    ftype = ftype_for(qtype)
    pure = pure or qtype.upper() in PURE_QTYPES
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise OracleError(f"{src}: no such GGUF file")
    params = llc.llama_model_quantize_default_params()
    params.ftype = getattr(llc, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = int(nthread or os.cpu_count() or 1)
    params.pure = bool(pure)
    params.allow_requantize = False
    _llama.clear_log()
    t0 = time.perf_counter()
    rc = llc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    seconds = time.perf_counter() - t0
    if rc != 0:
        # llama.cpp says why after its dump of the file's metadata: keep its words, not the dump
        why = [line for line in _llama.recent_log(64).splitlines() if not line.startswith("llama_model_loader:")]
        raise OracleError(f"llama_model_quantize({src.name} -> {qtype}) failed ({rc}): {' '.join(why[-4:])}")
    facts = read_gguf(dst)
    types = {name: info.ggml_type for name, info in facts.tensors.items()}
    return QuantizeReport(path=dst, qtype=qtype, ftype=ftype, pure=bool(pure), tensor_types=types, seconds=seconds)


def _type_code(ggml_type: str) -> int:
    from gguf import GGMLQuantizationType

    try:
        return int(GGMLQuantizationType[ggml_type])
    except KeyError:
        raise ValueError(f"unknown ggml type {ggml_type!r}") from None


def quantize_array(values: np.ndarray, ggml_type: str) -> np.ndarray:
    """float (..., n) -> uint8 (..., row bytes): each row quantized by llama.cpp's ggml_quantize_chunk (no
    imatrix), byte for byte what llama_model_quantize writes for a tensor of that type. 3-D expert stacks
    (n_expert, n_out, n_in) are n_expert * n_out rows, as ggml stores them. The types ggml will not quantize
    without an importance matrix (IQ2_XXS, IQ2_XS, IQ1_S: ggml_quantize_requires_imatrix) get a uniform one."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    x = np.ascontiguousarray(values, dtype=np.float32)
    qk, bs = GGML_QUANT_SIZES[GGMLQuantizationType(_type_code(ggml_type))]
    n = x.shape[-1]
    if x.ndim == 0 or n % qk:
        raise ValueError(f"{ggml_type}: rows of {n} values are not a whole number of {qk}-value blocks")
    rows = x.size // n if n else 0
    out = np.empty((*x.shape[:-1], n // qk * bs), dtype=np.uint8)
    imatrix = np.ones(n, np.float32) if ggml_type in REQUIRES_IMATRIX else None
    if rows:
        _llama.ggml().quantize_chunk(
            _type_code(ggml_type),
            x.ctypes.data,
            out.ctypes.data,
            0,
            rows,
            n,
            None if imatrix is None else imatrix.ctypes.data,
        )
    return out


# ggml.c ggml_quantize_requires_imatrix, and IQ1_M, whose quantizer asserts one too
REQUIRES_IMATRIX = frozenset({"IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"})


def write_quantized_fixture(dst: str | Path, arch: str, ggml_type: str) -> Path:
    """A random-weight fixture of `arch` whose 2-D weights with rows of whole blocks of the type are quantized to
    `ggml_type` tensor by tensor by llama.cpp's quantizer (ggml_quantize_chunk; a uniform importance matrix where
    ggml needs one), the rest F32. For the types llama_model_quantize will not write: without an importance
    matrix (TENSOR_BY_TENSOR_QTYPES), which llama-cpp-python cannot hand it, or at all (NVFP4, whose ftype this
    build refuses as an output type). A fixture none of whose weights has rows of whole blocks is refused (it would
    validate nothing of the type)."""
    from gguf import GGMLQuantizationType

    from alchemist.fixtures import write_fixture
    from alchemist.kernels.formats import block_size

    qk = block_size(ggml_type)[0]
    quantized = []

    def encode(name, role, values):
        if role not in ("linear", "embedding") or values.ndim != 2 or values.shape[-1] % qk:
            return None
        quantized.append(name)
        return quantize_array(values, ggml_type), GGMLQuantizationType[ggml_type]

    path = write_fixture(dst, arch, encode=encode)
    if not quantized:
        Path(path).unlink()
        raise ValueError(f"{arch}: no weight of the fixture has rows of whole {qk}-value {ggml_type} blocks")
    return path


def dequantize_array(blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    """uint8 (..., row bytes) -> float32 (..., n) through llama.cpp's dequantize_row_<type>."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    b = np.ascontiguousarray(blocks, dtype=np.uint8)
    qk, bs = GGML_QUANT_SIZES[GGMLQuantizationType(_type_code(ggml_type))]
    if b.ndim == 0 or b.shape[-1] % bs:
        raise ValueError(f"{ggml_type}: rows of {b.shape[-1:]} bytes are not a whole number of {bs}-byte blocks")
    out = np.empty((*b.shape[:-1], b.shape[-1] // bs * qk), dtype=np.float32)
    _llama.ggml().dequantize_row(ggml_type)(b.ctypes.data, out.ctypes.data, out.size)
    return out
