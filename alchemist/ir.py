"""ModelIR: the architecture-neutral description of a decoder-only transformer that codegen renders.

Everything here is plain data (frozen dataclasses of ints, floats, strings and tuples) so that it can be
hashed, compared and written as JSON (`alchemist inspect --ir`). Arch profiles build it from GGUF facts;
codegen never looks at the GGUF file again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from enum import Enum


class RopeStyle(str, Enum):
    NORM = "norm"  # rotate adjacent pairs (2i, 2i+1): llama
    NEOX = "neox"  # rotate (i, i + n_rot/2): qwen2, qwen3, gemma3


class Activation(str, Enum):
    SILU = "silu"
    GELU_TANH = "gelu_tanh"  # ggml_gelu: the tanh approximation


@dataclass(frozen=True)
class TensorBinding:
    """One GGUF tensor and how the graph uses it. `shape` is numpy order (GGUF ne reversed)."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    offset: int  # within the GGUF data section
    nbytes: int
    role: str  # "linear" (y = x @ W.T, W is (n_out, n_in)), "embedding", "norm", "bias", "rope_freqs"
    # True when alchemist's kernels can use the tensor in its GGUF block format (a quantized matrix of a
    # type alchemist.kernels supports, read by the graph only as a projection or an embedding)
    kernel: bool = False

    @property
    def quantized(self) -> bool:
        return self.ggml_type != "F32"


@dataclass(frozen=True)
class AttentionSpec:
    n_head: int
    n_kv_head: int
    head_dim: int  # key/query head size
    head_dim_v: int
    rope_dim: int  # leading dims of each head that are rotated
    rope_base: float
    rope_freq_scale: float  # 1 / linear rope scaling factor
    sliding_window: int  # 0: attends to the whole context
    score_scale: float  # multiplies q·k
    q_norm: bool  # RMSNorm over each q head before RoPE (qwen3, gemma3)
    k_norm: bool
    qkv_bias: bool
    out_bias: bool

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_kv_head


@dataclass(frozen=True)
class MLPSpec:
    n_ff: int
    activation: Activation
    gated: bool  # act(gate(x)) * up(x)
    bias: bool


@dataclass(frozen=True)
class LayerSpec:
    index: int
    attention: AttentionSpec
    mlp: MLPSpec
    post_attention_norm: bool  # gemma's sandwich norms
    post_ffn_norm: bool


@dataclass(frozen=True)
class ModelIR:
    architecture: str  # profile name, validated identifier
    model_name: str  # general.name: free text, only ever emitted as a literal
    source_file: str
    source_sha256: str
    file_size: int
    data_offset: int
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    rms_eps: float
    rope_style: RopeStyle
    embedding_scale: float  # gemma multiplies token embeddings by sqrt(n_embd)
    final_logit_softcap: float  # 0: none
    tied_output: bool  # logits use token_embd.weight
    has_rope_freqs: bool  # llama3-style per-frequency divisors (rope_freqs.weight)
    layers: tuple[LayerSpec, ...]
    tensors: tuple[TensorBinding, ...]
    ignored_tensors: tuple[tuple[str, str], ...]  # (name, reason)

    def tensor(self, name: str) -> TensorBinding:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def uniform_layers(self) -> bool:
        """True when every layer has the same attention shape (only window/rope base may differ)."""
        first = self.layers[0]
        return all(
            (lay.attention.n_head, lay.attention.n_kv_head, lay.attention.head_dim, lay.mlp)
            == (first.attention.n_head, first.attention.n_kv_head, first.attention.head_dim, first.mlp)
            for lay in self.layers
        )

    def to_dict(self) -> dict:
        return _jsonable(dataclasses.asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def ir_hash(self) -> str:
        """sha256 of the canonical JSON: the generated module records it, the auditor re-checks it."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def _jsonable(obj):
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
