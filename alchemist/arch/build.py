"""GGUF facts + a family -> ModelIR, the same way for every family.

Reads the hyperparameters every decoder has, binds the file's tensors against the family's table (each
present with the shape the hyperparameters imply, every required one there, none left unexplained), and
names the components by kind from what was bound: a fused or split attention, biases, q/k norms, the MLP
kind, post-norms, an untied output, RoPE factors.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from alchemist.arch.family import Family, Hparams, yarn_mscale_ggml
from alchemist.arch.table import Dims, TensorSpec
from alchemist.errors import GGUFError, UnsupportedModelError
from alchemist.gguf_io import GGUFFacts
from alchemist.ir import (
    AttentionSpec,
    EmbeddingSpec,
    LayerSpec,
    MLPKind,
    MLPSpec,
    ModelIR,
    NormKind,
    NormSpec,
    OutputSpec,
    QKNormScope,
    RopeScaling,
    RopeSpec,
    RopeStyle,
    DeltaNetSpec,
    LatentAttentionSpec,
    RouterSpec,
    ShortConvSpec,
    SSMSpec,
    TensorBinding,
)
from alchemist.kernels.formats import NOT_IN_GGUF_PY
from alchemist.kernels.formats import SUPPORTED_TYPES as KERNEL_TYPES

FLOAT_TYPES = ("F32", "F16", "BF16")  # weights loaded as float32 (every quantized one is a kernel type)
# a snapshot's MLX-quantized weights: affine projections and tables packed, the rest (and the float modes) float32
SNAPSHOT_TYPES = ("MLX_AFFINE", "MLX_MXFP4", "MLX_MXFP8", "MLX_NVFP4")

EPS_KEYS = {NormKind.RMS: "attention.layer_norm_rms_epsilon", NormKind.LAYER: "attention.layer_norm_epsilon"}


def read_dims(
    facts: GGUFFacts,
    hp: Hparams,
    mixers: list[str] | None = None,
    latent: bool = False,
    ffn: bool = True,
    ssm: bool = False,
    per_layer: bool = False,
) -> Dims:
    """The dimensions the tensor table names; `mixers` (a hybrid's per-layer token mixers) makes head_count_kv
    per layer and reads the convolution length; `latent` reads multi-head latent attention's sizes; without
    attention layers (a pure Mamba-2) the attention sizes, and without any MLP (ffn False) its width, are 0; `ssm`
    reads Mamba-2's sizes for layers that have it beside attention; `per_layer` (a family with Family.layer_dims)
    takes layer 0's KV head count and FFN width where the file gives them per layer."""
    path, arch = facts.path, hp.arch
    n_embd = hp.int("embedding_length", minimum=1)
    if mixers is not None and "attention" not in mixers:
        return Dims(
            n_vocab=_n_vocab(facts),
            n_embd=n_embd,
            n_head=0,
            n_kv_head=0,
            head_dim=0,
            n_ff=_ffn_width(facts, hp) if ffn else 0,
            rope_dim=0,
            n_ctx=hp.int("context_length", minimum=1),
            conv_kernel=hp.int("shortconv.l_cache", minimum=2) if "conv" in mixers else 0,
            n_layer=hp.int("block_count", minimum=1),
            **(_ssm_dims(facts, hp) if {"ssm", "deltanet"} & set(mixers) else {}),
        )
    n_head = hp.int("attention.head_count", minimum=1)
    if n_head > n_embd:
        raise GGUFError(path, f"{arch}.attention.head_count", f"{n_head} heads for an embedding of only {n_embd}")
    n_layer = hp.int("block_count", minimum=1)
    counts = hp.ints("attention.head_count_kv", n_layer) if per_layer else None
    if mixers is not None:
        n_kv_head = _attention_kv_heads(facts, hp, n_head, mixers)
    elif counts:
        n_kv_head = counts[0]
    else:
        n_kv_head = hp.int("attention.head_count_kv", default=n_head, minimum=1)
    if n_kv_head < 1 or n_head % n_kv_head:
        raise GGUFError(path, f"{arch}.attention.head_count_kv", f"{n_kv_head} does not divide head_count {n_head}")
    head_dim = hp.int("attention.key_length", default=n_embd // n_head, minimum=1)
    head_dim_v = hp.int("attention.value_length", default=n_embd // n_head, minimum=1)
    if head_dim_v != head_dim and not latent:
        raise UnsupportedModelError(f"{path}: key_length {head_dim} != value_length {head_dim_v} is not supported")
    rope_dim = hp.int("rope.dimension_count", default=head_dim, minimum=2)
    if rope_dim > head_dim or rope_dim % 2:
        raise GGUFError(
            path, f"{arch}.rope.dimension_count", f"{rope_dim} must be even and at most the head size {head_dim}"
        )
    return Dims(
        n_vocab=_n_vocab(facts),
        n_embd=n_embd,
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=head_dim,
        n_ff=(_first_width(hp, n_layer) if per_layer else _ffn_width(facts, hp)) if ffn else 0,
        rope_dim=rope_dim,
        n_ctx=hp.int("context_length", minimum=1),
        conv_kernel=hp.int("shortconv.l_cache", minimum=2) if mixers and "conv" in mixers else 0,
        n_layer=hp.int("block_count", minimum=1),
        **(_ssm_dims(facts, hp) if ssm or mixers and {"ssm", "deltanet"} & set(mixers) else {}),
        **(_latent_dims(facts, hp, n_kv_head, head_dim, head_dim_v, rope_dim) if latent else {}),
    )


def _latent_dims(facts: GGUFFacts, hp: Hparams, n_kv_head: int, head_dim: int, head_dim_v: int, rope_dim: int) -> dict:
    """Multi-head latent attention's sizes (llama_hparams n_lora_q, n_lora_kv, n_embd_head_k_mla,
    n_embd_head_v_mla), checked against the cached row they imply: one KV head of key_length = kv_lora_rank +
    the RoPE dims, value_length = kv_lora_rank (what llama.cpp's converter writes for the absorbed form)."""
    path = facts.path
    if not hp.has("attention.key_length_mla"):
        raise UnsupportedModelError(
            f"{path}: {hp.key('attention.key_length_mla')} is missing: a DeepSeek file from before llama.cpp split "
            "attn_kv_b into attn_k_b and attn_v_b (the absorbed form); convert it again with a current converter"
        )
    dims = dict(
        q_lora=hp.int("attention.q_lora_rank", default=0),
        kv_lora=hp.int("attention.kv_lora_rank", minimum=1),
        head_dim_mla=hp.int("attention.key_length_mla", minimum=1),
        head_dim_v_mla=hp.int("attention.value_length_mla", minimum=1),
    )
    checks = (
        ("attention.head_count_kv", n_kv_head == 1, f"{n_kv_head}: latent attention caches one KV head"),
        (
            "attention.key_length",
            head_dim == dims["kv_lora"] + rope_dim,
            f"{head_dim}, not kv_lora_rank {dims['kv_lora']} + rope.dimension_count {rope_dim}",
        ),
        ("attention.value_length", head_dim_v == dims["kv_lora"], f"{head_dim_v}, not kv_lora_rank {dims['kv_lora']}"),
        (
            "attention.key_length_mla",
            dims["head_dim_mla"] > rope_dim,
            f"{dims['head_dim_mla']}, not above rope.dimension_count {rope_dim}",
        ),
    )
    for key, ok, problem in checks:
        if not ok:
            raise GGUFError(path, hp.key(key), problem)
    return dims


def _n_vocab(facts: GGUFFacts) -> int:
    if "token_embd.weight" not in facts.tensors:
        raise UnsupportedModelError(f"{facts.path}: missing tensor 'token_embd.weight'")
    return facts.tensors["token_embd.weight"].shape[0]


def _ffn_width(facts: GGUFFacts, hp: Hparams) -> int:
    """feed_forward_length: a scalar, or a per-layer array whose non-zero entries (the layers with an MLP, in a
    family whose other layers have none) agree."""
    n_layer = hp.int("block_count", minimum=1)
    widths = hp.ints("feed_forward_length", n_layer)
    if widths is None:
        return hp.int("feed_forward_length", minimum=1)
    used = sorted(set(widths) - {0})
    if len(used) != 1:
        raise UnsupportedModelError(
            f"{facts.path}: {hp.key('feed_forward_length')}: layers with MLPs of widths {used} are not supported"
        )
    return used[0]


def _first_width(hp: Hparams, n_layer: int) -> int:
    """feed_forward_length of layer 0 (a family whose layers have their own widths: Family.layer_dims)."""
    widths = hp.ints("feed_forward_length", n_layer)
    return widths[0] if widths else hp.int("feed_forward_length", minimum=1)


def _check_layer_dims(facts: GGUFFacts, hp: Hparams, layer_dims: list[Dims]) -> None:
    """Each layer's attention sizes as llama.cpp requires them: KV heads that divide the query heads, RoPE over an
    even number of dims within the head."""
    for il, d in enumerate(layer_dims):
        if d.n_kv_head < 1 or d.n_head % d.n_kv_head:
            raise GGUFError(
                facts.path, hp.key("attention.head_count_kv"), f"layer {il}: {d.n_kv_head} KV heads for {d.n_head}"
            )
        if d.rope_dim % 2 or d.rope_dim > d.head_dim or d.head_dim < 1:
            raise GGUFError(
                facts.path,
                hp.key("rope.dimension_count"),
                f"layer {il}: {d.rope_dim} RoPE dims for heads of {d.head_dim}",
            )


def _ssm_dims(facts: GGUFFacts, hp: Hparams) -> dict:
    """A Mamba-2 or delta-net mixer's sizes (llama_hparams ssm_d_conv, ssm_d_inner, ssm_d_state, ssm_dt_rank as
    the head count, ssm_n_group: a delta-net's v and k heads), checked to divide as llama.cpp splits them."""
    dims = dict(
        ssm_conv=hp.int("ssm.conv_kernel", minimum=2),
        ssm_inner=hp.int("ssm.inner_size", minimum=1),
        ssm_state=hp.int("ssm.state_size", minimum=1),
        ssm_head=hp.int("ssm.time_step_rank", minimum=1),
        ssm_group=hp.int("ssm.group_count", minimum=1),
    )
    if dims["ssm_inner"] % dims["ssm_head"]:
        raise GGUFError(
            facts.path,
            hp.key("ssm.time_step_rank"),
            f"{dims['ssm_head']} heads do not divide " f"ssm.inner_size {dims['ssm_inner']}",
        )
    if dims["ssm_head"] % dims["ssm_group"]:
        raise GGUFError(
            facts.path,
            hp.key("ssm.group_count"),
            f"{dims['ssm_group']} groups do not divide " f"{dims['ssm_head']} heads",
        )
    return dims


def _attention_kv_heads(facts: GGUFFacts, hp: Hparams, n_head: int, mixers: list[str]) -> int:
    """A hybrid's head_count_kv: a scalar, or a per-layer array (0 in its other layers) whose attention layers
    agree (llama.cpp's n_head_kv(il))."""
    key = f"{hp.arch}.attention.head_count_kv"
    counts = hp.ints("attention.head_count_kv", len(mixers))
    if counts is None:
        counts = [hp.int("attention.head_count_kv", default=n_head)] * len(mixers)
    used = sorted({n for n, mixer in zip(counts, mixers) if mixer == "attention"})
    if not used:
        return n_head  # no attention layer: nothing reads it
    if len(used) > 1:
        raise UnsupportedModelError(f"{facts.path}: {key}: attention layers with different KV head counts {used}")
    if used[0] < 1:
        raise GGUFError(facts.path, key, f"an attention layer needs at least one KV head, got {used[0]}")
    return used[0]


def bind_tensors(
    facts: GGUFFacts,
    family: Family,
    dims: Dims,
    n_layer: int,
    mixers: list[str] | None = None,
    ffns: list[str] | None = None,
    n_main: int | None = None,
    layer_dims: list[Dims] | None = None,
) -> dict[str, TensorBinding]:
    """Every tensor of the file bound to its table entry, checked for shape; missing or unknown ones refused.
    A per-layer entry of one token mixer (a hybrid's) belongs to the layers of `mixers` that mix that way, one of
    an FFN kind to the layers of `ffns` with that FFN. Of the n_layer blocks, those from n_main on are
    multi-token-prediction layers: they hold the NextN entries too, and are bound as tensors nothing reads. A
    block's tensors take their shapes from its `layer_dims` where the family gives them."""
    n_main = n_layer if n_main is None else n_main
    bindings: dict[str, TensorBinding] = {}
    missing: list[str] = []
    chosen = chosen_alternatives(facts, family)
    for spec in family.tensors:
        if spec.alternative and spec.alternative not in chosen:
            continue  # the other alternative's tensors are unknown to this file's model
        layers = [il for il in range(n_layer) if spec.in_layer(il, mixers, ffns, n_main)]
        names = [spec.name.format(il=il) for il in layers] if spec.per_layer else [spec.name]
        present = [n for n in names if n in facts.tensors]
        if spec.required:
            missing += [n for n in names if n not in facts.tensors]
        elif present and len(present) != len(names) and not spec.per_layer_choice:
            raise UnsupportedModelError(
                f"{facts.path}: {spec.suffix} is present in {len(present)} of {len(names)} layers; "
                "optional tensors must be in every layer or none"
            )
        for name, il in zip(names, layers if spec.per_layer else [0]):
            if name in present:
                own = layer_dims[il] if layer_dims and spec.per_layer else dims
                binding = _binding(facts, name, spec, own.resolve(spec.shape))
                bindings[name] = (
                    dataclasses.replace(binding, read=False) if spec.per_layer and il >= n_main else binding
                )
    if missing:
        shown = ", ".join(missing[:12]) + (f" … and {len(missing) - 12} more" if len(missing) > 12 else "")
        raise UnsupportedModelError(f"{facts.path}: {family.name} model is missing tensors: {shown}")
    unknown = [n for n in facts.tensors if n not in bindings]
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:12]) + (
            f" … and {len(unknown) - 12} more" if len(unknown) > 12 else ""
        )
        raise UnsupportedModelError(f"{facts.path}: tensors the {family.name} family does not know: {shown}")
    return bindings


def chosen_alternatives(facts: GGUFFacts, family: Family) -> set[str]:
    """The family's alternatives this file has (one of each component's: "moe" when layer 0 holds any of its
    tensors); a file with none has the first one, so that its missing tensors are named."""
    alternatives: dict[str, bool] = {}
    for spec in family.tensors:
        if spec.alternative:
            name = spec.name.format(il=0) if spec.per_layer else spec.name
            alternatives[spec.alternative] = alternatives.get(spec.alternative, False) or name in facts.tensors
    present = {a for a, found in alternatives.items() if found}
    if len(present) > 1:
        raise UnsupportedModelError(
            f"{facts.path}: the file has tensors of several {family.name} alternatives ({', '.join(sorted(present))})"
        )
    return present or set(list(alternatives)[:1])


def _binding(facts: GGUFFacts, name: str, spec: TensorSpec, expected: tuple[int, ...]) -> TensorBinding:
    info = facts.tensors[name]
    if info.shape != expected:
        raise GGUFError(
            facts.path,
            f"tensor {name!r} shape",
            f"expected {list(expected)} (numpy order, {' x '.join(spec.shape)}) from the hyperparameters, "
            f"found {list(info.shape)}",
        )
    if info.ggml_type not in KERNEL_TYPES and info.ggml_type not in FLOAT_TYPES + SNAPSHOT_TYPES:
        raise UnsupportedModelError(
            f"{facts.path}: tensor {name!r} is {info.ggml_type}, a type alchemist can neither multiply in its blocks "
            f"nor dequantize (weights: {', '.join(FLOAT_TYPES + KERNEL_TYPES)})"
        )
    gguf_kernel = info.ggml_type in KERNEL_TYPES and (
        spec.role in ("linear", "embedding") and len(info.shape) == 2 or spec.role == "experts" and len(info.shape) == 3
    )
    # kernels.mlx_affine: products, and rows read by token (dequantized as read)
    mlx_kernel = info.ggml_type == "MLX_AFFINE" and spec.role in ("linear", "embedding") and len(info.shape) == 2
    kernel = gguf_kernel or mlx_kernel
    if not kernel and info.ggml_type in NOT_IN_GGUF_PY:  # the module's loader dequantizes it with gguf-py
        raise UnsupportedModelError(
            f"{facts.path}: tensor {name!r} is {info.ggml_type}, which alchemist multiplies only as a projection, "
            f"an embedding or an expert stack (its {spec.role} would be dequantized by gguf-py, which cannot read it)"
        )
    return TensorBinding(
        name, info.ggml_type, info.shape, info.offset, info.nbytes, spec.role, kernel,
        file=info.file, transform=info.transform, quant=info.quant, parts=info.parts,
    )  # fmt: skip


def rope_scaling(facts: GGUFFacts, hp: Hparams, family: Family, bound: set[str], dims: Dims) -> dict:
    """RopeSpec fields shared by every layer: the scaling kind and its numbers, as llama.cpp's load_hparams and
    llama_context set them (scaling type "linear" by default; type "none" never scales; YaRN mixes in the
    extrapolated angle with ext_factor 1 and corrects the magnitude by 1 + 0.1 ln(factor))."""
    factor = hp.float("rope.scaling.factor", default=0.0) or hp.float("rope.scale_linear", default=0.0)
    kind = hp.str("rope.scaling.type", default="linear")
    if kind not in family.rope_scalings:
        raise UnsupportedModelError(
            f"{facts.path}: {family.name}.rope.scaling.type {kind!r} is not supported "
            f"(supported: {', '.join(family.rope_scalings)})"
        )
    freq_scale = 1.0 / factor if factor and kind != "none" else 1.0
    if not (math.isfinite(freq_scale) and freq_scale > 0):
        raise GGUFError(facts.path, f"{family.name}.rope.scaling.factor", f"invalid factor {factor}")
    attn_factor = hp.float("rope.scaling.attn_factor", default=1.0, positive=True)
    fields = dict(freq_scale=freq_scale, scaling=RopeScaling.LINEAR if freq_scale != 1.0 else RopeScaling.NONE)
    if "rope_freqs.weight" in bound:
        fields.update(scaling=RopeScaling.LLAMA3, freq_factors="rope_freqs.weight")
    if kind == "yarn":
        # llama_context: yarn_attn_factor = mscale(factor) / (1 + 0.1 ln factor) · attn_factor, and ggml's
        # rope multiplies by 1 + 0.1 ln(1/freq_scale) again: the net magnitude is mscale(factor) · attn_factor
        mscale = 1.0 + 0.1 * math.log(1.0 / freq_scale) if freq_scale < 1.0 else 1.0
        beta_fast, beta_slow = family.yarn_betas(hp)
        if family.yarn_attn_factor:
            # the family's own factor times ggml's magnitude, as ggml's rope multiplies them (float32)
            handed = family.yarn_attn_factor(hp, freq_scale)
            fields.update(ggml_attn_factor=handed)
            magnitude = float(np.float32(yarn_mscale_ggml(freq_scale)) * np.float32(handed))
        else:
            magnitude = mscale * attn_factor
        fields.update(
            scaling=RopeScaling.YARN,
            ext_factor=1.0,
            attn_factor=magnitude,
            beta_fast=beta_fast,
            beta_slow=beta_slow,
            n_ctx_orig=hp.int("rope.scaling.original_context_length", default=dims.n_ctx, minimum=1),
        )
    elif kind == "longrope":
        if not {"rope_factors_long.weight", "rope_factors_short.weight"} <= bound:
            raise UnsupportedModelError(f"{facts.path}: longrope scaling needs rope_factors_long and _short")
        fields.update(
            scaling=RopeScaling.LONGROPE,
            attn_factor=attn_factor,
            freq_factors="rope_factors_long.weight",
            freq_factors_short="rope_factors_short.weight",
            n_ctx_orig=hp.int("rope.scaling.original_context_length", default=dims.n_ctx, minimum=1),
        )
    return fields


def norm_spec(kind: NormKind, bound: set[str], weight: str, prefix: str = "") -> NormSpec | None:
    """The norm whose weight is `weight` (a block suffix when prefix is a layer's), or None if absent."""
    if prefix + weight not in bound:
        return None
    bias = weight.removesuffix(".weight") + ".bias"
    return NormSpec(kind, weight, bias if prefix + bias in bound else None)


def experts(facts: GGUFFacts, hp: Hparams, family: Family, router_layer: int = 0) -> RouterSpec | None:
    """The router of a mixture-of-experts file (expert_count > 0), None for a dense one. Every layer is then
    a mixture, as in llama.cpp (its expert tensors are required by the family's table), or, in a family with
    per-layer FFN kinds, every "moe" layer (the first of them: router_layer)."""
    n_expert = hp.int("expert_count", default=0)
    routed = any(spec.suffix == "ffn_gate_inp.weight" for spec in family.tensors)
    router = f"blk.{router_layer}.ffn_gate_inp.weight"
    if n_expert == 0:
        if routed and router in facts.tensors:
            raise GGUFError(facts.path, f"{family.name}.expert_count", "missing or 0, but the file has expert tensors")
        return None
    if not routed:
        raise UnsupportedModelError(f"{facts.path}: {family.name} mixture-of-experts models are not supported")
    if router not in facts.tensors:
        raise UnsupportedModelError(
            f"{facts.path}: {family.name}.expert_count is {n_expert}, but the file has no mixture-of-experts router "
            f"({router})"
        )
    n_used = hp.int("expert_used_count", default=0)
    if not 1 <= n_used <= n_expert:
        raise GGUFError(facts.path, f"{family.name}.expert_used_count", f"must be in [1, {n_expert}], got {n_used}")
    moe = family.moe
    return RouterSpec(
        n_expert=n_expert,
        n_expert_used=n_used,
        weight="ffn_gate_inp.weight",
        gating=moe.gating_from(hp) if moe.gating_from else moe.gating,
        normalize=moe.normalize_from(hp) if moe.normalize_from else moe.normalize,
        weight_scale=moe.weight_scale(hp),
        weight_inputs=moe.weight_inputs,
        **_expert_groups(facts, hp, family, n_expert, n_used),
    )


def _expert_groups(facts: GGUFFacts, hp: Hparams, family: Family, n_expert: int, n_used: int) -> dict:
    """RouterSpec's n_group and n_group_used (expert_group_count, expert_group_used_count), checked to split the
    experts evenly and to leave enough of them to choose from; {} without groups."""
    n_group, n_group_used = family.moe.groups(hp)
    if n_group <= 1:
        return {}
    key = hp.key("expert_group_count")
    if n_expert % n_group:
        raise GGUFError(facts.path, key, f"{n_group} groups do not split {n_expert} experts evenly")
    if not 1 <= n_group_used <= n_group or n_group_used * (n_expert // n_group) < n_used:
        raise GGUFError(
            facts.path,
            hp.key("expert_group_used_count"),
            f"{n_group_used} of {n_group} groups leave too few of the {n_expert} experts for {n_used} per token",
        )
    if n_expert // n_group < 2:
        raise GGUFError(facts.path, key, f"{n_group} groups of {n_expert} experts: a group score needs two experts")
    return dict(n_group=n_group, n_group_used=n_group_used)


def token_mixers(facts: GGUFFacts, family: Family, dims: Dims, kinds: set, present, block_norm) -> dict:
    """The spec of each token mixer other than attention that the model's layers use (`kinds`, from
    Family.layer_mixers), by kind, as LayerSpec names the field: "conv" (lfm2's short convolution), "ssm"
    (Mamba-2), "deltanet" (the gated delta-net); `present(suffix)` and `block_norm(weight)` read layer tensors."""
    specs = {}
    if "conv" in kinds:
        specs["conv"] = ShortConvSpec(
            kernel=dims.conv_kernel,
            in_proj="shortconv.in_proj.weight",
            conv="shortconv.conv.weight",
            out_proj="shortconv.out_proj.weight",
        )
    if "ssm" in kinds:
        specs["ssm"] = SSMSpec(
            conv_kernel=dims.ssm_conv,
            n_inner=dims.ssm_inner,
            n_state=dims.ssm_state,
            n_head=dims.ssm_head,
            n_group=dims.ssm_group,
            in_proj="ssm_in.weight",
            conv="ssm_conv1d.weight",
            conv_bias=present("ssm_conv1d.bias"),
            dt_bias="ssm_dt.bias",
            a="ssm_a",
            d="ssm_d",
            norm=block_norm("ssm_norm.weight"),
            out_proj="ssm_out.weight",
        )
    if "deltanet" in kinds:
        specs["deltanet"] = _deltanet(facts, family, dims, present, block_norm)
    return specs


def _deltanet(facts: GGUFFacts, family: Family, dims: Dims, present, block_norm) -> DeltaNetSpec:
    head_v = dims.ssm_inner // dims.ssm_head
    if head_v != dims.ssm_state:
        raise UnsupportedModelError(
            f"{facts.path}: delta-net v heads of {head_v} (ssm.inner_size / ssm.time_step_rank) differ from its "
            f"k heads of {dims.ssm_state} (ssm.state_size); llama.cpp requires them equal"
        )
    spec = DeltaNetSpec(
        conv_kernel=dims.ssm_conv,
        n_k_head=dims.ssm_group,
        n_v_head=dims.ssm_head,
        head_dim=dims.ssm_state,
        conv="ssm_conv1d.weight",
        dt_bias="ssm_dt.bias",
        a="ssm_a",
        norm=block_norm("ssm_norm.weight"),
        out_proj="ssm_out.weight",
        qkv=present("attn_qkv.weight"),
        gate=present("attn_gate.weight"),
        qkvz=present("ssm_in.weight"),
        beta=present("ssm_beta.weight"),
        alpha=present("ssm_alpha.weight"),
        beta_alpha=present("ssm_ba.weight"),
        k_heads_tiled=family.delta_k_heads_tiled,
    )
    if bool(spec.qkv and spec.gate) == bool(spec.qkvz):
        raise UnsupportedModelError(
            f"{facts.path}: a delta-net layer needs attn_qkv and attn_gate, or ssm_in (and not both)"
        )
    if bool(spec.beta and spec.alpha) == bool(spec.beta_alpha):
        raise UnsupportedModelError(
            f"{facts.path}: a delta-net layer needs ssm_beta and ssm_alpha, or ssm_ba (and not both)"
        )
    return spec


def _latent(facts: GGUFFacts, dims: Dims, present, block_norm) -> LatentAttentionSpec:
    """Multi-head latent attention from the bound tensors: queries by attn_q, or by attn_q_a, its norm and
    attn_q_b (llama.cpp: when attention.q_lora_rank > 0), never both."""
    low_rank = dims.q_lora > 0
    wanted = ("attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight") if low_rank else ("attn_q.weight",)
    other = ("attn_q.weight",) if low_rank else ("attn_q_a.weight", "attn_q_b.weight")
    if not all(present(t) for t in wanted) or any(present(t) for t in other):
        raise UnsupportedModelError(
            f"{facts.path}: attention.q_lora_rank is {dims.q_lora}, so each layer needs {', '.join(wanted)} and "
            f"not {', '.join(other)}"
        )
    return LatentAttentionSpec(
        kv_lora_rank=dims.kv_lora,
        head_dim_nope=dims.head_dim_mla - dims.rope_dim,
        head_dim_v=dims.head_dim_v_mla,
        kv_a="attn_kv_a_mqa.weight",
        kv_a_norm=block_norm("attn_kv_a_norm.weight"),
        k_b="attn_k_b.weight",
        v_b="attn_v_b.weight",
        q=present("attn_q.weight") if not low_rank else None,
        q_a="attn_q_a.weight" if low_rank else None,
        q_a_norm=block_norm("attn_q_a_norm.weight") if low_rank else None,
        q_b="attn_q_b.weight" if low_rank else None,
    )


def build_ir(facts: GGUFFacts, family: Family) -> ModelIR:
    hp = Hparams(facts, family.name)
    mixers = family.layer_mixers(hp, hp.int("block_count", minimum=1)) if family.layer_mixers else None
    n_blocks = hp.int("block_count", minimum=1)
    ffns = family.layer_ffns(hp, n_blocks) if family.layer_ffns else None
    has_ffn = ffns is None or any(kind != "none" for kind in ffns)
    dims = read_dims(
        facts,
        hp,
        mixers,
        latent=family.latent_attention,
        ffn=has_ffn,
        ssm=family.parallel_ssm,
        per_layer=family.layer_dims is not None,
    )
    if family.model_dims:
        dims = family.model_dims(hp, dims)
    n_mtp = family.mtp_layers(hp) if family.mtp_layers else 0
    if not 0 <= n_mtp < n_blocks:
        raise GGUFError(
            facts.path, f"{family.name}.nextn_predict_layers", f"must be below block_count {n_blocks}, got {n_mtp}"
        )
    n_layer = n_blocks - n_mtp  # the layers the model applies
    norm_eps = hp.float(EPS_KEYS[family.norm], positive=True)
    router = experts(facts, hp, family, ffns.index("moe") if ffns and "moe" in ffns else 0)
    if router:
        n_ff_exp = family.moe.expert_width(hp, router.n_expert_used)
        if n_ff_exp < 1:
            raise GGUFError(facts.path, f"{family.name}.expert_feed_forward_length", f"must be >= 1, got {n_ff_exp}")
        n_ff_shexp = family.moe.shared_width(hp, n_ff_exp)
        dims = dataclasses.replace(dims, n_expert=router.n_expert, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp)
    sliding = family.sliding_layers(hp, n_layer) if family.sliding_layers else [False] * n_layer
    chunk = family.attention_chunk(hp)  # a family's local layers attend within chunks instead of sliding
    chunked = [s and chunk > 0 for s in sliding]
    sliding = [s and not chunk for s in sliding]
    window = hp.int("attention.sliding_window", default=family.default_window) if any(sliding) else 0
    sliding = [s and window > 0 for s in sliding]
    layer_dims = None
    if family.layer_dims:
        layer_dims = [family.layer_dims(hp, dims, il, il < n_layer and sliding[il]) for il in range(n_blocks)]
        _check_layer_dims(facts, hp, layer_dims[:n_layer])
    bindings = bind_tensors(facts, family, dims, n_blocks, mixers, ffns, n_main=n_layer, layer_dims=layer_dims)
    bound = set(bindings)
    table = {spec.suffix: spec for spec in family.tensors}

    rope_fields = rope_scaling(facts, hp, family, bound, dims)
    rope_base = hp.float("rope.freq_base", default=10000.0, positive=True)
    swa_rope = family.swa_rope(hp, rope_base, rope_fields["freq_scale"]) if family.swa_rope else None
    attends = mixers is None or "attention" in mixers
    score_scale = (
        family.score_scale(hp, dims.head_dim_mla if family.latent_attention else dims.head_dim) if attends else 0.0
    )
    temperature = family.attn_temperature(hp)
    rotated_qk_norm = family.rotated_qk_norm(hp)

    # a block tensor's presence is read in the first layer that can have it (a hybrid's first of its mixer, the
    # first of its FFN kind)
    def first_layer(suffix: str) -> int:
        spec = table.get(suffix)
        if spec is None:
            return 0
        return next((il for il in range(n_layer) if spec.in_layer(il, mixers, ffns)), 0)

    layer0 = {
        spec.suffix
        for spec in family.tensors
        if spec.per_layer and spec.name.format(il=first_layer(spec.suffix)) in bound
    }
    wiring = family.wiring_for(hp, layer0) if family.wiring_for else family.wiring

    def block_norm(weight: str) -> NormSpec | None:
        return norm_spec(family.norm, bound, weight, prefix=f"blk.{first_layer(weight)}.")

    def present(suffix: str) -> str | None:
        return suffix if suffix in layer0 else None

    qk_scope = QKNormScope.HEAD
    if "attn_q_norm.weight" in layer0 and table["attn_q_norm.weight"].shape == ("n_q",):
        qk_scope = QKNormScope.FULL

    def mlp_spec(routed: bool) -> MLPSpec:
        if routed:
            kind = MLPKind.MOE
        elif "ffn_gate.weight" in layer0:
            kind = MLPKind.GATED
        elif table["ffn_up.weight"].shape[0] == "n_ff2":
            kind = MLPKind.FUSED_GATED
        else:
            kind = MLPKind.PLAIN
        # dense and expert MLPs bind the same tensors, the experts' with an _exps suffix and a router
        exps = "_exps" if routed else ""
        return MLPSpec(
            kind=kind,
            activation=family.activation,
            n_ff=dims.n_ff_exp if routed else dims.n_ff,
            up=f"ffn_up{exps}.weight",
            down=f"ffn_down{exps}.weight",
            gate=present(f"ffn_gate{exps}.weight"),
            up_bias=present(f"ffn_up{exps}.bias"),
            down_bias=present(f"ffn_down{exps}.bias"),
            gate_bias=present(f"ffn_gate{exps}.bias"),
            router=(
                dataclasses.replace(
                    router, bias=present("ffn_gate_inp.bias"), selection_bias=present("exp_probs_b.bias")
                )
                if routed
                else None
            ),
            shared=shared if routed else None,
            shared_gate=present("ffn_gate_inp_shexp.weight") if routed and shared else None,
        )

    shared = None
    if router and present("ffn_up_shexp.weight"):
        shared = MLPSpec(
            kind=MLPKind.GATED,
            activation=family.activation,
            n_ff=dims.n_ff_shexp,
            up="ffn_up_shexp.weight",
            down="ffn_down_shexp.weight",
            gate="ffn_gate_shexp.weight",
        )

    # per layer its FFN: one kind everywhere, or (a family with layer_ffns) dense and expert layers
    if ffns is None:
        mlp_of = [mlp_spec(router is not None)] * n_layer
    else:
        # "none": a layer without an MLP (Wiring.SINGLE: its token mixer alone)
        kinds = {
            kind: None if kind == "none" else mlp_spec(kind == "moe" and router is not None)
            for kind in dict.fromkeys(ffns)
        }
        mlp_of = [kinds[kind] for kind in ffns]
    # a delta-net's [q | k | v] is named like a fused attention projection; attention layers beside it are split
    fused = table.get("attn_qkv.weight")
    attention_qkv = present("attn_qkv.weight") if fused is not None and fused.mixer != "deltanet" else None
    kinds = set(mixers or ()) | ({"ssm"} if family.parallel_ssm else set())
    mixer_specs = token_mixers(facts, family, dims, kinds, present, block_norm)
    ffn_norm = block_norm(family.ffn_norm)
    # gpt-oss's post_attention_norm is its pre-FFN norm, not a norm on the attention output
    attn_post_norm = (
        None if family.ffn_norm == "post_attention_norm.weight" else block_norm("post_attention_norm.weight")
    )
    layers = []
    for il in range(n_layer):
        if mixers and mixers[il] in (*mixer_specs, "none"):
            layers.append(
                LayerSpec(
                    index=il,
                    wiring=wiring,
                    attention=None,
                    mlp=mlp_of[il],
                    attn_norm=block_norm("attn_norm.weight"),
                    ffn_norm=ffn_norm,
                    attn_post_norm=attn_post_norm,
                    ffn_post_norm=block_norm("post_ffw_norm.weight"),
                    residual_scale=family.residual_scale(hp),
                    **({mixers[il]: mixer_specs[mixers[il]]} if mixers[il] != "none" else {}),
                )
            )
            continue
        rotates = family.rope_on_layer(hp, il, sliding[il]) and family.rope is not RopeStyle.NONE
        fields = dict(rope_fields, base=rope_base)
        if sliding[il] and swa_rope is not None:
            fields.update(base=swa_rope[0], freq_scale=swa_rope[1])
        if sliding[il] and family.swa_plain_rope:
            fields.update(scaling=RopeScaling.NONE, freq_factors=None, attn_factor=1.0, ext_factor=0.0)
        own = layer_dims[il] if layer_dims else dims  # this layer's sizes
        rope = RopeSpec(style=family.rope if rotates else RopeStyle.NONE, dim=own.rope_dim, **fields)
        latent = _latent(facts, dims, present, block_norm) if family.latent_attention else None
        attention = AttentionSpec(
            n_head=own.n_head,
            n_kv_head=own.n_kv_head,
            head_dim=own.head_dim,
            head_dim_v=dims.kv_lora if latent else own.head_dim,
            rope=rope,
            sliding_window=window if sliding[il] else 0,
            score_scale=family.score_scale(hp, own.head_dim) if layer_dims else score_scale,
            out="attn_output.weight",
            qkv=attention_qkv,
            q=present("attn_q.weight") if latent is None else None,  # a latent attention's is its own
            k=present("attn_k.weight"),
            v=present("attn_v.weight"),
            qkv_bias=present("attn_qkv.bias"),
            q_bias=present("attn_q.bias"),
            k_bias=present("attn_k.bias"),
            v_bias=present("attn_v.bias"),
            out_bias=present("attn_output.bias"),
            q_norm=block_norm("attn_q_norm.weight"),
            k_norm=block_norm("attn_k_norm.weight"),
            qk_norm_scope=qk_scope,
            logit_softcap=family.attn_softcap(hp),
            prescale_queries=family.prescale_queries,
            sinks=present("attn_sinks.weight"),
            temperature=temperature,
            rotated_qk_norm=rotated_qk_norm,
            chunk=chunk if chunked[il] else 0,
            output_gate=family.gated_attention,
            latent=latent,
        )
        mlp = mlp_of[il]
        if layer_dims and mlp is not None and mlp.router is None:
            mlp = dataclasses.replace(mlp, n_ff=own.n_ff)
        layers.append(
            LayerSpec(
                index=il,
                wiring=wiring,
                attention=attention,
                mlp=mlp,
                attn_norm=block_norm("attn_norm.weight"),
                ffn_norm=ffn_norm,
                attn_post_norm=attn_post_norm,
                ffn_post_norm=block_norm("post_ffw_norm.weight"),
                residual_scale=family.residual_scale(hp),
                ssm=mixer_specs["ssm"] if family.parallel_ssm else None,  # beside attention
            )
        )

    model_name = hp._lookup("general.name") or ""
    ir = ModelIR(
        architecture=family.name,
        model_name=model_name if isinstance(model_name, str) else "",
        source_file=facts.file_name,
        source_sha256=facts.sha256(),
        file_size=facts.file_size,
        data_offset=facts.data_offset,
        n_vocab=dims.n_vocab,
        n_embd=dims.n_embd,
        n_layer=n_layer,
        n_ctx_train=dims.n_ctx,
        norm_eps=norm_eps,
        embedding=EmbeddingSpec(
            weight="token_embd.weight",
            scale=family.embedding_scale(hp),
            positions="position_embd.weight" if "position_embd.weight" in bound else None,
        ),
        layers=tuple(layers),
        output=OutputSpec(
            norm=norm_spec(family.norm, bound, family.output_norm),
            weight="output.weight" if "output.weight" in bound else "token_embd.weight",
            logit_scale=family.logit_scale(hp),
            final_softcap=family.final_softcap(hp),
        ),
        # GGUF file order: the order the loader reads the memory map in
        tensors=tuple(bindings[n] for n in facts.tensors),
        tap_names=family.tap_names,
        source_files=getattr(facts, "source_files", ()),  # a snapshot's files
    )
    ir = family.components(hp, ir) if family.components else ir
    read = {"general.architecture"} | hp.read  # the architecture chose the family before hp existed
    return dataclasses.replace(ir, metadata=tuple((k, metadata_literal(facts.metadata[k])) for k in sorted(read)))


def metadata_literal(value):
    """A metadata value as plain data: scalars as they are, an array as ("ndarray", dtype, values)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), tuple(value.tolist()))
    if isinstance(value, np.generic):
        return value.item()
    return value


def metadata_value(literal):
    """metadata_literal's inverse."""
    if isinstance(literal, tuple) and len(literal) == 3 and literal[0] == "ndarray":
        return np.array(literal[2], dtype=literal[1])
    return literal
