"""ModelIR: the architecture-neutral description of a decoder-only transformer that codegen renders.

A model is components named by kind: an embedding, N blocks (norms, attention, MLP and how they are wired)
and an output. Each component names the GGUF tensors it reads (a layer's as a suffix of `blk.<il>.`, None
where the family has no such tensor) and carries the numbers it needs. Everything is plain data (frozen
dataclasses of ints, floats, strings, enums and tuples) so that it can be hashed, compared and written as
JSON (`alchemist inspect --ir`). Family files build it from GGUF facts (alchemist/arch); codegen never
looks at the GGUF file again, and refuses any value it has no template for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum

# A field added after an IR's JSON (and so every generated module's IR hash) was fixed: left out of to_dict()
# while it holds its default, so IRs that do not use it hash as before.
OMIT_DEFAULT = {"omit_default": True}


class RopeStyle(str, Enum):
    NONE = "none"  # no rotary embedding (gpt2; layers that skip RoPE)
    NORM = "norm"  # rotate adjacent pairs (2i, 2i+1): llama
    NEOX = "neox"  # rotate (i, i + n_rot/2): qwen2, qwen3, gemma, phi3, ...


class RopeScaling(str, Enum):
    NONE = "none"
    LINEAR = "linear"  # positions divided by the factor
    LLAMA3 = "llama3"  # per-frequency divisors stored in rope_freqs.weight
    YARN = "yarn"  # NTK-by-parts interpolation with an attention (magnitude) factor
    LONGROPE = "longrope"  # phi3: per-frequency divisors rope_factors_{long,short}.weight and a magnitude factor


class Activation(str, Enum):
    SILU = "silu"
    GELU_TANH = "gelu_tanh"  # ggml_gelu: the tanh approximation


class NormKind(str, Enum):
    RMS = "rms"  # x / sqrt(mean(x²) + eps) · w
    LAYER = "layer"  # (x - mean) / sqrt(var + eps) · w + b


class MLPKind(str, Enum):
    GATED = "gated"  # down(act(gate(x)) · up(x))
    FUSED_GATED = "fused_gated"  # up(x) holds [gate | up]: down(act(first half) · second half)
    PLAIN = "plain"  # down(act(up(x)))


class Wiring(str, Enum):
    SEQUENTIAL = "sequential"  # x += attn(norm(x)); x += mlp(norm(x)); each branch optionally post-normed
    PARALLEL = "parallel"  # x += attn(norm(x)) + mlp(norm(x)): both branches read the same residual
    ALTUP = "altup"  # gemma3n: N_ALTUP residual streams, predicted and corrected around one active stream


class QKNormScope(str, Enum):
    HEAD = "head"  # over each head's HEAD_DIM values (weight shared by heads, or one row per head)
    FULL = "full"  # over the whole projection (olmo2)


@dataclass(frozen=True)
class TensorBinding:
    """One GGUF tensor and how the graph uses it. `shape` is numpy order (GGUF ne reversed)."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    offset: int  # within the GGUF data section
    nbytes: int
    # "linear" (y = x @ W.T, W is (n_out, n_in)), "embedding" (rows read by token id; also the tied
    # output projection), "position_embedding" (rows read by position), "norm", "bias", "rope_factors"
    role: str
    # True when alchemist's kernels can use the tensor in its GGUF block format (a quantized matrix of a
    # type alchemist.kernels supports, read by the graph only as a projection or an embedding)
    kernel: bool = False
    # False for a tensor llama.cpp loads but never applies (gemma3n's K/V projections on KV-sharing layers)
    read: bool = field(default=True, metadata=OMIT_DEFAULT)

    @property
    def quantized(self) -> bool:
        return self.ggml_type != "F32"


@dataclass(frozen=True)
class NormSpec:
    kind: NormKind
    weight: str | None  # tensor name (suffix within the block for layer norms); None: no learned scale
    bias: str | None = None


@dataclass(frozen=True)
class RopeSpec:
    style: RopeStyle
    dim: int  # leading dims of each head that are rotated
    base: float
    freq_scale: float  # 1 / linear (or YaRN) scaling factor
    scaling: RopeScaling = RopeScaling.NONE
    freq_factors: str | None = None  # rope_freqs.weight (llama3) / rope_factors_long.weight (longrope)
    freq_factors_short: str | None = None  # longrope: rope_factors_short.weight, used up to n_ctx_orig
    attn_factor: float = 1.0  # multiplies cos and sin (YaRN's and LongRoPE's magnitude correction)
    ext_factor: float = 0.0  # YaRN: how much of the extrapolated angle to mix in
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0  # YaRN, LongRoPE: the context the model was originally trained for


@dataclass(frozen=True)
class AttentionSpec:
    n_head: int
    n_kv_head: int
    head_dim: int  # key/query head size
    head_dim_v: int
    rope: RopeSpec
    sliding_window: int  # 0: attends to the whole context
    score_scale: float  # multiplies q·k
    out: str  # attn_output.weight
    # projections: a fused [q | k | v] matrix, or three
    qkv: str | None = None
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv_bias: str | None = None
    q_bias: str | None = None
    k_bias: str | None = None
    v_bias: str | None = None
    out_bias: str | None = None
    q_norm: NormSpec | None = None  # normalizes queries before RoPE
    k_norm: NormSpec | None = None
    qk_norm_scope: QKNormScope = QKNormScope.HEAD
    logit_softcap: float = 0.0  # scores = cap · tanh(scores / cap) before the mask (gemma2)
    prescale_queries: bool = False  # q · score_scale after RoPE, then unscaled q·k (phi3 names that q "Qcur")
    # the layer whose keys and values this layer attends to: None, its own (the classic block); its own index, a
    # layer that writes its KV cache; an earlier one, a KV-sharing layer that computes only queries (gemma3n)
    kv_layer: int | None = field(default=None, metadata=OMIT_DEFAULT)
    v_norm: NormSpec | None = field(default=None, metadata=OMIT_DEFAULT)  # normalizes values (gemma3n: no weight)

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_kv_head


@dataclass(frozen=True)
class MLPSpec:
    kind: MLPKind
    activation: Activation
    n_ff: int
    up: str
    down: str
    gate: str | None = None
    up_bias: str | None = None
    down_bias: str | None = None
    gate_bias: str | None = None
    # activation sparsity (gemma3n): gate <- relu(gate - (mean + sparsity_std · std)) per token before the
    # activation, std with n - 1; 0: dense
    sparsity_std: float = field(default=0.0, metadata=OMIT_DEFAULT)


@dataclass(frozen=True)
class LaurelSpec:
    """LAuReL (gemma3n): a low-rank branch beside attention, h + norm(right(left(h))), joined with the attention
    output as (attention + laurel) · join_scale."""

    left: str  # laurel_l.weight (rank, n_embd)
    right: str  # laurel_r.weight (n_embd, rank)
    post_norm: NormSpec
    join_scale: float


@dataclass(frozen=True)
class AltUpLayerSpec:
    """One layer's AltUp tensors (gemma3n): the router that weighs the streams, the predict and correct
    coefficients, and the gated path that adds the layer's per-layer input to the non-active streams."""

    router: str  # altup_router.weight (n_altup, n_embd)
    router_norm: NormSpec
    router_scale: float  # multiplies the normed router input (1 / n_embd)
    predict_coef: str  # altup_predict_coef.weight (n_altup², n_altup)
    correct_coef: str  # altup_correct_coef.weight (n_altup, n_altup)
    correct_scale: str  # altup_correct_scale.weight (n_embd,): scales the corrected active stream
    inp_gate: str  # per-layer input gate (width, n_embd)
    proj: str  # per-layer input projection back to the embedding (n_embd, width)
    post_norm: NormSpec


@dataclass(frozen=True)
class LayerSpec:
    index: int
    wiring: Wiring
    attention: AttentionSpec
    mlp: MLPSpec
    attn_norm: NormSpec | None  # before attention (and before the MLP too, in a parallel block)
    ffn_norm: NormSpec | None  # before the MLP
    attn_post_norm: NormSpec | None = None  # on the attention output, before the residual add
    ffn_post_norm: NormSpec | None = None
    residual_scale: float = 1.0  # multiplies each branch before the residual add (granite)
    altup: AltUpLayerSpec | None = field(default=None, metadata=OMIT_DEFAULT)  # with Wiring.ALTUP
    laurel: LaurelSpec | None = field(default=None, metadata=OMIT_DEFAULT)


@dataclass(frozen=True)
class EmbeddingSpec:
    weight: str  # token_embd.weight
    scale: float = 1.0  # gemma: sqrt(n_embd); granite: embedding_scale
    positions: str | None = None  # learned absolute position embedding (gpt2)


@dataclass(frozen=True)
class PerLayerInputSpec:
    """gemma3n's per-layer inputs: for every layer a vector of `width` from the token (a row of token_embd,
    n_layer · width wide, times token_scale) and from the scaled embedding (model_proj · x · proj_scale, RMS-normed
    per layer), summed and times sum_scale."""

    token_embd: str  # per_layer_token_embd.weight (n_vocab, n_layer · width), read by token
    model_proj: str  # per_layer_model_proj.weight (n_layer · width, n_embd)
    proj_norm: NormSpec  # per_layer_proj_norm.weight (width,), shared by every layer
    width: int
    token_scale: float
    proj_scale: float
    sum_scale: float


@dataclass(frozen=True)
class AltUpSpec:
    """AltUp (gemma3n): the embedding widened into n_streams residual streams (stream 0 active) by `proj`,
    each rescaled to the embedding's L2 magnitude, and merged back after the last layer by `unembd_proj`."""

    n_streams: int
    proj: str  # altup_proj.weight (n_streams - 1, n_embd, n_embd)
    unembd_proj: str  # altup_unembd_proj.weight (n_streams - 1, n_embd, n_embd)
    per_layer_input: PerLayerInputSpec


@dataclass(frozen=True)
class OutputSpec:
    norm: NormSpec
    weight: str  # output.weight, or token_embd.weight when tied
    logit_scale: float = 1.0  # multiplies the logits (command-r; granite's divisor as its inverse)
    final_softcap: float = 0.0  # logits = cap · tanh(logits / cap)

    @property
    def tied(self) -> bool:
        return self.weight == "token_embd.weight"


@dataclass(frozen=True)
class ModelIR:
    architecture: str  # family name, validated identifier
    model_name: str  # general.name: free text, only ever emitted as a literal
    source_file: str
    source_sha256: str
    file_size: int
    data_offset: int
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    norm_eps: float
    embedding: EmbeddingSpec
    layers: tuple[LayerSpec, ...]
    output: OutputSpec
    tensors: tuple[TensorBinding, ...]
    altup: AltUpSpec | None = field(default=None, metadata=OMIT_DEFAULT)

    @property
    def kv_cache_layers(self) -> tuple[int, ...]:
        """The layers that own a KV cache, in order: every layer, except those that read another layer's."""
        return tuple(lay.index for lay in self.layers if lay.attention.kv_layer in (None, lay.index))

    @property
    def kv_cache_of(self) -> tuple[int, ...]:
        """Per layer: the index (among kv_cache_layers) of the KV cache its attention reads."""
        owners = self.kv_cache_layers
        return tuple(
            owners.index(lay.index if lay.attention.kv_layer is None else lay.attention.kv_layer)
            for lay in self.layers
        )

    def tensor(self, name: str) -> TensorBinding:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict:
        return _jsonable(_plain(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def ir_hash(self) -> str:
        """sha256 of the canonical JSON: the generated module records it, the auditor re-checks it."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def _plain(obj):
    """dataclasses.asdict, leaving out OMIT_DEFAULT fields that hold their default."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: _plain(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)
        }
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _jsonable(obj):
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
