"""Qwen3.5 / Qwen3.6 MoE (qwen35moe): llama.cpp src/models/qwen35moe.cpp.

Qwen3.5's hybrid of gated delta-net and gated attention layers (alchemist/arch/qwen35.py) with a mixture of
experts as every layer's FFN: softmax over the experts, the top expert_used_count renormalized, each expert a
SiLU gated MLP of expert_feed_forward_length, plus a shared expert of expert_shared_feed_forward_length whose
output is gated per token by sigmoid(x · ffn_gate_inp_shexp).
"""

from dataclasses import replace

from alchemist.arch.family import ExpertRouting
from alchemist.arch.qwen35 import DELTANET_FIXTURE, FAMILY as QWEN35, MIXERS
from alchemist.arch.table import FFN_MOE, FFN_SHEXP, FFN_SHEXP_GATE, NEXTN, optional
from alchemist.arch.family import FixtureSpec
from alchemist.ir import Gating

FAMILY = replace(
    QWEN35,
    name="qwen35moe",
    tensors=MIXERS + FFN_MOE + optional(*FFN_SHEXP, *FFN_SHEXP_GATE) + NEXTN,
    moe=ExpertRouting(
        gating=Gating.SOFTMAX,
        normalize=True,
        expert_width=lambda hp, n_used: hp.int("expert_feed_forward_length", minimum=1),
        shared_width=lambda hp, n_ff_exp: hp.int("expert_shared_feed_forward_length", default=0),
    ),
    fixture=FixtureSpec(
        n_layer=4,
        rope_dim=32,
        optional=(
            "blk.{il}.ffn_gate_shexp.weight",
            "blk.{il}.ffn_up_shexp.weight",
            "blk.{il}.ffn_down_shexp.weight",
            "blk.{il}.ffn_gate_inp_shexp.weight",
        ),
        metadata=(
            *DELTANET_FIXTURE,
            ("expert_count", 4),
            ("expert_used_count", 2),
            ("expert_feed_forward_length", 256),
            ("expert_shared_feed_forward_length", 256),
        ),
    ),
)
