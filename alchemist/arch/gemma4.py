"""Gemma 4 (text): llama.cpp src/models/gemma4.cpp (llama_model_gemma4).

Gemma 3's block (embeddings times sqrt(n_embd), sandwich norms, q/k RMSNorm per head before NEOX RoPE, a GELU
(tanh) gated MLP, sliding-window layers with their own RoPE base, rope.freq_base_swa) with kq scale 1 and values
RMS-normed without a weight, and:
- per-layer sizes: the sliding layers' heads are attention.key_length_swa wide (RoPE over
  rope.dimension_count_swa), the global layers' attention.key_length (RoPE over rope.dimension_count); KV heads
  and FFN widths may be given per layer (head_count_kv: the global layers' own count; feed_forward_length: the
  double-wide MLP of the KV-sharing layers);
- "proportional" RoPE on the global layers: rope_freqs.weight divides their frequencies (the converter writes 1e30
  for the dims it leaves unrotated); the sliding layers rotate without it;
- KV sharing: the last attention.shared_kv_layers layers compute only queries and attend to the cache of layer
  n_layer - shared - 2 (sliding) or - 1 (global), gemma3n's rule;
- per-layer inputs (embedding_length_per_layer_input > 0): gemma3n's (a row of per_layer_token_embd by token times
  sqrt(width), plus per_layer_model_proj of the scaled embedding / sqrt(n_embd), RMS-normed by
  per_layer_proj_norm, summed, / sqrt 2), each added after its layer's MLP through the layer's gate:
  x + post_norm(proj(gelu(inp_gate · x) · input));
- layer_output_scale: a scalar multiplying each layer's output;
- values from keys: a layer without attn_v (the global layers of the larger models, attention_k_eq_v) takes its
  keys' projection as its values, RMS-normed without a weight like any value;
- final logit softcapping (final_logit_softcapping, llama_hparams' default 30);
- experts beside the dense MLP (expert_count > 0, the 26B-A4B): every layer's FFN is
  post_ffw_norm_1(mlp(ffn_norm(x))) + post_ffw_norm_2(experts(pre_ffw_norm_2(x))); the router reads
  rms_norm(x) / sqrt(n_embd) · ffn_gate_inp.scale, softmax over all experts, top-k, weights renormalized; each
  expert a GELU-gated MLP of expert_feed_forward_length, gate and up stacked in ffn_gate_up_exps (or apart), its
  output times its ffn_down_exps.scale.
Norm weights multiply as stored (the converter adds no +1).
"""

import dataclasses
import math

import numpy as np

from alchemist.arch.family import (
    ExpertRouting,
    Family,
    FixtureSpec,
    Hparams,
    every_nth_dense,
    gemma_fixture_scales,
    shared_kv_source,
)
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_POST_NORM,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    FFN_MOE_BESIDE_MLP,
    FFN_NORM,
    FFN_POST_NORM,
    LAYER_OUT_SCALE,
    OUTPUT,
    OUTPUT_NORM,
    PER_LAYER_INPUTS,
    QK_NORM_HEAD,
    ROPE_FREQS,
    TOKEN_EMBD,
    Dims,
    only_in_ffn,
    optional,
)
from alchemist.errors import UnsupportedModelError
from alchemist.ir import (
    Activation,
    BranchNorms,
    MLPKind,
    MLPSpec,
    ModelIR,
    NormKind,
    NormSpec,
    PerLayerGateSpec,
    PerLayerInputSpec,
    RopeStyle,
)

INV_SQRT2 = float(np.float32(1.0) / np.sqrt(np.float32(2.0)))  # 1.0f / sqrtf(2.0f)
KV_SHARED = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")  # loaded on KV-sharing layers, never applied


# the fixtures' layers: sliding but for layers 3 and 5 (global: heads of 64, one KV head, RoPE over rope_freqs)
FIXTURE_LAYERS = (
    ("attention.sliding_window", 8),
    ("attention.sliding_window_pattern", (True, True, True, False, True, False)),
    ("attention.key_length_swa", 32),
    ("attention.value_length_swa", 32),
    ("rope.dimension_count_swa", 32),
    ("rope.freq_base_swa", 1000.0),
    ("attention.head_count_kv", (2, 2, 2, 1, 2, 1)),
)
FIXTURE_OPTIONAL = ("rope_freqs.weight", *(f"blk.{{il}}.{s}" for s in KV_SHARED), "blk.{il}.layer_output_scale.weight")


def _per_layer_choice(specs):
    """The file chooses per layer (llama.cpp's TENSOR_NOT_REQUIRED): attn_v where a layer has one (the larger
    models' global layers take their values from their keys); attn_k and its norm, which the KV-sharing layers
    need not have (_components requires them of the layers that write a cache)."""
    return tuple(
        dataclasses.replace(s, required=False, per_layer_choice=True) if s.suffix in KV_SHARED else s for s in specs
    )


def _model_dims(hp: Hparams, dims: Dims) -> Dims:
    return dataclasses.replace(dims, n_embd_per_layer=hp.int("embedding_length_per_layer_input", default=0))


def _layer_dims(hp: Hparams, dims: Dims, il: int, sliding: bool) -> Dims:
    """Layer il's sizes: a sliding layer's heads and RoPE dims from the _swa keys; KV heads and FFN width from
    their per-layer arrays where the file has them."""
    kv_heads = hp.ints("attention.head_count_kv", dims.n_layer)
    widths = hp.ints("feed_forward_length", dims.n_layer)
    head_dim, rope_dim = dims.head_dim, dims.rope_dim
    if sliding:
        head_dim = hp.int("attention.key_length_swa", minimum=1)
        if hp.int("attention.value_length_swa", default=head_dim) != head_dim:
            raise UnsupportedModelError(f"{hp.facts.path}: gemma4 needs key_length_swa == value_length_swa")
        rope_dim = hp.int("rope.dimension_count_swa", default=rope_dim)
    return dataclasses.replace(
        dims,
        n_kv_head=kv_heads[il] if kv_heads else dims.n_kv_head,
        n_ff=widths[il] if widths else dims.n_ff,
        head_dim=head_dim,
        rope_dim=rope_dim,
    )


def _layer_ffns(hp: Hparams, n_layer: int) -> list[str]:
    """Every layer's FFN has experts beside its MLP in a file with experts (llama.cpp decides by ffn_gate_inp)."""
    return ["moe" if hp.int("expert_count", default=0) else "dense"] * n_layer


def _experts_beside_mlp(lay, n_ff: int, bound: set[str], where: str) -> MLPSpec:
    """Layer lay's FFN as experts beside its dense MLP, each branch with its own norms (llama.cpp's is_moe_layer)."""
    il, mlp, p = lay.index, lay.mlp, f"blk.{lay.index}."
    fused = p + "ffn_gate_up_exps.weight" in bound
    apart = p + "ffn_gate_exps.weight" in bound and p + "ffn_up_exps.weight" in bound
    if fused == apart:
        raise UnsupportedModelError(
            f"{where} layer {il}: its experts need ffn_gate_up_exps.weight, or ffn_gate_exps.weight and "
            "ffn_up_exps.weight (not both)"
        )
    rms = lay.ffn_norm.kind
    return dataclasses.replace(
        mlp,
        up="ffn_gate_up_exps.weight" if fused else mlp.up,
        gate=None if fused else "ffn_gate_exps.weight",
        gate_up_fused=fused,
        router=dataclasses.replace(mlp.router, input_scale="ffn_gate_inp.scale"),
        down_scale="ffn_down_exps.scale" if p + "ffn_down_exps.scale" in bound else None,
        shared=MLPSpec(
            kind=MLPKind.GATED,
            activation=mlp.activation,
            n_ff=n_ff,
            up="ffn_up.weight",
            down="ffn_down.weight",
            gate="ffn_gate.weight",
        ),
        branch_norms=BranchNorms(
            shared_in=lay.ffn_norm,
            shared_out=NormSpec(rms, "post_ffw_norm_1.weight"),
            experts_in=NormSpec(rms, "pre_ffw_norm_2.weight"),
            experts_out=NormSpec(rms, "post_ffw_norm_2.weight"),
        ),
    )


def _components(hp: Hparams, ir: ModelIR) -> ModelIR:
    where = f"{hp.facts.path}: gemma4"
    sliding = [lay.attention.sliding_window > 0 for lay in ir.layers]
    kv_from_start = ir.n_layer - hp.int("attention.shared_kv_layers", default=0)
    if not 0 <= kv_from_start <= ir.n_layer:
        raise UnsupportedModelError(f"{where}: attention.shared_kv_layers exceeds the {ir.n_layer} layers")
    bound = {t.name for t in ir.tensors}
    width = hp.int("embedding_length_per_layer_input", default=0)
    if width and "per_layer_token_embd.weight" not in bound:
        raise UnsupportedModelError(f"{where}: per-layer inputs of {width} without per_layer_token_embd.weight")
    gate = PerLayerGateSpec("inp_gate.weight", "proj.weight", NormSpec(NormKind.RMS, "post_norm.weight"))
    widths = hp.ints("feed_forward_length", ir.n_layer) or [hp.int("feed_forward_length")] * ir.n_layer
    layers = []
    for lay in ir.layers:
        il = lay.index
        kv_layer = shared_kv_source(il, sliding, kv_from_start, where)
        v = lay.attention.v  # a KV-sharing layer's own K and V, if the file has them, are never applied
        if kv_layer == il:
            missing = [f"blk.{il}.{s}" for s in ("attn_k.weight", "attn_k_norm.weight") if f"blk.{il}.{s}" not in bound]
            if missing:
                raise UnsupportedModelError(f"{where} layer {il} writes a KV cache but has no {', '.join(missing)}")
            v = "attn_v.weight" if f"blk.{il}.attn_v.weight" in bound else None  # None: values from the keys
        attention = dataclasses.replace(lay.attention, v=v, kv_layer=kv_layer, v_norm=NormSpec(NormKind.RMS, None))
        routed = lay.mlp.router is not None
        layers.append(
            dataclasses.replace(
                lay,
                attention=attention,
                mlp=_experts_beside_mlp(lay, widths[il], bound, where) if routed else lay.mlp,
                ffn_norm=None if routed else lay.ffn_norm,  # the branches' own
                per_layer_gate=gate if width else None,
                out_scale="layer_output_scale.weight" if f"blk.{il}.layer_output_scale.weight" in bound else None,
            )
        )
    # K/V projections of a KV-sharing layer are loaded (llama.cpp requires them where present) but never applied
    unread = {f"blk.{lay.index}.{s}" for lay in layers if lay.attention.kv_layer != lay.index for s in KV_SHARED}
    tensors = tuple(dataclasses.replace(t, read=False) if t.name in unread else t for t in ir.tensors)
    per_layer = None
    if width:
        per_layer = PerLayerInputSpec(
            token_embd="per_layer_token_embd.weight",
            model_proj="per_layer_model_proj.weight",
            proj_norm=NormSpec(NormKind.RMS, "per_layer_proj_norm.weight"),
            width=width,
            token_scale=float(np.sqrt(np.float32(width))),
            proj_scale=float(np.float32(1.0) / np.sqrt(np.float32(ir.n_embd))),
            sum_scale=INV_SQRT2,
        )
    return dataclasses.replace(ir, layers=tuple(layers), tensors=tensors, per_layer_input=per_layer)


FAMILY = Family(
    name="gemma4",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT
    + ROPE_FREQS
    + ATTN_NORM
    + _per_layer_choice(ATTN_QKV_SPLIT)
    + ATTN_OUT
    + _per_layer_choice(QK_NORM_HEAD)
    + ATTN_POST_NORM
    + FFN_NORM
    + FFN_GATED
    + FFN_POST_NORM
    + optional(*PER_LAYER_INPUTS)
    + optional(*LAYER_OUT_SCALE)
    + only_in_ffn("moe", *FFN_MOE_BESIDE_MLP),
    rope=RopeStyle.NEOX,
    activation=Activation.GELU_TANH,
    score_scale=lambda hp, head_dim: 1.0,  # f_attention_scale: q and k are RMS-normed
    embedding_scale=lambda hp: math.sqrt(hp.int("embedding_length")),
    final_softcap=lambda hp: hp.float("final_logit_softcapping", default=30.0, positive=True),
    layer_ffns=_layer_ffns,
    moe=ExpertRouting(expert_width=lambda hp, n_expert_used: hp.int("expert_feed_forward_length", minimum=1)),
    sliding_layers=every_nth_dense(6),
    swa_rope=lambda hp, base, scale: (hp.float("rope.freq_base_swa", default=10000.0, positive=True), 1.0),
    swa_plain_rope=True,  # rope_freqs (the global layers' proportional RoPE) is not the sliding layers'
    model_dims=_model_dims,
    layer_dims=_layer_dims,
    components=_components,
    # E2B's shape, scaled down: 6 layers, layers 3 and 5 global (heads of 64, one KV head, RoPE divided by
    # rope_freqs) and the others sliding (heads of 32, two KV heads); the last 2 layers share the KV caches of
    # layers 2 and 3 and have MLPs twice as wide; per-layer inputs of 16; values scaled as gemma_fixture_scales says
    fixture=FixtureSpec(
        vocab="spm",
        n_layer=6,
        optional=FIXTURE_OPTIONAL
        + (
            "per_layer_token_embd.weight",
            "per_layer_model_proj.weight",
            "per_layer_proj_norm.weight",
            "blk.{il}.inp_gate.weight",
            "blk.{il}.proj.weight",
            "blk.{il}.post_norm.weight",
        ),
        metadata=FIXTURE_LAYERS
        + (
            ("feed_forward_length", (512, 512, 512, 512, 1024, 1024)),
            ("attention.shared_kv_layers", 2),
            ("embedding_length_per_layer_input", 16),
            ("final_logit_softcapping", 30.0),
        ),
        embedding_std=0.5,
        scales=gemma_fixture_scales(0.3),
        # the 31B's shape: no per-layer inputs, no shared caches, the global layers' values from their keys
        variants=(
            (
                "k_eq_v",
                FixtureSpec(
                    vocab="spm",
                    n_layer=6,
                    optional=FIXTURE_OPTIONAL,
                    absent=("blk.3.attn_v.weight", "blk.5.attn_v.weight"),
                    metadata=FIXTURE_LAYERS
                    + (
                        ("embedding_length_per_layer_input", 0),
                        ("final_logit_softcapping", 30.0),
                    ),
                    embedding_std=0.5,
                    scales=gemma_fixture_scales(0.3),
                ),
            ),
            # the 26B-A4B's shape: the 31B's attention, and in every layer 8 experts (2 per token) beside the MLP;
            # the router's scale times sqrt(n_embd) undoes its input's 1/sqrt(n_embd), for a decisive router
            (
                "moe",
                FixtureSpec(
                    vocab="spm",
                    n_layer=6,
                    optional=FIXTURE_OPTIONAL + ("blk.{il}.ffn_gate_up_exps.weight", "blk.{il}.ffn_down_exps.scale"),
                    absent=("blk.3.attn_v.weight", "blk.5.attn_v.weight"),
                    metadata=FIXTURE_LAYERS
                    + (
                        ("embedding_length_per_layer_input", 0),
                        ("final_logit_softcapping", 30.0),
                        ("expert_count", 8),
                        ("expert_used_count", 2),
                        ("expert_feed_forward_length", 128),
                    ),
                    embedding_std=0.5,
                    scales=gemma_fixture_scales(0.3)
                    + (("blk.{il}.ffn_gate_up_exps.weight", 50.0), ("blk.{il}.ffn_gate_inp.scale", 16.0)),
                ),
            ),
        ),
    ),
)
