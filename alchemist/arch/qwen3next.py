"""Qwen3-Next (qwen3next): llama.cpp src/models/qwen3next.cpp.

Qwen3.5-MoE's hybrid (alchemist/arch/qwen35.py, qwen35moe.py) as it first shipped: the delta-net's rates beta and
alpha come from one fused projection, per k head [beta of its v heads | alpha of its v heads] (ssm_ba), and each
v head reads k head h // (v heads / k heads) (a repeat-interleave, where Qwen3.5 tiles). [q | k | v] and z are
two projections (attn_qkv, attn_gate), or in older files one fused per k head (ssm_in: [q | k | v of its v heads
| z of its v heads]). Every layer's FFN is a mixture of experts (softmax, renormalized, times
expert_weights_scale when set) with a shared expert gated per token.
"""

from dataclasses import replace

from alchemist.arch.family import ExpertRouting, FixtureSpec
from alchemist.arch.qwen35 import DELTANET_FIXTURE
from alchemist.arch.qwen35moe import FAMILY as QWEN35MOE
from alchemist.arch.table import DELTANET, DELTANET_FUSED_RATES
from alchemist.ir import Gating

SHARED_EXPERT = (
    "blk.{il}.ffn_gate_shexp.weight",
    "blk.{il}.ffn_up_shexp.weight",
    "blk.{il}.ffn_down_shexp.weight",
    "blk.{il}.ffn_gate_inp_shexp.weight",
)
EXPERTS = (
    ("expert_count", 4),
    ("expert_used_count", 2),
    ("expert_feed_forward_length", 256),
    ("expert_shared_feed_forward_length", 256),
)

FAMILY = replace(
    QWEN35MOE,
    name="qwen3next",
    tensors=tuple(spec for spec in QWEN35MOE.tensors if spec not in DELTANET) + DELTANET_FUSED_RATES,
    delta_k_heads_tiled=False,
    moe=ExpertRouting(
        gating=Gating.SOFTMAX,
        normalize=True,
        weight_scale=lambda hp: hp.float("expert_weights_scale", default=0.0) or 1.0,
        expert_width=lambda hp, n_used: hp.int("expert_feed_forward_length", default=0)
        or hp.int("feed_forward_length") // n_used,
        shared_width=lambda hp, n_ff_exp: hp.int("expert_shared_feed_forward_length", default=0) or n_ff_exp,
    ),
    fixture=FixtureSpec(
        n_layer=4,
        rope_dim=32,
        optional=SHARED_EXPERT + ("blk.{il}.attn_qkv.weight", "blk.{il}.attn_gate.weight"),
        metadata=(*DELTANET_FIXTURE, *EXPERTS),
        variants=(
            # the older files' fused [q | k | v | z] per k head
            (
                "fused",
                FixtureSpec(
                    n_layer=4,
                    rope_dim=32,
                    optional=SHARED_EXPERT + ("blk.{il}.ssm_in.weight",),
                    metadata=(*DELTANET_FIXTURE, *EXPERTS),
                ),
            ),
        ),
    ),
)
