"""Tiny random-weight GGUF files for every supported family, written with `gguf.GGUFWriter`.

They load in llama.cpp (an independent oracle) and in alchemist, so every architecture and weight type
can be tested without downloading a model. Shapes are multiples of 256 so that llama.cpp can quantize
them to the K-quant types. `alchemist fixture --arch qwen3 --quant Q4_K -o x.gguf` is the CLI front.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import gguf

from alchemist.arch import FAMILIES as _FAMILIES
from alchemist.arch.build import EPS_KEYS
from alchemist.arch.family import Hparams
from alchemist.arch.table import Dims
from alchemist.tokenizer.tokenizer import BYTE_TO_UNICODE

FAMILIES = tuple(_FAMILIES)  # every family has a fixture: the tuple tests parametrize over
# every fixture: each family's, and its variants as "<family>:<variant>"
FIXTURES = FAMILIES + tuple(f"{name}:{v}" for name, fam in _FAMILIES.items() for v, _ in fam.fixture.variants)


def fixture_spec(case: str):
    """(family, FixtureSpec) for "llama" or "stablelm:parallel"."""
    arch, _, variant = case.partition(":")
    if arch not in _FAMILIES:
        raise ValueError(f"unknown fixture architecture {arch!r} (choose from {', '.join(FIXTURES)})")
    family = _FAMILIES[arch]
    if not variant:
        return family, family.fixture
    variants = dict(family.fixture.variants)
    if variant not in variants:
        raise ValueError(f"{arch} has no fixture variant {variant!r} (choose from {', '.join(FIXTURES)})")
    return family, variants[variant]


@dataclass(frozen=True)
class FixtureConfig:
    arch: str
    n_vocab: int = 512
    n_embd: int = 256
    n_layer: int | None = None  # default: the family's FixtureSpec.n_layer
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 64
    n_ff: int = 512
    n_ctx: int = 512
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    rope_dim: int | None = None  # default: the whole head
    metadata: tuple[tuple[str, object], ...] = ()  # `<arch>.<key>` values added to (or overriding) the family's
    seed: int = 0
    embedding_std: float | None = None  # default: the family's FixtureSpec.embedding_std


def _spm_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: specials, 256 byte tokens, then word pieces."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    words = ["the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by"]
    pieces += ["▁" + w for w in words] + words
    i = 0
    while len(tokens) + len(pieces) < n_vocab:
        pieces.append(f"▁w{i}")
        i += 1
    pieces = pieces[: n_vocab - len(tokens)]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def _bpe_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A GPT-2 byte-level BPE vocabulary with a few merges (llama.cpp requires at least one)."""
    # GPT-2's byte -> printable character map, in its own order (the tokenizer's table)
    byte_chars = list(BYTE_TO_UNICODE.values())
    tokens = list(byte_chars)
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    while len(tokens) + len(specials) < n_vocab:
        tokens.append(f"x{len(tokens)}")
    tokens += specials
    types = [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(specials)) + [int(gguf.TokenType.CONTROL)] * len(specials)
    return tokens, types, merges


def _metadata_value(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, tuple):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"fixture metadata {key}: unsupported value {value!r}")


def write_fixture(
    path: str | Path, arch: str, weight_type: str = "F32", config: FixtureConfig | None = None, encode=None
) -> Path:
    """Write a random-weight GGUF for `arch` (a family, or "<family>:<variant>") with 2-D weights stored as
    `weight_type` ("F32" or "F16").

    The tensors are the family's table (its required tensors and the optional ones its FixtureSpec names),
    with the shapes the table gives for this config's hyperparameters. `encode(name, role, values)` may return
    (raw bytes, GGMLQuantizationType) to store a tensor quantized instead (None: as it is)."""
    family, spec = fixture_spec(arch)
    arch = family.name
    if weight_type not in ("F32", "F16"):
        raise ValueError("write_fixture stores F32 or F16; use quantize_fixture for quantized types")
    cfg = config or FixtureConfig(arch=arch)
    n_layer = cfg.n_layer or spec.n_layer
    rng = np.random.default_rng(cfg.seed)
    extra = dict(spec.metadata + cfg.metadata)
    n_expert, n_ff_exp, n_ff_shexp = _expert_dims(family, extra, cfg)
    dims = Dims(
        n_vocab=cfg.n_vocab,
        n_embd=cfg.n_embd,
        n_head=cfg.n_head,
        n_kv_head=cfg.n_kv_head,
        head_dim=cfg.head_dim,
        n_ff=cfg.n_ff,
        rope_dim=cfg.rope_dim or spec.rope_dim or cfg.head_dim,
        n_ctx=cfg.n_ctx,
        conv_kernel=int(extra.get("shortconv.l_cache", 0)),
        n_expert=n_expert,
        n_ff_exp=n_ff_exp,
        n_ff_shexp=n_ff_shexp,
        n_layer=n_layer,
        ssm_conv=int(extra.get("ssm.conv_kernel", 0)),
        ssm_inner=int(extra.get("ssm.inner_size", 0)),
        ssm_state=int(extra.get("ssm.state_size", 0)),
        ssm_head=int(extra.get("ssm.time_step_rank", 0)),
        ssm_group=int(extra.get("ssm.group_count", 0)),
        q_lora=int(extra.get("attention.q_lora_rank", 0)),
        kv_lora=int(extra.get("attention.kv_lora_rank", 0)),
        head_dim_mla=int(extra.get("attention.key_length_mla", 0)),
        head_dim_v_mla=int(extra.get("attention.value_length_mla", 0)),
    )
    hp = _fixture_hparams(arch, extra)
    if family.model_dims:
        dims = family.model_dims(hp, dims)
    layer_dims = [dims] * n_layer  # per layer its sizes, where the family gives them (Family.layer_dims)
    if family.layer_dims:
        sliding = family.sliding_layers(hp, n_layer) if family.sliding_layers else [False] * n_layer
        layer_dims = [family.layer_dims(hp, dims, il, sliding[il]) for il in range(n_layer)]
    mixers = _layer_mixers(family, arch, extra, n_layer)
    ffns = _layer_ffns(family, arch, extra, n_layer)
    n_main = n_layer - (family.mtp_layers(_fixture_hparams(arch, extra)) if family.mtp_layers else 0)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    # no family name in general.name: llama.cpp keys tokenizer quirks on it (a "phi3" name expects </s>)
    w.add_name("alchemist tiny random-weight fixture")
    w.add_context_length(cfg.n_ctx)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(n_layer)
    if "feed_forward_length" not in extra:  # else per layer (a family whose other layers have no MLP)
        w.add_feed_forward_length(cfg.n_ff)
    if "attention.head_count" not in extra:  # else 0 (a model without attention), with the extras
        w.add_head_count(cfg.n_head)
    if "attention.head_count_kv" not in extra:  # else per layer (a hybrid's), written with the extras
        w.add_head_count_kv(cfg.n_kv_head)
    if "attention.key_length" not in extra:  # else a latent attention's row (deepseek2), with the extras
        w.add_key_length(cfg.head_dim)
    if "attention.value_length" not in extra:
        w.add_value_length(cfg.head_dim)
    w.add_float32(f"{arch}.{EPS_KEYS[family.norm]}", cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_rope_dimension_count(dims.rope_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if weight_type == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    for key, value in extra.items():
        _metadata_value(w, f"{arch}.{key}", value)
    _write_vocab(w, spec.vocab, cfg.n_vocab)

    wdtype = np.float32 if weight_type == "F32" else np.float16
    embedding_std = cfg.embedding_std or spec.embedding_std
    embd = rng.standard_normal((cfg.n_vocab, cfg.n_embd)) * embedding_std

    def values(name: str, role: str, shape: tuple[int, ...]) -> np.ndarray:
        if name == "token_embd.weight":
            return embd.astype(wdtype)
        if name == "output.weight":
            # Random output rows give flat logits whose top-2 gaps are as small as llama.cpp's activation-
            # quantization noise. Like a tied model, start from the embedding (the residual stream carries
            # it, so predictions are decisive) and perturb it, so the untied path is still its own tensor.
            d = cfg.n_embd
            return (embd / np.sqrt(d) * 4.0 + 0.5 * rng.standard_normal(shape) / np.sqrt(d)).astype(wdtype)
        if name.endswith("ffn_gate_inp.weight"):
            # a decisive router (logits of spread ~4): llama.cpp's activation rounding on quantized files must
            # not flip which experts a token picks, and where two are close, neither weighs much
            return (4.0 * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if role in ("linear", "experts", "heads"):
            return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(wdtype)
        if role == "embedding":  # another table read by token (gemma3n's per-layer embeddings)
            return (rng.standard_normal(shape) * embedding_std).astype(wdtype)
        if role == "position_embedding":
            return (0.1 * rng.standard_normal(shape)).astype(wdtype)
        if role == "norm":
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if role == "bias":
            return (0.1 * rng.standard_normal(shape)).astype(np.float32)
        if role == "rope_factors":
            return rng.uniform(1.0, 4.0, shape).astype(np.float32)
        if role == "conv":  # a depthwise filter (channels, taps)
            return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if role == "decay":  # Mamba-2's A = -exp(A_log): a decay of exp(-0.1 .. -0.5) per unit step, a long memory
            return -rng.uniform(0.1, 0.5, shape).astype(np.float32)
        if role == "skip":  # Mamba-2's D, initialized to 1
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if role == "sinks":  # logits of the size of the scores, so that the sink takes a real share
            return (1.0 + rng.standard_normal(shape)).astype(np.float32)
        if role == "scale":  # a layer's output scale
            return rng.uniform(0.5, 1.5, shape).astype(np.float32)
        raise ValueError(f"{arch} fixture: no values for role {role!r} ({name})")

    alternatives = list(dict.fromkeys(t.alternative for t in family.tensors if t.alternative))
    chosen = spec.alternative or (alternatives[0] if alternatives else "")
    wanted = [t for t in family.tensors if t.alternative in ("", chosen) and (t.required or t.name in spec.optional)]
    scales = dict(spec.scales)

    def scaled(t, name: str, own: Dims) -> np.ndarray:
        v = values(name, t.role, own.resolve(t.shape))
        return (v * scales[t.name]).astype(v.dtype) if t.name in scales else v

    def add(t, name: str, own: Dims = dims) -> None:
        values = scaled(t, name, own)
        encoded = encode(name, t.role, values) if encode is not None else None
        if encoded is None:
            w.add_tensor(name, values)
        else:
            raw, raw_dtype = encoded
            w.add_tensor(name, raw, raw_dtype=raw_dtype)  # byte shape: gguf derives the element shape

    for t in (t for t in wanted if not t.per_layer):
        add(t, t.name)
    for il in range(n_layer):
        for t in (t for t in wanted if t.per_layer and t.in_layer(il, mixers, ffns, n_main)):
            if t.name.format(il=il) not in spec.absent:
                add(t, t.name.format(il=il), layer_dims[il])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _layer_mixers(family, arch: str, metadata: dict, n_layer: int) -> list[str]:
    """How each layer mixes tokens, as the family reads it from the metadata this fixture writes."""
    if family.layer_mixers is None:
        return ["attention"] * n_layer
    return family.layer_mixers(_fixture_hparams(arch, metadata), n_layer)


def _layer_ffns(family, arch: str, metadata: dict, n_layer: int) -> list[str | None]:
    """Each layer's FFN kind, as the family reads it from this metadata (None: the family has one kind)."""
    if family.layer_ffns is None:
        return [None] * n_layer
    return family.layer_ffns(_fixture_hparams(arch, metadata), n_layer)


def _fixture_hparams(arch: str, metadata: dict) -> Hparams:
    values = {f"{arch}.{k}": np.array(v) if isinstance(v, tuple) else v for k, v in metadata.items()}
    return Hparams(SimpleNamespace(path="<fixture>", metadata=values, tensors={}), arch)


def _expert_dims(family, metadata: dict, cfg: FixtureConfig) -> tuple[int, int, int]:
    """(n_expert, n_ff_exp, n_ff_shexp) as the family reads them from this metadata (zeros for a dense fixture)."""
    n_expert = int(metadata.get("expert_count", 0))
    if not n_expert:
        return 0, 0, 0
    hp = _fixture_hparams(family.name, metadata | {"feed_forward_length": cfg.n_ff})
    n_ff_exp = family.moe.expert_width(hp, int(metadata["expert_used_count"]))
    return n_expert, n_ff_exp, family.moe.shared_width(hp, n_ff_exp)


def _write_vocab(w: gguf.GGUFWriter, kind: str, n_vocab: int) -> None:
    if kind == "spm":
        tokens, scores, types = _spm_vocab(n_vocab)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
    elif kind == "bpe":
        tokens, types, merges = _bpe_vocab(n_vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(len(tokens) - 3)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_add_bos_token(False)
    else:
        raise ValueError(f"unknown fixture vocabulary {kind!r}")


def add_massive_activation(path: str | Path, token: int, channel: int = 7, factor: float = 1000.0) -> Path:
    """Edit an F32 fixture in place so that `token`'s embedding row carries one massive channel: `channel` set to
    `factor` times the row's RMS. Wherever the token stands (put it at position 0), the residual stream then has
    one channel ~`factor` times the others, as real models' "massive activations" do (Sun et al. 2024), which
    is where llama.cpp's 8-bit activation blocks lose the most (the outlier sets every block's scale)."""
    reader = gguf.GGUFReader(str(path), "r+")
    table = next(t for t in reader.tensors if t.name == "token_embd.weight")
    if table.tensor_type != gguf.GGMLQuantizationType.F32:
        raise ValueError(f"{path}: token_embd.weight is {table.tensor_type.name}; add_massive_activation edits F32")
    row = table.data[token]  # a view into the file (numpy shape (n_vocab, n_embd))
    row[channel] = np.float32(factor) * np.sqrt(np.mean(np.square(row, dtype=np.float64)))
    reader.data.flush()  # the row is a view of the file's memory map
    del reader
    return Path(path)
