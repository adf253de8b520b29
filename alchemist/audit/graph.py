"""The graph checks: the module (once the safety check passed) imported into a fresh, unregistered module
object, its loader probed on a small synthetic file, and `forward` built symbolically -- never compiled nor
run -- from one input per TENSORS entry, then the PyTensor graph (before any rewrite) walked:

- dequantization  load_weights(path) returns every entry as gguf's float32 dequantization of its bytes, and
                  with quantized=True the KERNEL_WEIGHTS as their uint8 blocks (probed on a synthetic file with
                  two rows per tensor); in the graph every uint8 weight reaches only alchemist.kernels Ops
                  whose ggml type and (n_out, n_in) are its TENSORS entry's
- orientation     every float "linear" weight (n_out, n_in) is contracted over its axis 1 (x @ W.T), through
                  any transposes; an "embedding" is gathered by rows (axis 0) or used as a linear weight
- heads           every reshape that splits a projection of width n_head·head_dim (n_kv_head·head_dim) has
                  static shapes and makes (…, heads, head_dim), a split of the query heads is kv-major
                  (n_kv_head, group), merges keep heads outer of head_dim, and no contraction other than with
                  a weight runs over an axis holding heads: axes are labelled from the split on and the
                  labels followed through reshapes, transposes, slices, joins and matmuls, so a layout that
                  only shapes cannot tell apart (n_head == head_dim, n_kv_head == group) is still followed
- coverage        every TENSORS entry reaches the logits or the cache (not only through its shape), except those
                  the IR marks as loaded but never applied by llama.cpp (TensorBinding.read False: gemma3n's K/V
                  projections on KV-sharing layers), which must not; forward reads no name outside TENSORS

Dequantization and coverage also read forward built with the "ggml" bundle of primitives that load_llm computes
with by default (alchemist.runtime.numerics.primitives), so what the default numerics reads is audited too.
Orientation and heads read the EXACT graph, where every primitive is the file's formula.

Nothing here knows a family or a template function: the IR gives the roles and head sizes.
"""

from __future__ import annotations

import math
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from alchemist.audit.checks import Context, ggml_sizes, result
from alchemist.pytensor_ext.host import activating

N_TOKENS = 3  # static token count of the probe graph
CAPACITY = 7  # static KV-cache rows
HEAD_KINDS = ("head", "kv", "group", "mix")
# tensors applied elementwise, whatever their shape: biases (per expert: 2-D), Mamba-2's per-head A and D (stored
# (heads, 1)); no orientation to check
ELEMENTWISE_ROLES = ("bias", "decay", "skip")
ROW_ROLES = ("embedding", "position_embedding")  # 2-D tables read by rows (an embedding also as a tied output)
RANK = {"head": 0, "kv": 0, "group": 1, "dim": 2}


def load_isolated(text: str, filename: str) -> types.ModuleType:
    """Execute the module's source in a fresh module object that is not registered in sys.modules."""
    module = types.ModuleType(f"alchemist_audited_{Path(filename).stem}")
    module.__file__ = filename
    exec(compile(text, filename, "exec"), module.__dict__)  # noqa: S102 - only after the safety check passed
    return module


@dataclass
class Build:
    quantized: bool
    numerics: str = "exact"  # the primitives forward was given: the module's EXACT, or alchemist's "ggml" bundle
    weights: dict = field(default_factory=dict)  # name -> input variable
    outputs: list = field(default_factory=list)
    nodes: list = field(default_factory=list)  # apply nodes, in topological order
    clients: dict = field(default_factory=dict)  # variable -> [(node, input index)]
    error: str | None = None


@activating
def build_forward(
    module, tensors: dict, kernel: set, cache_shapes: list, quantized: bool, capacity: int = None, numerics="exact"
) -> Build:
    """forward's graph for N_TOKENS tokens over a cache of `capacity` rows (default CAPACITY), computing with
    `numerics`' primitives (alchemist.runtime.numerics.primitives);
    cache_shapes: per layer its caches, (kind, shape of one position's row) (the IR's layer_caches)."""
    capacity = capacity or CAPACITY
    import pytensor
    import pytensor.tensor as pt
    from pytensor.graph.traversal import io_toposort

    from alchemist.runtime.numerics import primitives

    b = Build(quantized, numerics)
    for name, (gtype, shape, _, nbytes) in tensors.items():
        if quantized and name in kernel and gtype == "MLX_AFFINE":  # packed rows, their groups' scales and biases
            bits, group = module.MLX_QUANTIZED[name][:2]
            b.weights[name] = pt.tensor(name, dtype="uint32", shape=(shape[0], shape[1] * bits // 32))
            for part in ("scales", "biases"):
                b.weights[f"{name}.{part}"] = pt.tensor(
                    f"{name}.{part}", dtype="float32", shape=(shape[0], shape[1] // group)
                )
        elif quantized and name in kernel:  # (n_out, row bytes), or (n_expert, n_out, row bytes)
            rows = math.prod(shape[:-1])
            b.weights[name] = pt.tensor(name, dtype="uint8", shape=(*shape[:-1], nbytes // rows))
        else:
            b.weights[name] = pt.tensor(name, dtype="float32", shape=shape)
    tokens = pt.tensor("tokens", dtype="int64", shape=(N_TOKENS,))
    positions = pt.scalar("start_pos", dtype="int64") + pt.arange(N_TOKENS, dtype="int64")
    from alchemist.runtime.engine import cache_shape, state_kinds

    states = state_kinds(module)
    cache = [
        tuple(
            pt.tensor(f"{kind}_cache.{il}", dtype="float32", shape=cache_shape(kind, row, capacity, states))
            for kind, row in layer
        )
        for il, layer in enumerate(cache_shapes)
    ]
    try:
        with pytensor.config.change_flags(traceback__limit=0):  # no stack walk for every node: 3x faster
            ops = {} if numerics == "exact" else {"ops": primitives(module, numerics)}
            logits, new_cache = module.forward(dict(b.weights), tokens, positions, cache, attend_len=capacity, **ops)
        b.outputs = [logits] + [t for caches in new_cache for t in caches]
        b.outputs = [pt.as_tensor_variable(o) for o in b.outputs]
    except KeyError as e:
        b.error = f"forward reads w[{e.args[0]!r}], which is not in TENSORS" if e.args else "forward raised KeyError"
        return b
    except Exception as e:  # noqa: BLE001 - any failure to build is a finding, with its message
        weights = f"{'quantized' if quantized else 'float32'} weights" + (
            "" if numerics == "exact" else f", {numerics}"
        )
        b.error = f"forward could not be built ({weights}): " + (
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        )
        return b
    b.nodes = list(io_toposort([], b.outputs))
    for node in b.nodes:
        for i, v in enumerate(node.inputs):
            b.clients.setdefault(v, []).append((node, i))
    return b


# ---------------------------------------------------------------------------------------------------
# dequantization: the loader probe and the uint8 weights in the graph
# ---------------------------------------------------------------------------------------------------
def _rope_pairs(values: np.ndarray, n: int) -> np.ndarray:
    """convert_hf_to_gguf's permute by index: row h·d + 2i + j of the result is row h·d + j·d/2 + i of `values`
    (d = rows per head), each head's rotate-half rows as adjacent pairs."""
    d = values.shape[0] // n
    h, i, j = np.meshgrid(np.arange(n), np.arange(d // 2), np.arange(2), indexing="ij")
    source = np.empty(values.shape[0], np.int64)
    source[(h * d + 2 * i + j).ravel()] = (h * d + j * (d // 2) + i).ravel()
    return values[source]


def _mlx_reference(packed: np.ndarray, shape, bits: int, group: int, scales, biases) -> np.ndarray:
    """MLX's affine dequantization element by element: value j of a row is bits [j·bits, (j+1)·bits) of the row's
    bytes read as one little-endian integer; w = scale · q + bias of its group (float32)."""
    rows, n = math.prod(shape[:-1]), shape[-1]
    out = np.empty((rows, n), np.float32)
    packed = packed.reshape(rows, -1)
    for r in range(rows):
        stream = int.from_bytes(packed[r].tobytes(), "little")
        for j in range(n):
            q = np.float32((stream >> (j * bits)) & ((1 << bits) - 1))
            out[r, j] = q * scales[r, j // group] + biases[r, j // group]
    return out.reshape(shape)


def _minifloat(code: int, exponent_bits: int, mantissa_bits: int, bias: int, nan_code: int | None) -> float:
    """A small float's value from its code (sign, exponent, mantissa; subnormal at exponent 0)."""
    sign = -1.0 if code >> (exponent_bits + mantissa_bits) else 1.0
    e, m = (code >> mantissa_bits) & ((1 << exponent_bits) - 1), code & ((1 << mantissa_bits) - 1)
    if nan_code is not None and code & ((1 << (exponent_bits + mantissa_bits)) - 1) == nan_code:
        return math.nan
    if e == 0:
        return sign * math.ldexp(m, 1 - bias - mantissa_bits)
    return sign * math.ldexp((1 << mantissa_bits) + m, e - bias - mantissa_bits)


def _mlx_float_reference(packed: np.ndarray, shape, gtype: str, scales) -> np.ndarray:
    """MLX's float modes element by element (the OCP MX formats): an E2M1 (fp4) or E4M3 (fp8) value times its group's
    scale, E8M0 (2^(code - 127), 255 NaN) for mxfp4 and mxfp8, E4M3 for nvfp4 (groups of 16)."""
    e2m1 = lambda c: _minifloat(c, 2, 1, 1, None)  # noqa: E731
    e4m3 = lambda c: _minifloat(c, 4, 3, 7, 127)  # noqa: E731
    e8m0 = lambda c: math.nan if c == 255 else math.ldexp(1.0, c - 127)  # noqa: E731
    value, bits, scale, group = {"MLX_MXFP4": (e2m1, 4, e8m0, 32), "MLX_MXFP8": (e4m3, 8, e8m0, 32),
                                 "MLX_NVFP4": (e2m1, 4, e4m3, 16)}[gtype]  # fmt: skip
    rows, n = math.prod(shape[:-1]), shape[-1]
    out = np.empty((rows, n), np.float32)
    packed = packed.reshape(rows, -1)
    with np.errstate(over="ignore", invalid="ignore"):  # a huge scale overflows to inf, as in MLX
        for r in range(rows):
            stream = int.from_bytes(packed[r].tobytes(), "little")
            for j in range(n):
                q = (stream >> (j * bits)) & ((1 << bits) - 1)
                out[r, j] = np.float32(value(q)) * np.float32(scale(int(scales[r, j // group])))
    return out.reshape(shape)


def probe_snapshot_loader(module, tensors: dict, kernel: set) -> list[str]:
    """Run a snapshot module's load_weights on a synthetic directory (random values in two files, gaps between
    regions) and compare what it returns with gguf's decoding of the same bytes, after each tensor's transform;
    with quantized=True, the MLX-quantized KERNEL_WEIGHTS as their packed rows, scales and biases."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    transforms = {name: tuple(entry[1]) for name, entry in module.TENSOR_FILES.items()}
    mlx = getattr(module, "MLX_QUANTIZED", None)
    stacked_names, stacked = set(getattr(module, "TENSOR_PARTS", None) or ()), {}
    blobs, table, placed, raw, quant = [bytearray(), bytearray()], {}, {}, {}, {}
    for k, (name, (gtype, shape, _, _)) in enumerate(tensors.items()):
        small = tuple(shape) if len(shape) == 1 or transforms.get(name) else (min(shape[0], 2),) + tuple(shape[1:])
        padded = small
        if transforms.get(name, ())[:1] == ("pad_rows",):  # stored with fewer rows, padded with zeros by the loader
            small = (small[0] - transforms[name][1], *small[1:])
        file = k % 2
        if gtype.startswith("MLX_"):  # packed values in one file, their scales (and biases) in the other
            bits, group = mlx[name][:2]
            rows, n = math.prod(small[:-1]), small[-1]
            data = rng.integers(0, 256, rows * n * bits // 8, dtype=np.uint8)
            parts = []
            for _ in range(2 if gtype == "MLX_AFFINE" else 1):  # float32 scales and biases, or uint8 scale codes
                values = (rng.standard_normal(rows * (n // group)).astype(np.float32) if gtype == "MLX_AFFINE"
                          else rng.integers(0, 256, rows * (n // group), dtype=np.uint8))  # fmt: skip
                blobs[1 - file] += bytes(4 * int(rng.integers(0, 3)))
                parts.append(
                    ((1 - file, len(blobs[1 - file]), values.nbytes, "F32" if values.itemsize == 4 else "U8"),)
                )
                blobs[1 - file] += values.tobytes()
                raw[name, len(parts)] = values.reshape(rows, n // group)
            quant[name] = (bits, group, *parts, *([()] if len(parts) == 1 else []))
            blobs[file] += bytes(4 * int(rng.integers(0, 3)))
            table[name] = (gtype, padded, len(blobs[file]), data.nbytes)
            placed[name] = (file, transforms.get(name, ()))
            raw[name] = data
            blobs[file] += data.tobytes()
            continue
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[gtype]
        data = rng.standard_normal(math.prod(small)).astype(np.float32)
        data = (data.view(np.uint32) >> 16).astype(np.uint16) if gtype == "BF16" else data.astype(dtype)
        if name in stacked_names and len(small) >= 2:  # its parts alternate between the files
            part_bytes = data.nbytes // small[0]
            parts = []
            for j in range(small[0]):
                f = (file + j) % 2
                blobs[f] += bytes(4 * int(rng.integers(0, 3)))
                parts.append((f, len(blobs[f]), part_bytes))
                blobs[f] += data.view(np.uint8)[j * part_bytes : (j + 1) * part_bytes].tobytes()
            stacked[name] = tuple(parts)
            table[name] = (gtype, padded, parts[0][1], data.nbytes)
            placed[name] = (file, transforms.get(name, ()))
            raw[name] = data.view(np.uint8)
            continue
        blobs[file] += bytes(8 * int(rng.integers(0, 3)))  # a gap before every region
        table[name] = (gtype, padded, len(blobs[file]), data.nbytes)
        placed[name] = (file, transforms.get(name, ()))
        raw[name] = data.view(np.uint8)
        blobs[file] += raw[name].tobytes()
    saved = {
        k: module.__dict__.get(k) for k in ("TENSORS", "SOURCE_FILES", "TENSOR_FILES", "MLX_QUANTIZED", "TENSOR_PARTS")
    }
    f: list[str] = []
    with tempfile.TemporaryDirectory(prefix="alchemist-audit-") as tmp:
        names = ("probe-1.safetensors", "probe-2.safetensors")
        for name, blob in zip(names, blobs):
            (Path(tmp) / name).write_bytes(bytes(blob))
        module.TENSORS, module.TENSOR_FILES = table, placed
        if mlx is not None:
            module.MLX_QUANTIZED = quant
        if stacked_names:
            module.TENSOR_PARTS = stacked
        module.SOURCE_FILES = tuple((n, len(b)) for n, b in zip(names, blobs))
        try:
            got = module.load_weights(tmp)
            if not isinstance(got, dict) or set(got) != set(table):
                return ["load_weights(directory) does not return exactly the TENSORS names"]
            f += _probe_packed(module, tmp, table, kernel, placed, raw, quant, got)
            for name, (gtype, small, _, _) in table.items():
                pad = placed[name][1][1] if placed[name][1][:1] == ("pad_rows",) else 0
                stored = (small[0] - pad, *small[1:])
                if gtype == "MLX_AFFINE":
                    want = _mlx_reference(raw[name], stored, *quant[name][:2], raw[name, 1], raw[name, 2])
                elif gtype.startswith("MLX_"):
                    want = _mlx_float_reference(raw[name], stored, gtype, raw[name, 1])
                else:
                    want = dequantize(raw[name].reshape(stored[:-1] + (-1,)), GGMLQuantizationType[gtype])
                want = want.astype(np.float32).reshape(stored)
                if placed[name][1] == ("plus_one",):
                    want = want + np.float32(1.0)
                elif pad:
                    want = np.concatenate([want, np.zeros((pad, *stored[1:]), np.float32)])
                elif placed[name][1]:
                    want = _rope_pairs(want, placed[name][1][1])
                value = np.asarray(got[name])
                if not (value.dtype == want.dtype and value.shape == want.shape and _same(value, want)):
                    f.append(f"load_weights(directory)[{name!r}] is not gguf's float32 decoding of its {gtype} bytes, "
                             f"transformed by {placed[name][1] or 'nothing'}")  # fmt: skip
        except Exception as e:  # noqa: BLE001
            f.append(f"load_weights(directory) raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            module.__dict__.update(saved)
    return f


def _probe_packed(module, directory, table, kernel, placed, raw, quant, dequantized) -> list[str]:
    """load_weights(directory, quantized=True): each MLX-quantized kernel weight as (name: its packed uint32 rows,
    name.scales, name.biases: float32), rows in its transform's order; every other entry as without quantized."""
    packed = {n for n in kernel if table.get(n, ("",))[0] == "MLX_AFFINE"}
    if not packed:
        return []
    call = "load_weights(directory, quantized=True)"
    got = module.load_weights(directory, quantized=True)
    want_names = set(table) | {f"{n}.{part}" for n in packed for part in ("scales", "biases")}
    if not isinstance(got, dict) or set(got) != want_names:
        return [f"{call} does not return the TENSORS names and each packed weight's .scales and .biases"]
    f = []
    for name in table:
        wants = {name: dequantized[name]}
        if name in packed:
            transform = placed[name][1]
            rows = table[name][1][0] - (transform[1] if transform[:1] == ("pad_rows",) else 0)
            wants = {name: raw[name].view(np.uint32).reshape(rows, -1), f"{name}.scales": raw[name, 1],
                     f"{name}.biases": raw[name, 2]}  # fmt: skip
            if transform[:1] == ("pad_rows",):
                wants = {
                    k: np.concatenate([v, np.zeros((transform[1], v.shape[1]), v.dtype)]) for k, v in wants.items()
                }
            elif transform:
                wants = {k: _rope_pairs(v, transform[1]) for k, v in wants.items()}
        for key, want in wants.items():
            value = np.asarray(got[key])
            if not (value.dtype == want.dtype and value.shape == want.shape and _same(value, want)):
                f.append(f"{call}[{key!r}] is not {'its stored values' if name in packed else 'as without quantized'}"
                         f" ({value.dtype}{list(value.shape)})")  # fmt: skip
    return f


def probe_loader(module, tensors: dict, kernel: set) -> list[str]:
    """Run load_weights on a synthetic file (random bytes, two rows per tensor, a non-zero DATA_OFFSET and
    gaps between regions) and compare what it returns with gguf's dequantization of the same bytes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    sizes = ggml_sizes()
    table, raw, blob = {}, {}, bytearray(rng.integers(0, 256, 96, dtype=np.uint8).tobytes())
    data_offset = len(blob)
    for name, (gtype, shape, _, _) in tensors.items():
        small = tuple(shape) if len(shape) == 1 else (min(shape[0], 2),) + tuple(shape[1:])
        block, type_size = sizes[gtype]
        if gtype in ("F32", "F16"):
            data = rng.standard_normal(math.prod(small)).astype(np.float32 if gtype == "F32" else np.float16)
            data = data.view(np.uint8)
        else:
            # bytes below 0x7C: every float16 scale in the blocks is finite, so every value is compared
            data = rng.integers(0, 0x7C, math.prod(small) // block * type_size, dtype=np.uint8)
        blob += bytes(32 + 32 * int(rng.integers(0, 3)))  # a gap before every region
        table[name] = (gtype, small, len(blob) - data_offset, data.size)
        raw[name] = data
        blob += data.tobytes()
    saved = {k: module.__dict__.get(k) for k in ("TENSORS", "DATA_OFFSET", "PROVENANCE")}
    f: list[str] = []
    with tempfile.TemporaryDirectory(prefix="alchemist-audit-") as tmp:
        path = Path(tmp) / "probe.gguf"
        path.write_bytes(bytes(blob))
        module.TENSORS, module.DATA_OFFSET = table, data_offset
        module.PROVENANCE = {**(saved["PROVENANCE"] or {}), "source_size": len(blob)}
        try:
            for quantized in (False, True):
                call = f"load_weights(path, quantized={quantized})"
                try:
                    got = module.load_weights(str(path), quantized=quantized)
                except Exception as e:  # noqa: BLE001
                    f.append(f"{call} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    continue
                if not isinstance(got, dict) or set(got) != set(table):
                    f.append(f"{call} does not return exactly the TENSORS names")
                    continue
                for name, (gtype, small, _, nbytes) in table.items():
                    value = np.asarray(got[name])
                    if quantized and name in kernel:
                        want = raw[name].reshape(*small[:-1], -1)
                        what = "its uint8 GGUF blocks (n_out, bytes per row)"
                    else:
                        rows = raw[name].reshape(small[:-1] + (-1,))
                        want = dequantize(rows, GGMLQuantizationType[gtype]).astype(np.float32).reshape(small)
                        what = f"gguf's float32 dequantization of its {gtype} bytes"
                    if not (value.dtype == want.dtype and value.shape == want.shape and _same(value, want)):
                        f.append(f"{call}[{name!r}] is not {what} ({value.dtype}{list(value.shape)})")
        finally:
            module.__dict__.update(saved)
    return f


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype.kind == "f":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def kernel_findings(b: Build, tensors: dict, kernel: set, roles: dict) -> tuple[list[str], int]:
    """Every uint8 weight of a quantized build is only the blocks of a kernel Op of its type and stored shape (an
    MLX-packed weight's parts: see below)."""
    from pytensor.tensor.subtensor import AdvancedSubtensor

    from alchemist.kernels import MlxAffineMatmul, QuantizedEmbedding, QuantizedExpertMatmul, QuantizedMatmul

    f, n = [], 0
    for name in sorted(kernel):
        gtype, shape = tensors[name][0], tuple(tensors[name][1])
        if gtype == "MLX_AFFINE":  # its packed rows, scales and biases: inputs 1, 2, 3 of one MlxAffineMatmul each,
            # or (a table) the same rows gathered from each, to be dequantized (kernels.mlx_affine.mlx_affine_rows)
            parts = [b.weights[name], b.weights[f"{name}.scales"], b.weights[f"{name}.biases"]]
            gathered = [set() for _ in parts]
            for k, v in enumerate(parts):
                for node, i in b.clients.get(v, []):
                    if isinstance(node.op, MlxAffineMatmul) and i == k + 1 and node.inputs[1:] == parts:
                        n += k == 0
                        if k == 0 and (node.op.n_out, node.op.n_in) != shape:
                            f.append(f"{name} is MLX_AFFINE {shape} but reaches {node.op}")
                    elif isinstance(node.op, AdvancedSubtensor) and i == 0 and roles.get(name) in ROW_ROLES:
                        gathered[k].add(node.inputs[1])
                    else:
                        f.append(f"the packed {name} (MLX_AFFINE) reaches {node.op} (input {i}), not an "
                                 "MlxAffineMatmul of its parts or a gather of rows")  # fmt: skip
            if any(g != gathered[0] for g in gathered):
                f.append(f"the packed {name} (MLX_AFFINE): its rows, scales and biases are gathered by other rows")
            n += len(gathered[0])
            continue
        for node, i in b.clients.get(b.weights[name], []):
            op = node.op
            if isinstance(op, QuantizedMatmul) and i == 1:
                got = (op.ggml_type, op.n_out, op.n_in)
            elif isinstance(op, QuantizedExpertMatmul) and i == 1:
                got = (op.ggml_type, op.n_expert, op.n_out, op.n_in)
            elif isinstance(op, QuantizedEmbedding) and i == 0 and roles.get(name, "embedding") in ROW_ROLES:
                got = (op.ggml_type, op.n_rows, op.n_in)
            else:
                f.append(
                    f"the uint8 blocks of {name} ({gtype}) reach {op} (input {i}), not an alchemist.kernels "
                    "dequantizing Op"
                )
                continue
            n += 1
            if got != (gtype, *shape):
                f.append(f"{name} is {gtype} {shape} but reaches {type(op).__name__}{got}")
    return f, n


def check_dequantization(ctx: Context, g: "GraphAudit") -> object:
    f = list(g.loader)
    kernel_uses = 0
    for b in g.builds + g.ggml_builds:
        if b.quantized:
            found, uses = kernel_findings(b, ctx.tensors(), ctx.kernel_weights(), g.roles)
            f += [m + (f" (numerics={b.numerics!r})" if b.numerics != "exact" else "") for m in found]
            kernel_uses = uses if b.numerics == "exact" else kernel_uses
    types_ = sorted({e[0] for e in ctx.tensors().values()})
    kernel = ctx.kernel_weights()
    ok = (
        f"load_weights returns all {len(ctx.tensors())} TENSORS entries ({', '.join(types_)}) as gguf's float32 "
        "dequantization of their bytes (probed on a synthetic file)"
    )
    if kernel:
        ok += (
            f"; with quantized=True the {len(kernel)} KERNEL_WEIGHTS as uint8 blocks, which the quantized graph "
            f"passes only to alchemist.kernels Ops of their ggml type and (n_out, n_in) ({kernel_uses} uses), with "
            "the module's EXACT primitives and with numerics='ggml'"
        )
    else:
        ok += "; no KERNEL_WEIGHTS, so the graph gets float32 weights only"
    return result("dequantization", f, ok)


# ---------------------------------------------------------------------------------------------------
# orientation
# ---------------------------------------------------------------------------------------------------
def _contracted(node, i: int, ndim: int) -> int | None:
    """The axis of input i that a Dot / matmul node sums over, else None."""
    from pytensor.tensor.blockwise import Blockwise
    from pytensor.tensor.math import Dot

    op = node.op
    if not (isinstance(op, Dot) or (isinstance(op, Blockwise) and isinstance(op.core_op, Dot))):
        return None
    return ndim - 1 if i == 0 else (0 if ndim == 1 else ndim - 2)


def _reads_rows(op, i: int, perm) -> bool:
    """The op selects whole rows of its input i (indexed or sliced on axis 0), and that axis is the table's 0."""
    from pytensor.tensor.subtensor import AdvancedSubtensor, Subtensor

    idx = getattr(op, "idx_list", ())
    return (
        isinstance(op, (AdvancedSubtensor, Subtensor))
        and i == 0
        and perm[0] == 0
        and bool(idx)
        and isinstance(idx[0], slice) == isinstance(op, Subtensor)
        and all(isinstance(s, slice) and s == slice(None) for s in idx[1:])
    )


def orientation_findings(b: Build, tensors: dict, roles: dict) -> tuple[list[str], int]:
    from pytensor.tensor.elemwise import DimShuffle, Elemwise

    f, n = [], 0
    for name, var in b.weights.items():
        if name not in tensors:  # an MLX-packed weight's scales or biases: checked with it (dequantization)
            continue
        role = roles.get(name)
        if var.dtype == "float32" and role == "experts" and var.ndim == 3:
            found, uses = expert_orientation(b, name, var, tensors[name][1])
            f, n = f + found, n + uses
            continue
        if var.dtype != "float32" or var.ndim != 2 or role in ELEMENTWISE_ROLES:
            continue
        if role not in ("linear", "conv", "norm", *ROW_ROLES):
            f.append(f"{name} is a 2-D tensor of role {role!r}, for which the auditor has no orientation rule")
            continue
        stack, uses = [(var, (0, 1))], 0  # (variable, original axis at each position)
        while stack:
            v, perm = stack.pop()
            for node, i in b.clients.get(v, []):
                op, out = node.op, node.outputs[0]
                if isinstance(op, DimShuffle):
                    stack.append((out, tuple(None if o == "x" else perm[o] for o in op.new_order)))
                elif role == "conv" and isinstance(op, Elemwise) and len(node.inputs) == 2:
                    # a depthwise filter (channels, taps) multiplies a window of activations (…, taps, channels):
                    # its channel axis must be the activations' last
                    uses += 1
                    if perm[-1] != 0 or perm[-2] != 1:
                        f.append(
                            f"{name} (conv, stored (channels, taps) = {tensors[name][1]}) meets the activations with "
                            f"its axes in order {perm}: its channel axis 0 must be last, its taps axis 1 before it"
                        )
                elif role == "norm" and isinstance(op, Elemwise) and len(node.inputs) == 2:
                    # a norm's scale per row (a head's, a group's) multiplies normed activations (…, rows, width)
                    # with its axes as stored
                    uses += 1
                    if tuple(perm[-2:]) != (0, 1):
                        f.append(
                            f"{name} (norm, stored (rows, width) = {tensors[name][1]}) meets the activations with "
                            f"its axes in order {perm}, not as stored"
                        )
                elif isinstance(op, Elemwise) and out.type.shape == v.type.shape:
                    stack.append((out, perm))  # scaled, cast: the same axes
                elif role != "position_embedding" and (axis := _contracted(node, i, v.ndim)) is not None:
                    uses += 1
                    if perm[axis] != 1:
                        f.append(
                            f"{name} ({role}, stored (n_out, n_in) = {tensors[name][1]}) is contracted over "
                            f"its axis {perm[axis]}, not its axis 1 (x @ W.T)"
                        )
                elif role in ROW_ROLES and _reads_rows(op, i, perm):
                    uses += 1  # table[tokens], table[start:stop]
                else:
                    f.append(
                        f"{name} ({role}) reaches {op} (input {i}) with its axes in order {perm}, where its "
                        "orientation cannot be checked"
                    )
        if not uses and var in b.clients:
            f.append(f"{name} ({role}) is never applied as a matrix (contracted, or gathered by rows)")
        n += uses
    return f, n


def expert_orientation(b: Build, name: str, var, shape) -> tuple[list[str], int]:
    """A float32 stack of experts (n_expert, n_out, n_in): gathered by expert on axis 0, then each chosen
    matrix contracted over its axis 2 (x @ W[e].T)."""
    from pytensor.tensor.elemwise import DimShuffle, Elemwise
    from pytensor.tensor.subtensor import AdvancedSubtensor

    f, uses, stack = [], 0, [(var, (0, 1, 2))]
    while stack:
        v, perm = stack.pop()
        for node, i in b.clients.get(v, []):
            op, out = node.op, node.outputs[0]
            if isinstance(op, DimShuffle):
                stack.append((out, tuple(None if o == "x" else perm[o] for o in op.new_order)))
            elif isinstance(op, Elemwise) and out.type.shape == v.type.shape:
                stack.append((out, perm))
            elif (
                isinstance(op, AdvancedSubtensor)
                and i == 0
                and perm[0] == 0
                and len(node.inputs) == 2
                and node.inputs[1].dtype.startswith("int")
            ):
                stack.append((out, (None,) * node.inputs[1].ndim + perm[1:]))  # W[experts]: the chosen matrices
            elif (axis := _contracted(node, i, v.ndim)) is not None and 0 not in perm:
                uses += 1
                if perm[axis] != 2:
                    f.append(
                        f"{name} (experts, stored (n_expert, n_out, n_in) = {shape}) is contracted over its axis "
                        f"{perm[axis]}, not its axis 2 (x @ W[e].T)"
                    )
            else:
                f.append(
                    f"{name} (experts) reaches {op} (input {i}) with its axes in order {perm}, where its orientation "
                    "cannot be checked (experts are gathered by expert, then contracted over n_in)"
                )
    if not uses and var in b.clients:
        f.append(f"{name} (experts) is never applied as a matrix (gathered by expert, then contracted)")
    return f, uses


def check_orientation(ctx: Context, g: "GraphAudit"):
    f, n = [], 0
    for b in g.builds:
        found, count = orientation_findings(b, ctx.tensors(), g.roles)
        f += [x for x in found if x not in f]
        n += count
    float_2d = sum(1 for e in ctx.tensors().values() if len(e[1]) == 2)
    experts = sum(1 for role in g.roles.values() if role == "experts")
    return result(
        "orientation",
        f,
        (
            f"every float32 2-D weight ({float_2d} linear/embedding tensors) is contracted over its axis 1 (x @ W.T for "
            f"W stored (n_out, n_in)) or, an embedding, gathered by rows ({n} uses followed through transposes into "
            "dot/matmul or row gathers); the kernels' (n_out, n_in) are checked under dequantization"
        )
        + (
            f"; every float32 expert stack ({experts} tensors, (n_expert, n_out, n_in)) is gathered by expert and "
            "contracted over its axis 2"
            if experts
            else ""
        ),
    )


# ---------------------------------------------------------------------------------------------------
# heads
# ---------------------------------------------------------------------------------------------------
def _axis(axis) -> str:
    return " × ".join(f"{k} {s}" for k, s in axis)


class HeadLayouts:
    """Labels the axes of each variable downstream of a head split: an axis is a tuple of (kind, size)
    factors, outer to inner (kinds head / kv / group / dim, "mix" for a slice across heads, "?" unknown)."""

    def __init__(self, b: Build, heads: list[tuple[int, int, int]]):
        self.b, self.f, self.splits, self.merges = b, [], 0, 0
        self.widths = {}  # width -> the head layouts a projection of it may split into (layers' sizes may differ)
        for n_head, n_kv, d in heads:
            self.widths.setdefault(n_head * d, []).append(("head", n_head, n_kv, d))
            self.widths.setdefault(n_kv * d, []).append(("kv", n_kv, n_kv, d))
        self.layout: dict = {}
        self.weighty = set(b.weights.values())

    def axes(self, v):
        return self.layout.get(v) or (None,) * v.ndim

    def finding(self, text: str):
        if text not in self.f:
            self.f.append(text)

    def run(self):
        from pytensor.tensor.basic import Join
        from pytensor.tensor.elemwise import DimShuffle, Elemwise
        from pytensor.tensor.shape import Reshape
        from pytensor.tensor.subtensor import AdvancedIncSubtensor, AdvancedSubtensor, IncSubtensor, Subtensor

        for node in self.b.nodes:
            op, ins, out = node.op, node.inputs, node.outputs[0]
            if isinstance(op, (DimShuffle, Elemwise)) and any(
                v in self.weighty and (isinstance(op, DimShuffle) or v.type.shape == out.type.shape) for v in ins
            ):
                self.weighty.add(out)  # a matrix weight, transposed or scaled
            if not isinstance(op, Reshape) and not any(v in self.layout for v in ins):
                continue
            if isinstance(op, Reshape):
                new = self.reshape(ins[0], out)
            elif isinstance(op, DimShuffle):
                a = self.axes(ins[0])
                new = tuple(None if o == "x" else a[o] for o in op.new_order)
            elif isinstance(op, Elemwise):
                new = self.merge(out, [self.axes(v) for v in ins if v.ndim == out.ndim])
            elif isinstance(op, Subtensor):
                new = self.subtensor(ins[0], out, op.idx_list)
            elif isinstance(op, (IncSubtensor, AdvancedIncSubtensor)):
                k = min(ins[1].ndim, out.ndim)
                value = (None,) * (out.ndim - k) + self.axes(ins[1])[ins[1].ndim - k :]
                new = self.merge(out, [self.axes(ins[0]), value])
            elif isinstance(op, AdvancedSubtensor):
                new = self.gather(ins[0], out, op.idx_list)
            elif isinstance(op, Join):
                new = self.join(op.axis % out.ndim, [v for v in ins if v.ndim == out.ndim], out)
            elif _contracted(node, 0, ins[0].ndim) is not None:
                new = self.contract(node)
            else:  # an op of one array (softmax, ...) that keeps its shape keeps its layout
                arrays = [v for v in ins if v.ndim == out.ndim]
                keep = len(arrays) == 1 and arrays[0].type.shape == out.type.shape and arrays[0] not in self.weighty
                new = self.axes(arrays[0]) if keep else None
            if new is not None and any(a for a in new):
                self.layout[out] = tuple(a or None for a in new)
        return self

    @staticmethod
    def merge(out, layouts):
        new = []
        for ax in range(out.ndim):
            size = out.type.shape[ax]
            # a label of another size does not describe this axis (the token axis of the rows written into a
            # cache of more rows): keeping it would mislabel the cache's rows
            labels = [
                lay[ax]
                for lay in layouts
                if lay[ax] is not None and size != 1 and (size is None or math.prod(s for _, s in lay[ax]) == size)
            ]
            new.append(labels[0] if labels else None)
        return tuple(new)

    def reshape(self, x, out):
        lay, shape, new_shape = list(self.axes(x)), x.type.shape, out.type.shape
        # a split of the last axis, not only new leading axes ((T, width) -> (B, T, width)) or head axes
        # regrouped beside an unchanged last one
        grown = tuple(new_shape[out.ndim - x.ndim :]) == tuple(shape) or (new_shape[-1] == shape[-1] and any(lay[:-1]))
        if lay and lay[-1] is None and shape[-1] in self.widths and out.ndim > x.ndim and not grown:
            split = new_shape[x.ndim - 1 :]
            layouts = self.widths[shape[-1]]
            kind, n, n_kv, d = next((c for c in layouts if split in _head_splits(*c)), layouts[0])
            if None in new_shape or new_shape[: x.ndim - 1] != shape[:-1]:
                self.finding(
                    f"a reshape {shape} -> {new_shape} splits a projection of width {shape[-1]} = {n}·{d} "
                    "without static leading shapes"
                )
                return None
            if split not in _head_splits(kind, n, n_kv, d):
                self.finding(
                    f"a reshape splits a projection of width {shape[-1]} into {split}, not ({n} heads, "
                    f"{d} head_dim)" + (f" or kv-major ({n_kv}, {n // n_kv}, {d})" if kind == "head" else "")
                )
            self.splits += 1
            lay[-1] = ((kind, n), ("dim", d))
        if not any(lay):
            return None
        if None in new_shape or None in shape:
            self.finding(f"a reshape of heads {shape} -> {new_shape} has no static shape")
            return None
        factors = [fc for ax, s in zip(lay, shape) for fc in (ax if ax else (("?", s),)) if fc[1] != 1]
        out_axes = []
        for s in new_shape:
            axis, need = [], s
            while need > 1 and factors:
                kind, size = factors[0]
                if need % size == 0:
                    axis.append(factors.pop(0))
                    need //= size
                elif size % need == 0:
                    outer, inner = self.split(kind, need, size // need)
                    axis.append(outer)
                    factors[0] = inner
                    need = 1
                else:
                    self.finding(f"a reshape {shape} -> {new_shape} cuts a {kind} axis of {size} across {need}")
                    return None
            out_axes.append(tuple(axis))
        for axis in out_axes:
            ranks = [RANK[k] for k, _ in axis if k in RANK]
            if ranks != sorted(ranks):
                self.finding(
                    f"a reshape {shape} -> {new_shape} merges {_axis(axis)}: "
                    "heads must be outer of head_dim, kv heads outer of their group"
                )
            elif len(set(ranks)) > 1:
                self.merges += 1
        return tuple(out_axes)

    def split(self, kind, a, b):
        if kind in ("dim", "?", "mix"):
            return (kind, a), (kind, b)
        layouts = [c for cs in self.widths.values() for c in cs]
        want = [(n_kv, n // n_kv) for k, n, n_kv, _ in layouts if k == "head" and n == a * b]
        if kind == "head" and (a, b) in want:
            return ("kv", a), ("group", b)
        self.finding(
            f"a reshape splits {a * b} {kind} into ({a}, {b})"
            + (f", not kv-major {want[0]} (query head h reads kv head h // group)" if want else "")
        )
        return ("mix", a), ("mix", b)

    def subtensor(self, x, out, idx_list):
        lay, new, o = self.axes(x), [], 0
        for ax in range(x.ndim):
            entry = idx_list[ax] if ax < len(idx_list) else slice(None)
            if not isinstance(entry, slice):
                continue  # an integer index drops the axis
            size, label = out.type.shape[o], lay[ax]
            if label is None or size == x.type.shape[ax]:
                new.append(label)
            else:
                kinds = {k for k, _ in label}
                new.append(
                    (("dim", size),) if kinds == {"dim"} else (("mix", size),) if kinds & {*HEAD_KINDS} else None
                )
            o += 1
        return tuple(new)

    def gather(self, x, out, idx_list):
        """x[..., index, ...]: the axes beside the (adjacent) indexed ones keep their labels where their size is
        kept; the indexed ones become the index's axes, unlabelled (which head a gathered row is, is unknown)."""
        entries = list(idx_list) + [slice(None)] * (x.ndim - len(idx_list))
        indexed = [ax for ax, e in enumerate(entries) if not isinstance(e, slice)]
        if not indexed or indexed != list(range(indexed[0], indexed[-1] + 1)):
            return None  # indexed axes apart: NumPy moves them first
        lay, n_index = self.axes(x), out.ndim - (x.ndim - len(indexed))
        kept = [ax for ax in range(x.ndim) if ax not in indexed]
        labels = [lay[ax] for ax in kept]
        new = labels[: indexed[0]] + [None] * n_index + labels[indexed[0] :]
        sizes = [x.type.shape[ax] for ax in kept]
        sizes = sizes[: indexed[0]] + [None] * n_index + sizes[indexed[0] :]
        return tuple(label if size == out.type.shape[o] else None for o, (label, size) in enumerate(zip(new, sizes)))

    def join(self, axis, parts, out):
        new = list(self.merge(out, [self.axes(v) for v in parts]))
        kinds = {k for v in parts for k, _ in (self.axes(v)[axis] or (("?", 0),))}
        size = out.type.shape[axis]
        new[axis] = (("dim", size),) if kinds == {"dim"} else (("mix", size),) if kinds & {*HEAD_KINDS} else None
        return tuple(new)

    def contract(self, node):
        a, b = node.inputs
        la, lb = self.axes(a), self.axes(b)
        ca, cb = _contracted(node, 0, a.ndim), _contracted(node, 1, b.ndim)
        if not (a in self.weighty or b in self.weighty):
            for lay, ax in ((la, ca), (lb, cb)):
                held = [f"{k} {s}" for k, s in (lay[ax] or ()) if k in HEAD_KINDS]
                if held:
                    self.finding(
                        f"a matmul {a.type.shape} @ {b.type.shape} sums over an axis holding "
                        f"{' × '.join(held)}: heads must stay apart, only head_dim is summed"
                    )
            for x, y in zip(la[:-2], lb[:-2]):
                kinds_x, kinds_y = {k for k, _ in x or ()} - {"?"}, {k for k, _ in y or ()} - {"?"}
                if kinds_x and kinds_y and kinds_x != kinds_y:  # an unknown ("?") axis pairs with anything
                    self.finding(
                        f"a matmul {a.type.shape} @ {b.type.shape} pairs {_axis(x)} of one side with {_axis(y)}"
                    )
        if a in self.weighty or b in self.weighty:
            if a.ndim >= 3 and b.ndim >= 3 and (a in self.weighty) != (b in self.weighty):
                # one matrix per head (a batched matmul with a 3-D weight): the heads stay apart, and what each
                # head's matrix gives is within that head
                act = lb if a in self.weighty else la
                out = node.outputs[0]
                batch = self.merge(out, [act[:-2] + (None, None)])[:-2]
                within = (("dim", out.type.shape[-1]),) if out.type.shape[-1] else None
                return batch + ((None, within) if a in self.weighty else (la[-2], within))
            return None
        if node.outputs[0].ndim == 2 and a.ndim == 2 and b.ndim == 2:
            return (la[0], lb[1])
        if a.ndim >= 2 and b.ndim >= 2:
            batch = self.merge(node.outputs[0], [la[:-2] + (None, None), lb[:-2] + (None, None)])[:-2]
            return batch + (la[-2], lb[-1])
        return None


def _head_splits(kind: str, n: int, n_kv: int, d: int) -> tuple[tuple[int, ...], ...]:
    """The shapes a projection of n heads of d may split into: (heads, head_dim), and kv-major for query heads."""
    return ((n, d), (n_kv, n // n_kv, d)) if kind == "head" else ((n, d),)


def check_heads(ctx: Context, g: "GraphAudit"):
    f, splits, merges = [], 0, 0
    heads = sorted(
        {(lay.attention.n_head, lay.attention.n_kv_head, lay.attention.head_dim) for lay in ctx.ir.attention_layers}
    )
    if not heads:
        # without attention, Mamba-2's heads: x split into (heads, head_dim), its groups (sharing B and C) kv-major
        heads = sorted({(lay.ssm.n_head, lay.ssm.n_group, lay.ssm.head_dim) for lay in ctx.ir.layers if lay.ssm})
    # a gated q projection splits into heads of queries and gates, 2·head_dim each
    heads += sorted(
        {
            (a.n_head, a.n_kv_head, 2 * a.head_dim)
            for a in (lay.attention for lay in ctx.ir.attention_layers)
            if a.output_gate
        }
    )
    # a latent attention's queries split into heads of [not rotated | rotated] before the latent's width
    heads += sorted(
        {
            (a.n_head, a.n_head, a.latent.head_dim_nope + a.rope.dim)
            for a in (lay.attention for lay in ctx.ir.attention_layers)
            if a.latent is not None
        }
    )
    for b in g.builds:
        h = HeadLayouts(b, heads).run()
        f += [x for x in h.f if x not in f]
        splits, merges = max(splits, h.splits), max(merges, h.merges)
    if not splits:
        f.append("no reshape splits a projection of width n_head·head_dim into heads: the head layout is unchecked")
    shown = "; ".join(f"n_head {n}, n_kv_head {k}, head_dim {d}" for n, k, d in heads)
    return result(
        "heads",
        f,
        (
            f"{splits} reshapes split projections into (heads, head_dim) with static shapes ({shown}), query heads "
            f"kv-major; {merges} merge heads back outer of head_dim; heads are followed through reshapes, transposes, "
            "slices, joins and matmuls, and no matmul other than with a weight sums over heads"
        ),
    )


# ---------------------------------------------------------------------------------------------------
# coverage
# ---------------------------------------------------------------------------------------------------
def unread(b: Build) -> list[str]:
    """TENSORS names whose input does not reach the outputs other than through its shape."""
    from pytensor.tensor.shape import Shape, Shape_i

    seen, stack = set(), list(b.outputs)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v.owner is not None and not isinstance(v.owner.op, (Shape, Shape_i)):
            stack.extend(v.owner.inputs)
    return [name for name, var in b.weights.items() if var not in seen]


def check_coverage(ctx: Context, g: "GraphAudit"):
    # a tensor may be read only for long contexts (LongRoPE's long factors): unread by every short-cache build
    # but read over the whole trained context counts as read
    short_unread = [set(unread(b)) for b in g.builds]
    long_only = set.intersection(*short_unread) - set.union(set(), *(set(unread(b)) for b in g.long_builds))
    long_only = long_only if g.long_builds else set()
    f = []
    for b in g.builds + g.ggml_builds:
        not_read = set(unread(b))
        for name in sorted(not_read - g.unread, key=list(b.weights).index):
            msg = f"{name} is never read by forward (it does not reach the logits or the cache)"
            msg += f" with numerics={b.numerics!r}" if b.numerics != "exact" else ""
            if name not in long_only and msg not in f:
                f.append(msg)
        for name in sorted(g.unread - not_read):
            msg = f"{name} is read by forward, but the IR says llama.cpp never applies it"
            if msg not in f:
                f.append(msg)
    n_read = len(ctx.tensors()) - len(g.unread)
    return result(
        "coverage",
        f,
        (
            f"all {n_read} TENSORS entries reach the logits or the KV cache in the graph of forward"
            + (" (float32 and quantized weights)" if len(g.builds) > 1 else "")
            + (" and with numerics='ggml'" if g.ggml_builds else "")
            + (f"; the {len(g.unread)} the IR marks unapplied by llama.cpp do not" if g.unread else "")
            + "; forward reads no name outside TENSORS"
        ),
    )


# ---------------------------------------------------------------------------------------------------
GRAPH_CHECKS = {
    "dequantization": check_dequantization,
    "orientation": check_orientation,
    "heads": check_heads,
    "coverage": check_coverage,
}
NEEDS_IR = ("orientation", "heads")


@dataclass
class GraphAudit:
    error: str | None = None  # why the module could not be imported
    loader: list = field(default_factory=list)
    builds: list = field(default_factory=list)
    ggml_builds: list = field(default_factory=list)  # with numerics="ggml" (dequantization and coverage only)
    long_builds: list = field(default_factory=list)  # over the whole trained context (coverage only)
    roles: dict = field(default_factory=dict)
    unread: set = field(default_factory=set)  # tensors the IR says llama.cpp loads but never applies


def graph_audit(ctx: Context) -> GraphAudit:
    if ctx._graph is not None:
        return ctx._graph
    g = ctx._graph = GraphAudit()
    tensors, kernel = ctx.tensors(), ctx.kernel_weights()
    try:
        module = load_isolated(ctx.src.text, ctx.src.path_name)
    except Exception as e:  # noqa: BLE001
        g.error = f"importing the module raised {type(e).__name__}: {e}"
        return g
    snapshot = getattr(module, "TENSOR_FILES", None) is not None
    g.loader = probe_snapshot_loader(module, tensors, kernel) if snapshot else probe_loader(module, tensors, kernel)
    if ctx.ir is not None:
        g.roles = {t.name: t.role for t in ctx.ir.tensors}
        g.unread = {t.name for t in ctx.ir.tensors if not t.read}
        shapes = ctx.ir.layer_caches()  # one group per layer that owns caches (a KV-sharing layer owns none)
    elif isinstance(ctx.src.constant("LAYER_CACHES"), tuple):
        shapes = ctx.src.constant("LAYER_CACHES")
    else:
        n_kv, head_dim, n_layer = (ctx.src.constant(n) for n in ("N_KV_HEAD", "HEAD_DIM", "N_LAYER"))
        n_cache = ctx.src.constant("N_KV_CACHE") if "N_KV_CACHE" in ctx.src.assignments else n_layer
        if not all(isinstance(v, int) for v in (n_kv, head_dim, n_cache)):
            g.error = "not checked: needs the IR (give the GGUF) for the KV-cache shapes"
            return g
        shapes = [(("k", (n_kv, head_dim)), ("v", (n_kv, head_dim)))] * n_cache
    for quantized in (False, True) if kernel else (False,):
        g.builds.append(build_forward(module, tensors, kernel, shapes, quantized))
    if hasattr(module, "EXACT"):  # the bundle load_llm computes with by default: its graph reads the same tensors
        g.ggml_builds.append(build_forward(module, tensors, kernel, shapes, bool(kernel), numerics="ggml"))
    context = ctx.ir.n_ctx_train if ctx.ir is not None else None
    original = ctx.src.constant("ROPE_ORIG_CTX")
    if context and isinstance(original, int) and not isinstance(original, bool):
        context = max(context, original + 1)  # LongRoPE reads its long factors past the original context only
    if context and context > CAPACITY:
        long = build_forward(module, tensors, kernel, shapes, False, capacity=context)
        if long.error is None:
            g.long_builds.append(long)
    return g


def run_graph_check(name: str, ctx: Context):
    from alchemist.audit.report import CheckResult

    if not ctx.safe:
        return CheckResult(name, False, "not checked: the module is imported only once the safety check passes")
    if ctx.ir is None and name in NEEDS_IR:
        return CheckResult(
            name, False, "not checked: needs the IR (give the GGUF) for the tensors' roles and head sizes"
        )
    g = graph_audit(ctx)
    if g.error:
        return CheckResult(name, False, g.error)
    builds = g.builds + (g.ggml_builds if name in ("dequantization", "coverage") else [])
    errors = [b.error for b in builds if b.error]
    if errors:
        return result(name, errors + (g.loader if name == "dequantization" else []), "")
    return GRAPH_CHECKS[name](ctx, g)
