"""Qwen3.5 / Qwen3.6 dense (qwen35): llama.cpp src/models/qwen35.cpp.

A hybrid of gated delta-net layers and gated attention layers: every full_attention_interval-th layer (default 4)
attends, the others mix tokens with a gated delta-net (delta-net-base.cpp: a causal convolution over [q | k | v]
with SiLU, q and k L2-normed, a state per v head that decays by exp(softplus(alpha + dt_b) · A) and is corrected
by the delta rule at rate sigmoid(beta), the output RMS-normed per head and gated by silu(z)). The attention
layers' q projection gives each head's queries and a gate (output times sigmoid(gate)), with per-head q/k RMS
norms and partial NEOX-paired RoPE (llama.cpp's multi-section RoPE, which for text positions rotates as NEOX).
post_attention_norm is the pre-FFN norm; the FFN is a SiLU gated MLP. The last nextn_predict_layers blocks are
multi-token-prediction layers, loaded and never applied (as llama.cpp does).
"""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_POST_NORM,
    ATTN_Q_GATED,
    ATTN_QKV_SPLIT,
    DELTANET,
    FFN_GATED,
    NEXTN,
    OUTPUT,
    OUTPUT_NORM,
    QK_NORM_HEAD,
    TOKEN_EMBD,
    only_in,
)
from alchemist.ir import Activation, RopeStyle


def layer_mixers(hp, n_layer: int) -> list[str]:
    """llama.cpp's is_recr(il): layer il attends when (il + 1) % full_attention_interval == 0; the
    multi-token-prediction layers past the main ones attend."""
    interval = hp.int("full_attention_interval", default=4, minimum=1)
    n_main = n_layer - hp.int("nextn_predict_layers", default=0)
    return ["deltanet" if il < n_main and (il + 1) % interval else "attention" for il in range(n_layer)]


# what Qwen3.5's dense and MoE files share: the mixers (delta-net or gated attention) and the post-attention norm
MIXERS = (
    TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT
    + ATTN_NORM
    + only_in("attention", *ATTN_Q_GATED, *ATTN_QKV_SPLIT[1:], *QK_NORM_HEAD, *ATTN_OUT)
    + DELTANET
    + ATTN_POST_NORM
)
# a fixture's delta-net: layers 0-2 delta-net, 3 attends (interval 4); 2 k heads tiled over 4 v heads of 64
DELTANET_FIXTURE = (
    ("full_attention_interval", 4),
    ("ssm.conv_kernel", 4),
    ("ssm.inner_size", 256),
    ("ssm.state_size", 64),
    ("ssm.time_step_rank", 4),
    ("ssm.group_count", 2),
    ("rope.dimension_sections", (6, 5, 5, 0)),
)

FAMILY = Family(
    name="qwen35",
    tensors=MIXERS + FFN_GATED + NEXTN,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    layer_mixers=layer_mixers,
    gated_attention=True,
    ffn_norm="post_attention_norm.weight",
    mtp_layers=lambda hp: hp.int("nextn_predict_layers", default=0),
    # qwen35.cpp's names for the first residual sum and the pre-FFN norm's output
    tap_names=(("ffn_inp", "attn_residual"), ("ffn_norm", "attn_post_norm")),
    fixture=FixtureSpec(n_layer=4, rope_dim=32, metadata=DELTANET_FIXTURE),
)
