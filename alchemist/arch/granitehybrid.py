"""Granite 4.0 hybrids (granite-4.0-h): llama.cpp src/models/granite-hybrid.cpp (LLM_ARCH_GRANITE_HYBRID).

A hybrid of Mamba-2 layers and attention layers, each followed by the same pre-norm SiLU FFN (a gated MLP, or
a mixture of experts with softmax routing, renormalized, plus an optional shared expert). A layer is a Mamba-2
layer where attention.head_count_kv is 0 (llama.cpp's is_recurrent(il)). The Mamba-2 mixer
(build_mamba2_layer): z, xBC, dt = in_proj(x); xBC = silu(conv(xBC) + b) over the last ssm.conv_kernel
positions; x, B, C = split(xBC); per head a state h (head_dim, state_size) decays by exp(softplus(dt + dt_b) · A)
and takes in B ⊗ x · softplus(...), y = C · h + D · x; then out_proj(rms_norm_per_group(y · silu(z))). The
attention layers rotate with NORM RoPE unless rope.scaling.finetuned is false (Granite 4.0 is NoPE). Granite's
four scales: embeddings, residual branches, q·k (attention.scale) and the logits (divided by logit_scale; each
applied only when set and non-zero).
"""

from alchemist.arch.family import ExpertRouting, Family, FixtureSpec, attention_scale_key, recurrent_where_no_kv_heads
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_OUT_BIAS,
    ATTN_QKV_BIAS,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    FFN_MOE,
    FFN_NORM,
    FFN_SHEXP,
    OUTPUT,
    OUTPUT_NORM,
    SSM_MAMBA2,
    TOKEN_EMBD,
    alternative,
    only_in,
    optional,
)
from alchemist.ir import Activation, RopeStyle

# a fixture's Mamba-2 sizes: 8 heads of 64 (inner 2 · n_embd, as llama.cpp requires) in 2 groups, state 16
SSM_FIXTURE = (
    ("ssm.conv_kernel", 4),
    ("ssm.inner_size", 512),
    ("ssm.state_size", 16),
    ("ssm.time_step_rank", 8),
    ("ssm.group_count", 2),
)

GRANITE_SCALES = (
    ("embedding_scale", 2.0),
    ("residual_scale", 0.5),
    ("attention.scale", 0.1),
    ("logit_scale", 4.0),
    ("rope.scaling.finetuned", False),
)

# what the Mamba-2 hybrids share (nemotron_h too): the embeddings, the input norm, and both token mixers
MIXERS = (
    TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT
    + ATTN_NORM
    + SSM_MAMBA2
    + only_in("attention", *ATTN_QKV_SPLIT, *ATTN_OUT, *optional(*ATTN_QKV_BIAS, *ATTN_OUT_BIAS))
)

FAMILY = Family(
    name="granitehybrid",
    tensors=MIXERS + FFN_NORM + alternative("dense", *FFN_GATED) + alternative("moe", *FFN_MOE, *optional(*FFN_SHEXP)),
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    layer_mixers=recurrent_where_no_kv_heads("ssm"),
    score_scale=attention_scale_key,
    embedding_scale=lambda hp: hp.float("embedding_scale", default=0.0) or 1.0,
    residual_scale=lambda hp: hp.float("residual_scale", default=0.0) or 1.0,
    logit_scale=lambda hp: 1.0 / (hp.float("logit_scale", default=0.0) or 1.0),
    # rope.scaling.finetuned (default true) switches RoPE on or off in every attention layer
    rope_on_layer=lambda hp, il, sliding: hp.bool("rope.scaling.finetuned", default=True),
    moe=ExpertRouting(shared_width=lambda hp, n_ff_exp: hp.int("expert_shared_feed_forward_length", default=0)),
    # layers 0, 2 and 3 are Mamba-2 layers, layer 1 attends; granite's scales all set; RoPE off as in Granite 4.0
    fixture=FixtureSpec(
        n_layer=4,
        metadata=(("attention.head_count_kv", (0, 2, 0, 0)), *SSM_FIXTURE, *GRANITE_SCALES),
        variants=(
            # Granite 4.0-H Tiny's shape: experts with a shared expert, RoPE in the attention layers
            (
                "moe",
                FixtureSpec(
                    n_layer=4,
                    alternative="moe",
                    optional=(
                        "blk.{il}.ffn_gate_shexp.weight",
                        "blk.{il}.ffn_up_shexp.weight",
                        "blk.{il}.ffn_down_shexp.weight",
                    ),
                    metadata=(
                        ("attention.head_count_kv", (0, 0, 2, 0)),
                        *SSM_FIXTURE,
                        *GRANITE_SCALES[:-1],
                        ("expert_count", 4),
                        ("expert_used_count", 2),
                        ("expert_shared_feed_forward_length", 256),
                    ),
                ),
            ),
        ),
    ),
)
