"""A Hugging Face snapshot directory (config.json and safetensors files) read into the facts a GGUF file gives:
GGUF metadata keys, GGUF tensor names and the tensors' places in their files, so that the families, the IR and
everything after them do not know which front end read the model.

What llama.cpp's convert_hf_to_gguf does is done here as data: config.json keys become GGUF keys (COMMON_CONFIG,
plus the family's own), tensor names go through gguf-py's TensorNameMap (the converter's own map), and a
family's weight transforms are recorded per tensor for the loader (llama's q and k rows, reordered for NORM
RoPE, Gemma's norms shifted by one). Nothing is copied: each tensor stays where it is in its file."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from alchemist.errors import UnsupportedModelError
from alchemist.gguf_io import TensorInfo
from alchemist.snapshot.safetensors import DTYPES, Entry, SnapshotError, read_safetensors, snapshot_files

# config.json key(s), first present wins -> GGUF key (convert_hf_to_gguf's TextModel.set_gguf_parameters)
COMMON_CONFIG = (
    (("num_hidden_layers", "n_layer", "num_layers"), "block_count"),
    (("max_position_embeddings", "n_ctx", "n_positions"), "context_length"),
    (("hidden_size", "n_embd", "dim"), "embedding_length"),
    (("intermediate_size", "n_inner"), "feed_forward_length"),
    (("num_attention_heads", "n_head"), "attention.head_count"),
    (("num_key_value_heads",), "attention.head_count_kv"),
    (("rope_theta",), "rope.freq_base"),
    (("rms_norm_eps", "norm_eps"), "attention.layer_norm_rms_epsilon"),
    (("layer_norm_eps", "layer_norm_epsilon"), "attention.layer_norm_epsilon"),
    (("head_dim",), "attention.key_length"),
    (("head_dim",), "attention.value_length"),
    (("num_local_experts", "num_experts"), "expert_count"),
    (("num_experts_per_tok",), "expert_used_count"),
)
MAX_CONFIG_BYTES = 1 << 20
MAX_LIST = 4096  # a per-layer list in config.json: at most this many entries
# MLX's quantization modes: mode -> (the weight's type, (bits, group size) the mode fixes, or None: config's). affine:
# w = scale · q + bias; mxfp4 / mxfp8: w = E2M1 / E4M3 value · 2^(E8M0 scale - 127); nvfp4: E2M1 · E4M3 scale
MLX_MODES = {"affine": ("MLX_AFFINE", None), "mxfp4": ("MLX_MXFP4", (4, 32)), "mxfp8": ("MLX_MXFP8", (8, 32)),
             "nvfp4": ("MLX_NVFP4", (4, 16))}  # fmt: skip


@dataclass
class SnapshotFacts:
    """GGUFFacts' view of a snapshot: `path` is the directory; a tensor's `offset` is absolute in its file
    (`source_files[info.file]`), its `transform` what the loader does to its values."""

    path: str
    file_size: int  # the files' bytes, together
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    source_files: tuple[tuple[str, int], ...]  # (name relative to the directory, size)
    data_offset: int = 0
    version: str = "safetensors"
    alignment: int = 1
    metadata_types: dict[str, str] = field(default_factory=dict)
    _sha256: str | None = field(repr=False, default=None)

    @property
    def file_name(self) -> str:
        return os.path.basename(os.path.normpath(self.path))

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def sha256(self) -> str:
        """The snapshot's identity: sha256 over each file's name, size and sha256 (config.json included)."""
        if self._sha256 is None:
            from alchemist.gguf_io.reader import _cached_file_sha256

            names = ["config.json", *(name for name, _ in self.source_files)]
            lines = [f"{n}\t{os.path.getsize(os.path.join(self.path, n))}\t"
                     f"{_cached_file_sha256(os.path.join(self.path, n))}\n" for n in names]  # fmt: skip
            self._sha256 = hashlib.sha256("".join(lines).encode()).hexdigest()
        return self._sha256

    def tensor_bytes(self, name: str) -> np.ndarray:
        """A tensor's stored bytes (before its transform), a read-only view into its file's memory map."""
        info = self.tensors[name]
        data = np.memmap(os.path.join(self.path, self.source_files[info.file][0]), dtype=np.uint8, mode="r")
        return data[info.offset : info.offset + info.nbytes]


def is_snapshot(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _family_for(config: dict, where: str):
    from alchemist.arch import FAMILIES

    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if family.snapshot is not None and model_type in family.snapshot.model_types:
            return family
    readable = sorted(t for f in FAMILIES.values() if f.snapshot for t in f.snapshot.model_types)
    raise UnsupportedModelError(f"{where}: model_type {model_type!r} is not read from snapshots yet "
                                f"(read: {', '.join(readable)}; every family reads from GGUF)")  # fmt: skip


def _gguf_value(value, where: str, key: str):
    """A config value as GGUF stores it: integers as they are, numbers as float32 (as the converter writes), a
    per-layer list of them as an int32 or float32 array."""
    if isinstance(value, list) and value and len(value) <= MAX_LIST:
        values = [_gguf_value(v, where, key) for v in value]
        return np.array(values, np.int32 if all(isinstance(v, int) for v in values) else np.float32)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SnapshotError(where, key, f"expected a number, got {value!r}")
    return value if isinstance(value, int) else float(np.float32(value))


def _metadata(config: dict, family, where: str) -> dict:
    arch = family.name
    meta: dict[str, Any] = {"general.architecture": arch}
    if isinstance(config.get("name_or_path"), str):
        meta["general.name"] = config["name_or_path"]
    pairs = [*COMMON_CONFIG, *((((k,), g) for k, g in family.snapshot.config))]
    for keys, gguf_key in pairs:
        key = next((k for k in keys if config.get(k) is not None), None)
        if key is not None:
            meta[f"{arch}.{gguf_key}"] = _gguf_value(config[key], where, key)
    for key, gguf_key, value in family.snapshot.flags:
        names = config.get(key)
        if names is not None:
            if not (isinstance(names, list) and 0 < len(names) <= MAX_LIST and all(isinstance(n, str) for n in names)):
                raise SnapshotError(where, key, f"expected a list of names, got {names!r:.80}")
            meta[f"{arch}.{gguf_key}"] = np.array([n == value for n in names], np.bool_)
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind == "linear":
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = _gguf_value(scaling.get("factor"), where, "rope_scaling.factor")
    elif kind not in (None, "default"):
        raise UnsupportedModelError(f"{where}: rope_scaling {kind!r} is not read from snapshots yet")
    if family.snapshot.permute_qk:
        heads = meta.get(f"{arch}.attention.head_count")
        head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
        meta[f"{arch}.rope.dimension_count"] = _gguf_value(head_dim, where, "head_dim")
    return meta


def _stacked(entries: dict, stacks, files) -> tuple[dict, dict, dict]:
    """entries with each family stack (SnapshotSpec.stacks) of tensors replaced by one entry of the stacked shape,
    {stacked name: ((file, offset, nbytes) of each part, in index order)} and {stacked name: its parts' names}."""
    groups: dict[str, dict[int, str]] = {}
    for hf_name in entries:
        for pattern, target in stacks:
            m = re.search(pattern, hf_name)
            if m:
                groups.setdefault(hf_name[: m.start()] + m.expand(target), {})[int(m.group("i"))] = hf_name
                break
    members = {n for g in groups.values() for n in g.values()}  # one set: a stack of experts per layer is many names
    out = {n: v for n, v in entries.items() if n not in members}
    parts, names = {}, {}
    for name, members in groups.items():
        order = [members[k] for k in sorted(members)]
        first_file, first = entries[order[0]]
        where = str(files[first_file])
        if sorted(members) != list(range(len(members))):
            raise SnapshotError(where, f"tensor {order[0]!r}", f"its stack {name} lacks some of 0..{len(members) - 1}")
        if any(entries[n][1].shape != first.shape or entries[n][1].dtype != first.dtype for n in order):
            raise SnapshotError(
                where, f"tensor {order[0]!r}", f"the tensors stacked into {name} differ in shape or type"
            )
        nbytes = sum(entries[n][1].nbytes for n in order)
        out[name] = (first_file, Entry(first.dtype, (len(order), *first.shape), first.start, nbytes))
        parts[name] = tuple((entries[n][0], entries[n][1].start, entries[n][1].nbytes) for n in order)
        names[name] = tuple(order)
    return out, parts, names


def _padded(shape: tuple, transform: tuple, key: str | None, config: dict, file, hf_name: str) -> tuple:
    """(shape, transform) of a table the converter pads with zero rows up to config[key] (SnapshotSpec.pad_rows):
    the padded shape and ("pad_rows", n); as they were when it has them all."""
    wanted = config.get(key) if key else None
    if wanted is None or wanted == shape[0]:
        return tuple(shape), transform
    if not (isinstance(wanted, int) and wanted > shape[0]) or transform:
        raise SnapshotError(str(file), f"tensor {hf_name!r}", f"has {shape[0]} rows, more than {key} {wanted!r}")
    return (wanted, *shape[1:]), ("pad_rows", wanted - shape[0])


def _stacked_quantized(config, config_path, name: str, members: list, quantized: set, entries: dict, files):
    """(the dequantized stacked shape, quant) of a stack of MLX-quantized tensors: the same bits, group size and
    shape in each, their scales and biases one region a part, in the stack's order."""
    where = str(files[entries[members[0] + ".weight"][0]])
    if not all(m in quantized for m in members):
        raise SnapshotError(where, f"tensor {name!r}", "stacks quantized and unquantized tensors")
    each = [_mlx_quantized(config, config_path, m, entries[m + ".weight"][1], entries, files) for m in members]
    if len({(shape, quant[:2], gtype) for shape, quant, gtype in each}) != 1:
        raise SnapshotError(where, f"tensor {name!r}", "stacks tensors quantized with different bits, groups or shapes")
    shape, (bits, group, _, _), gtype = each[0]
    scales, biases = sum((q[2] for _, q, _ in each), ()), sum((q[3] for _, q, _ in each), ())
    return (len(each), *shape), (bits, group, scales, biases), gtype


def _mlx_quantized(config: dict, config_path, module: str, e, entries: dict, files) -> tuple[tuple, tuple]:
    """(the dequantized shape, TensorInfo.quant) of MLX's quantized `module`: its packed uint32 `weight` (each row
    its values' bits end to end, LSB first), `scales` and `biases` per group of `group_size` values of a row, with
    the bits and group size config.json's `quantization` gives (for this module, or for all). quant is (bits, group
    size, scales' regions, biases' regions), a region (file, offset, nbytes, type): one each here."""
    where = str(config_path)
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict):
        raise SnapshotError(where, "quantization", f"{module} is quantized (it has .scales) but config.json says how")
    own = q.get(module, q)
    if own is False or not isinstance(own, dict):
        raise SnapshotError(where, f"quantization.{module}", "says the module is not quantized, but it has .scales")
    bits, group, mode = own.get("bits", q.get("bits")), own.get("group_size", q.get("group_size")), own.get("mode")
    mode = mode or q.get("mode") or "affine"
    if mode not in MLX_MODES:
        raise UnsupportedModelError(f"{where}: quantization.mode {mode!r} of {module} is not read "
                                    f"(read: {', '.join(MLX_MODES)})")  # fmt: skip
    gtype, fixed = MLX_MODES[mode]
    bits, group = (bits or fixed[0], group or fixed[1]) if fixed else (bits, group)
    valid = isinstance(bits, int) and 1 <= bits <= 8 and isinstance(group, int) and group > 0
    if not valid or fixed is not None and (bits, group) != fixed:
        raise SnapshotError(where, f"quantization ({module})", f"bits {bits!r} and group_size {group!r} are not valid"
                            + (f" for mode {mode!r} ({fixed[0]} bits, groups of {fixed[1]})" if fixed else ""))  # fmt: skip
    weight_file = str(files[entries[module + ".weight"][0]])
    if e.dtype != "U32" or len(e.shape) < 2 or (e.shape[-1] * 32) % bits:
        raise SnapshotError(weight_file, f"tensor {module}.weight", f"is {e.dtype} {list(e.shape)}, not packed uint32")
    n_in = e.shape[-1] * 32 // bits
    if n_in % group:
        raise SnapshotError(
            weight_file, f"tensor {module}.weight", f"{n_in} values a row are no whole groups of {group}"
        )
    want = (*e.shape[:-1], n_in // group)
    parts = []
    for part in ("scales", "biases") if fixed is None else ("scales",):  # the float modes have no biases
        if module + "." + part not in entries:
            raise SnapshotError(weight_file, f"tensor {module}.{part}", f"is missing ({mode} quantization has it)")
        j, p = entries[module + "." + part]
        allowed = ("F32", "F16", "BF16") if fixed is None else ("U8",)
        if p.shape != want or p.dtype not in allowed:
            raise SnapshotError(
                str(files[j]),
                f"tensor {module}.{part}",
                f"is {p.dtype} {list(p.shape)}, not {'/'.join(allowed)} {list(want)}",
            )
        parts.append(((j, p.start, p.nbytes, p.dtype),))  # one region (a stacked weight: one a part)
    if fixed is not None and module + ".biases" in entries:
        raise SnapshotError(weight_file, f"tensor {module}.biases", f"is there, but {mode} quantization has none")
    return (*e.shape[:-1], n_in), (bits, group, *parts, *([()] if fixed else [])), gtype


def read_snapshot(path: str | os.PathLike) -> SnapshotFacts:
    """The facts of the snapshot directory at `path` (SnapshotError / UnsupportedModelError name what is wrong)."""
    import gguf

    root = Path(path)
    config_path = root / "config.json"
    try:
        if config_path.stat().st_size > MAX_CONFIG_BYTES:
            raise SnapshotError(str(config_path), "file", f"over {MAX_CONFIG_BYTES} bytes")
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SnapshotError(str(config_path), "file", f"cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise SnapshotError(str(config_path), "file", "is not a JSON object")
    family = _family_for(config, str(config_path))
    text = config
    if family.snapshot.text_config:  # a multimodal model's config: the text model's keys are in their own object
        text = config.get(family.snapshot.text_config)
        if not isinstance(text, dict):
            raise SnapshotError(str(config_path), family.snapshot.text_config, "is missing or not a JSON object")
    for key, value, why in family.snapshot.requires:
        value = value(text) if callable(value) else value
        if key in text and text[key] != value:
            raise UnsupportedModelError(f"{config_path}: {key} is {text[key]!r}, not {value!r}: {why}")
    metadata = _metadata(text, family, str(config_path))
    arch = family.name
    n_layer = metadata.get(f"{arch}.block_count")
    if not isinstance(n_layer, int) or n_layer < 1:
        raise SnapshotError(str(config_path), "num_hidden_layers", f"must be a positive integer, got {n_layer!r}")
    model_arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, n_layer)
    heads = {"attn_q": metadata.get(f"{arch}.attention.head_count")}
    heads["attn_k"] = metadata.get(f"{arch}.attention.head_count_kv", heads["attn_q"])
    files = snapshot_files(root)
    entries, sources = {}, []  # Hugging Face name -> (file index, Entry)
    for i, file in enumerate(files):
        st = read_safetensors(file)
        sources.append((file.name, st.size))
        for hf_name, e in st.tensors.items():
            if hf_name in entries:
                raise SnapshotError(str(file), f"tensor {hf_name!r}", "is in two of the snapshot's files")
            entries[hf_name] = (i, e)
    if family.snapshot.only:  # the text model's tensors; the vision and audio towers are not read
        entries = {n: v for n, v in entries.items() if family.snapshot.only in n}
    quantized = {n.removesuffix(".scales") for n in entries if n.endswith(".scales")}
    originals = entries
    entries, stacked, stacked_names = _stacked(entries, family.snapshot.stacks, files)
    tensors: dict[str, TensorInfo] = {}
    unknown, pad_rows = [], dict(family.snapshot.pad_rows)
    for hf_name, (i, e) in entries.items():
        module = hf_name.rsplit(".", 1)[0]
        if module in quantized and not hf_name.endswith(".weight"):
            continue  # a quantized weight's scales and biases: read with it
        mapped = hf_name
        for old, new in family.snapshot.renames:
            mapped = mapped.replace(old, new)
        name = names.get_name(mapped, try_suffixes=(".weight", ".bias"))
        if name is None:
            unknown.append(hf_name)
            continue
        if name in tensors:
            raise SnapshotError(str(files[i]), f"tensor {hf_name!r}", f"is {name}, which another tensor already is")
        transform = ()
        kind = name.split(".")[-2] if name.startswith("blk.") else ""
        if family.snapshot.permute_qk and kind in heads:
            transform = ("rope_pairs", int(heads[kind]))  # convert_hf_to_gguf's permute(W, n_head)
        elif family.snapshot.norm_plus_one and name.endswith("norm.weight"):
            transform = ("plus_one",)  # Gemma's x · (1 + w), stored as 1 + w in GGUF
        members = [n.rsplit(".", 1)[0] for n in stacked_names.get(hf_name, ())]
        if members and any(m in quantized for m in members):  # a stack of quantized tensors (gemma3n's AltUp)
            shape, quant, gtype = _stacked_quantized(config, config_path, hf_name, members, quantized, originals, files)
            tensors[name] = TensorInfo(
                name, gtype, tuple(reversed(shape)), e.start, e.nbytes, i, transform, quant, stacked[hf_name]
            )
            continue
        if module in quantized:
            shape, quant, gtype = _mlx_quantized(config, config_path, module, e, entries, files)
            shape, transform = _padded(shape, transform, pad_rows.get(name), text, files[i], hf_name)
            tensors[name] = TensorInfo(name, gtype, tuple(reversed(shape)), e.start, e.nbytes, i, transform, quant)
            continue
        if e.dtype == "U32":
            raise SnapshotError(str(files[i]), f"tensor {hf_name!r}", "is uint32 (packed) but has no .scales beside it")
        shape, transform = _padded(e.shape, transform, pad_rows.get(name), text, files[i], hf_name)
        ne, parts = tuple(reversed(shape)), stacked.get(hf_name, ())
        tensors[name] = TensorInfo(name, DTYPES[e.dtype][0], ne, e.start, e.nbytes, i, transform, (), parts)
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:8]) + (
            f" … and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        )
        per_expert = not family.snapshot.stacks and any(re.search(r"\.experts\.\d+\.", n) for n in unknown)
        hint = (
            " (experts one tensor each are not stacked yet: MLX's stacked switch_mlp form is read)"
            if per_expert
            else ""
        )
        raise UnsupportedModelError(f"{root}: tensors gguf-py's {arch} name map does not know: {shown}{hint}")
    size = sum(n for _, n in sources)
    return SnapshotFacts(str(root), size, metadata, tensors, tuple(sources))
