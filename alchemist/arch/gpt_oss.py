"""gpt-oss (OpenAI's open-weight MoE): llama.cpp src/models/openai-moe.cpp (LLM_ARCH_OPENAI_MOE).

Llama's pre-norm block with q/k/v/o biases and NEOX RoPE (YaRN in real files) over heads of n_rot, scores
scaled by 1/sqrt(n_rot); every query head has a learned attention sink (attn_sinks.weight), one more logit in
its softmax, unscaled, that adds no value. Even layers slide (load_swa_pattern(2): window
attention.sliding_window, required), at rope.freq_base_swa (default: the model's base). The pre-FFN norm is
the file's post_attention_norm. The FFN is a mixture of experts in every layer: the router has a bias, picks
the top-k experts by their raw logits and softmaxes over those k (SOFTMAX_WEIGHT, no renormalization, no
weight scale: llama.cpp reads neither gating nor scale from the file); each expert adds its bias (F32) to
gate, up and down, and gates with swiglu_oai. The output is never tied.
"""

import dataclasses
import math

from alchemist.arch.family import REQUIRED, ExpertRouting, Family, FixtureSpec, every_nth_dense
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_OUT_BIAS,
    ATTN_POST_NORM,
    ATTN_QKV_BIAS,
    ATTN_QKV_SPLIT,
    ATTN_SINKS,
    FFN_MOE,
    FFN_MOE_BIAS,
    FFN_MOE_ROUTER_BIAS,
    OUTPUT,
    OUTPUT_NORM,
    TOKEN_EMBD,
    optional,
)
from alchemist.ir import Activation, Gating, RopeStyle


def _score_scale(hp, head_dim: int) -> float:
    # llama.cpp: 1/sqrt(n_rot); the head size is n_rot throughout this architecture
    return 1.0 / math.sqrt(hp.int("rope.dimension_count", default=head_dim))


FAMILY = Family(
    name="gpt-oss",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + tuple(dataclasses.replace(t, required=True) for t in OUTPUT)  # never tied
    + ATTN_NORM
    + ATTN_QKV_SPLIT
    + optional(*ATTN_QKV_BIAS)
    + ATTN_OUT
    + ATTN_OUT_BIAS
    + ATTN_SINKS
    + ATTN_POST_NORM
    + FFN_MOE
    + FFN_MOE_ROUTER_BIAS
    + FFN_MOE_BIAS,
    rope=RopeStyle.NEOX,
    activation=Activation.SWIGLU_OAI,
    score_scale=_score_scale,
    sliding_layers=every_nth_dense(2),
    default_window=REQUIRED,  # llama.cpp requires attention.sliding_window
    swa_rope=lambda hp, base, scale: (hp.float("rope.freq_base_swa", default=base, positive=True), scale),
    ffn_norm="post_attention_norm.weight",
    tap_names=(("ffn_norm", "attn_post_norm"),),  # openai-moe.cpp's name for the pre-MoE norm's output
    moe=ExpertRouting(
        gating=Gating.SOFTMAX_WEIGHT,
        normalize=False,
        expert_width=lambda hp, n_expert_used: hp.int("expert_feed_forward_length", minimum=1),
    ),
    fixture=FixtureSpec(
        optional=("blk.{il}.attn_q.bias", "blk.{il}.attn_k.bias", "blk.{il}.attn_v.bias"),
        # 8 experts, 2 per token (with 4, one token of the test prompt has a near-tie for its second expert that
        # llama.cpp's activation rounding on Q4_K flips); layer 0 slides over a window the test prompt crosses;
        # YaRN as real files have it
        metadata=(
            ("expert_count", 8),
            ("expert_used_count", 2),
            ("expert_feed_forward_length", 256),
            ("attention.sliding_window", 8),
            ("rope.scaling.type", "yarn"),
            ("rope.scaling.factor", 4.0),
            ("rope.scaling.original_context_length", 128),
        ),
    ),
)
