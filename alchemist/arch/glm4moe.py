"""GLM-4.5 / GLM-4.6 (and Solar Open): llama.cpp src/models/glm4-moe.cpp (LLM_ARCH_GLM4_MOE).

Llama's pre-norm block with q/k/v biases, optional per-head q/k RMS norms before a partial NEOX RoPE, and
the file's post_attention_norm as the pre-FFN norm. The first leading_dense_block_count layers have a dense
SiLU MLP; the others a mixture of experts: sigmoid scores (expert_gating_func, sigmoid when absent), the
experts chosen by score plus a selection bias (exp_probs_b), weighted by the unbiased scores, renormalized when
expert_weights_norm and scaled by expert_weights_scale, plus a shared expert of expert_shared_count times the
expert width every token goes through. The last nextn_predict_layers blocks are multi-token-prediction
layers, loaded and never applied (as llama.cpp does).
"""

from alchemist.arch.family import ExpertRouting, Family, FixtureSpec, gating_from_file, leading_dense_ffns
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_POST_NORM,
    ATTN_QKV_BIAS,
    ATTN_QKV_SPLIT,
    FFN_EXP_PROBS_B,
    FFN_GATED,
    FFN_MOE,
    FFN_SHEXP,
    NEXTN,
    OUTPUT,
    OUTPUT_NORM,
    QK_NORM_HEAD,
    TOKEN_EMBD,
    only_in_ffn,
    optional,
)
from alchemist.ir import Activation, Gating, RopeStyle

FAMILY = Family(
    name="glm4moe",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT
    + ATTN_NORM
    + ATTN_QKV_SPLIT
    + optional(*ATTN_QKV_BIAS)
    + ATTN_OUT
    + optional(*QK_NORM_HEAD)
    + ATTN_POST_NORM
    + only_in_ffn("dense", *FFN_GATED)
    + only_in_ffn("moe", *FFN_MOE, *FFN_EXP_PROBS_B, *optional(*FFN_SHEXP))
    + NEXTN,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    ffn_norm="post_attention_norm.weight",
    # glm4-moe.cpp's names for the pre-FFN norm's output and the shared expert's
    tap_names=(("ffn_norm", "post_attn_norm"), ("ffn_shexp", "ffn_shexp_out")),
    layer_ffns=leading_dense_ffns,
    mtp_layers=lambda hp: hp.int("nextn_predict_layers", default=0),
    moe=ExpertRouting(
        gating_from=gating_from_file(default=Gating.SIGMOID),  # absent or NONE: GLM-4.5's sigmoid
        normalize_from=lambda hp: hp.bool("expert_weights_norm", default=False),
        weight_scale=lambda hp: hp.float("expert_weights_scale", default=0.0) or 1.0,
        expert_width=lambda hp, n_used: hp.int("expert_feed_forward_length", default=0)
        or hp.int("feed_forward_length") // n_used,
        shared_width=lambda hp, n_ff_exp: n_ff_exp * hp.int("expert_shared_count", default=0),
    ),
    # layer 0 dense, 1 and 2 experts with a shared one, 3 a multi-token-prediction layer (never applied);
    # half the head rotates, as in GLM-4.5
    fixture=FixtureSpec(
        n_layer=4,
        rope_dim=32,
        optional=(
            "output.weight",
            "blk.{il}.attn_q.bias",
            "blk.{il}.attn_k.bias",
            "blk.{il}.attn_v.bias",
            "blk.{il}.attn_q_norm.weight",
            "blk.{il}.attn_k_norm.weight",
            "blk.{il}.ffn_gate_shexp.weight",
            "blk.{il}.ffn_up_shexp.weight",
            "blk.{il}.ffn_down_shexp.weight",
        ),
        metadata=(
            ("leading_dense_block_count", 1),
            ("expert_count", 4),
            ("expert_used_count", 2),
            ("expert_feed_forward_length", 128),
            ("expert_shared_count", 1),
            ("expert_weights_norm", True),
            ("expert_weights_scale", 2.5),
            ("expert_gating_func", 2),
            ("nextn_predict_layers", 1),
        ),
        scales=(("blk.{il}.ffn_gate_inp.weight", 0.5), ("blk.{il}.exp_probs_b.bias", 1.0)),
    ),
)
