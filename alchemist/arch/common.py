"""What every decoder-only family shares: typed hyperparameter reads and tensor-inventory binding.

A family profile (`alchemist/arch/<family>.py`) is a `FamilyProfile` value plus, where the family has a
quirk no flag covers, a small hook. `build_ir` turns GGUF facts into a ModelIR using it, checking that
every tensor the family needs is present with the right shape and that no tensor is left unexplained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from alchemist.errors import GGUFError, UnsupportedModelError
from alchemist.gguf_io import GGUFFacts
from alchemist.kernels.formats import SUPPORTED_TYPES as KERNEL_TYPES
from alchemist.ir import Activation, AttentionSpec, LayerSpec, MLPSpec, ModelIR, RopeStyle, TensorBinding

REQUIRED = object()


class Hparams:
    """Typed, validated reads of `<arch>.<key>` metadata (llama.cpp's `ml.get_key`)."""

    def __init__(self, facts: GGUFFacts, arch: str):
        self.facts = facts
        self.arch = arch

    def _raw(self, key: str, default):
        full = f"{self.arch}.{key}" if not key.startswith(("general.", "tokenizer.")) else key
        if full in self.facts.metadata:
            return full, self.facts.metadata[full]
        if default is REQUIRED:
            raise GGUFError(self.facts.path, full, "required hyperparameter is missing")
        return full, default

    def int(self, key: str, default=REQUIRED, minimum: int = 0) -> int:
        full, v = self._raw(key, default)
        if isinstance(v, np.ndarray):
            if v.size == 0 or not np.all(v == v.flat[0]):
                raise UnsupportedModelError(
                    f"{self.facts.path}: {full}: per-layer values {v.tolist()} are not supported"
                )
            v = v.flat[0].item()
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise GGUFError(self.facts.path, full, f"expected an integer, got {type(v).__name__}")
        v = int(v)
        if v < minimum:
            raise GGUFError(self.facts.path, full, f"must be >= {minimum}, got {v}")
        if key == "block_count" and v > len(self.facts.tensors):
            # Every block has tensors; refusing a larger count keeps per-layer lists from being sized by it.
            n_tensors = len(self.facts.tensors)
            raise GGUFError(self.facts.path, full, f"{v} blocks, but the file has only {n_tensors} tensors")
        return v

    def float(self, key: str, default=REQUIRED, positive: bool = False) -> float:
        full, v = self._raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise GGUFError(self.facts.path, full, f"expected a number, got {type(v).__name__}")
        v = float(v)
        if not math.isfinite(v):
            raise GGUFError(self.facts.path, full, f"must be finite, got {v}")
        if positive and v <= 0:
            raise GGUFError(self.facts.path, full, f"must be positive, got {v}")
        return v

    def str(self, key: str, default=REQUIRED) -> str:
        full, v = self._raw(key, default)
        if not isinstance(v, str):
            raise GGUFError(self.facts.path, full, f"expected a string, got {type(v).__name__}")
        return v


@dataclass(frozen=True)
class FamilyProfile:
    """Pure data describing one architecture family, as llama.cpp's src/models/<family>.cpp computes it."""

    name: str  # general.architecture value
    rope_style: RopeStyle
    activation: Activation
    embedding_scale_sqrt: bool = False  # gemma: embeddings * sqrt(n_embd)
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm over each q/k head before RoPE
    sandwich_norms: bool = False  # gemma: post_attention_norm, post_ffw_norm
    sliding_window: bool = False  # reads attention.sliding_window (+ _pattern)
    default_swa_pattern: int = 6
    optional_layer_tensors: tuple[str, ...] = ()  # e.g. biases
    optional_global_tensors: tuple[str, ...] = ("output.weight",)
    # hparams -> q·k scale; default 1/sqrt(head_dim), overridable by `<arch>.attention.scale`
    score_scale: Callable[[Hparams, int, int, int], float] | None = None
    supported_rope_scaling: tuple[str, ...] = ("none", "linear")
    notes: tuple[str, ...] = field(default=())


LAYER_CORE = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)


def _binding(facts: GGUFFacts, name: str, role: str, expected_shape: tuple[int, ...]) -> TensorBinding:
    info = facts.tensors[name]
    if info.shape != expected_shape:
        raise GGUFError(
            facts.path,
            f"tensor {name!r} shape",
            f"expected {list(expected_shape)} (numpy order) from the hyperparameters, found {list(info.shape)}",
        )
    kernel = role in ("linear", "embedding") and len(info.shape) == 2 and info.ggml_type in KERNEL_TYPES
    return TensorBinding(name, info.ggml_type, info.shape, info.offset, info.nbytes, role, kernel)


def build_ir(facts: GGUFFacts, profile: FamilyProfile) -> ModelIR:
    hp = Hparams(facts, profile.name)
    n_embd = hp.int("embedding_length", minimum=1)
    n_layer = hp.int("block_count", minimum=1)
    n_ctx = hp.int("context_length", minimum=1)
    n_head = hp.int("attention.head_count", minimum=1)
    if n_head > n_embd:
        raise GGUFError(
            facts.path, f"{profile.name}.attention.head_count", f"{n_head} heads for an embedding of only {n_embd}"
        )
    n_kv_head = hp.int("attention.head_count_kv", default=n_head, minimum=1)
    if n_head % n_kv_head:
        raise GGUFError(
            facts.path, f"{profile.name}.attention.head_count_kv", f"{n_kv_head} does not divide head_count {n_head}"
        )
    head_dim = hp.int("attention.key_length", default=n_embd // n_head, minimum=1)
    head_dim_v = hp.int("attention.value_length", default=n_embd // n_head, minimum=1)
    if head_dim_v != head_dim:
        raise UnsupportedModelError(
            f"{facts.path}: key_length {head_dim} != value_length {head_dim_v} is not supported"
        )
    rope_dim = hp.int("rope.dimension_count", default=head_dim, minimum=2)
    if rope_dim > head_dim or rope_dim % 2:
        raise GGUFError(
            facts.path,
            f"{profile.name}.rope.dimension_count",
            f"{rope_dim} must be even and at most the head size {head_dim}",
        )
    n_ff = hp.int("feed_forward_length", minimum=1)
    rms_eps = hp.float("attention.layer_norm_rms_epsilon", positive=True)
    rope_base = hp.float("rope.freq_base", default=10000.0, positive=True)
    scaling_type = hp.str("rope.scaling.type", default="linear" if _has(hp, "rope.scaling.factor") else "none")
    if scaling_type not in profile.supported_rope_scaling:
        raise UnsupportedModelError(
            f"{facts.path}: {profile.name}.rope.scaling.type {scaling_type!r} is not supported "
            f"(supported: {', '.join(profile.supported_rope_scaling)})"
        )
    factor = hp.float("rope.scaling.factor", default=0.0)
    if factor == 0.0:
        factor = hp.float("rope.scale_linear", default=0.0)
    rope_freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    if not math.isfinite(rope_freq_scale) or rope_freq_scale <= 0:
        raise GGUFError(facts.path, f"{profile.name}.rope.scaling.factor", f"invalid factor {factor}")
    softcap = hp.float("final_logit_softcapping", default=0.0)
    if hp.int("expert_count", default=0) > 0:
        raise UnsupportedModelError(f"{facts.path}: mixture-of-experts models are not supported yet")

    if profile.score_scale is not None:
        score_scale = profile.score_scale(hp, n_embd, n_head, head_dim)
    else:
        score_scale = hp.float("attention.scale", default=0.0)
        if score_scale == 0.0:
            score_scale = 1.0 / math.sqrt(head_dim)

    # sliding-window pattern (llama.cpp set_swa_pattern: layer il is local when il % n < n - 1)
    windows = [0] * n_layer
    bases = [rope_base] * n_layer
    if profile.sliding_window:
        n_swa = hp.int("attention.sliding_window", default=0)
        if n_swa > 0:
            pattern_key = f"{profile.name}.attention.sliding_window_pattern"
            raw = facts.metadata.get(pattern_key)
            if isinstance(raw, np.ndarray):
                if raw.size != n_layer:
                    raise GGUFError(facts.path, pattern_key, f"has {raw.size} entries for {n_layer} layers")
                is_swa = [bool(x) for x in raw.tolist()]
            else:
                n_pattern = hp.int("attention.sliding_window_pattern", default=profile.default_swa_pattern)
                is_swa = [n_pattern == 0 or (il % n_pattern < n_pattern - 1) for il in range(n_layer)]
            base_swa = hp.float("rope.freq_base_swa", default=10000.0, positive=True)
            for il in range(n_layer):
                if is_swa[il]:
                    windows[il] = n_swa
                    bases[il] = base_swa

    tensors = facts.tensors
    n_q, n_kv = n_head * head_dim, n_kv_head * head_dim
    if "token_embd.weight" not in tensors:
        raise UnsupportedModelError(f"{facts.path}: missing tensor 'token_embd.weight'")
    n_vocab = tensors["token_embd.weight"].shape[0]
    bindings: dict[str, TensorBinding] = {}
    missing: list[str] = []

    def bind(name: str, role: str, shape: tuple[int, ...], required: bool = True) -> bool:
        if name in tensors:
            bindings[name] = _binding(facts, name, role, shape)
            return True
        if required:
            missing.append(name)
        return False

    bind("token_embd.weight", "embedding", (n_vocab, n_embd))
    bind("output_norm.weight", "norm", (n_embd,))
    tied = not bind(
        "output.weight", "linear", (n_vocab, n_embd), required="output.weight" not in profile.optional_global_tensors
    )
    has_rope_freqs = bind("rope_freqs.weight", "rope_freqs", (rope_dim // 2,), required=False)

    layers = []
    for il in range(n_layer):
        p = f"blk.{il}."
        bind(p + "attn_norm.weight", "norm", (n_embd,))
        bind(p + "attn_q.weight", "linear", (n_q, n_embd))
        bind(p + "attn_k.weight", "linear", (n_kv, n_embd))
        bind(p + "attn_v.weight", "linear", (n_kv, n_embd))
        bind(p + "attn_output.weight", "linear", (n_embd, n_q))
        bind(p + "ffn_norm.weight", "norm", (n_embd,))
        bind(p + "ffn_gate.weight", "linear", (n_ff, n_embd))
        bind(p + "ffn_up.weight", "linear", (n_ff, n_embd))
        bind(p + "ffn_down.weight", "linear", (n_embd, n_ff))
        if profile.qk_norm:
            bind(p + "attn_q_norm.weight", "norm", (head_dim,))
            bind(p + "attn_k_norm.weight", "norm", (head_dim,))
        if profile.sandwich_norms:
            bind(p + "post_attention_norm.weight", "norm", (n_embd,))
            bind(p + "post_ffw_norm.weight", "norm", (n_embd,))
        opt = set(profile.optional_layer_tensors)
        qkv_bias = False
        if "attn_q.bias" in opt and p + "attn_q.bias" in tensors:
            qkv_bias = True
            bind(p + "attn_q.bias", "bias", (n_q,))
            bind(p + "attn_k.bias", "bias", (n_kv,))
            bind(p + "attn_v.bias", "bias", (n_kv,))
        out_bias = "attn_output.bias" in opt and bind(p + "attn_output.bias", "bias", (n_embd,), required=False)
        mlp_bias = False
        if "ffn_up.bias" in opt and p + "ffn_up.bias" in tensors:
            mlp_bias = True
            bind(p + "ffn_gate.bias", "bias", (n_ff,))
            bind(p + "ffn_up.bias", "bias", (n_ff,))
            bind(p + "ffn_down.bias", "bias", (n_embd,))
        attention = AttentionSpec(
            n_head=n_head,
            n_kv_head=n_kv_head,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            rope_dim=rope_dim,
            rope_base=bases[il],
            rope_freq_scale=1.0 if windows[il] else rope_freq_scale,
            sliding_window=windows[il],
            score_scale=score_scale,
            q_norm=profile.qk_norm,
            k_norm=profile.qk_norm,
            qkv_bias=qkv_bias,
            out_bias=bool(out_bias),
        )
        mlp = MLPSpec(n_ff=n_ff, activation=profile.activation, gated=True, bias=mlp_bias)
        layers.append(LayerSpec(il, attention, mlp, profile.sandwich_norms, profile.sandwich_norms))

    if missing:
        shown = ", ".join(missing[:12]) + (f" … and {len(missing) - 12} more" if len(missing) > 12 else "")
        raise UnsupportedModelError(f"{facts.path}: {profile.name} model is missing tensors: {shown}")
    unknown = [n for n in tensors if n not in bindings]
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:12]) + (
            f" … and {len(unknown) - 12} more" if len(unknown) > 12 else ""
        )
        raise UnsupportedModelError(f"{facts.path}: tensors the {profile.name} profile does not know: {shown}")

    # Keep GGUF file order: it is the order the loader reads the memory map in.
    ordered = tuple(bindings[n] for n in tensors)
    model_name = facts.metadata.get("general.name", "")
    return ModelIR(
        architecture=profile.name,
        model_name=model_name if isinstance(model_name, str) else "",
        source_file=facts.file_name,
        source_sha256=facts.sha256(),
        file_size=facts.file_size,
        data_offset=facts.data_offset,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_ctx_train=n_ctx,
        rms_eps=rms_eps,
        rope_style=profile.rope_style,
        embedding_scale=math.sqrt(n_embd) if profile.embedding_scale_sqrt else 1.0,
        final_logit_softcap=softcap,
        tied_output=tied,
        has_rope_freqs=has_rope_freqs,
        layers=tuple(layers),
        tensors=ordered,
        ignored_tensors=(),
    )


def _has(hp: Hparams, key: str) -> bool:
    return f"{hp.arch}.{key}" in hp.facts.metadata
