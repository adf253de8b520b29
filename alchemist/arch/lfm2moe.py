"""LFM2-MoE (Liquid): llama.cpp src/models/lfm2.cpp with lfm2moe.cpp's tensors.

LFM2's hybrid of attention and gated short-convolution layers (see alchemist.arch.lfm2), with a mixture of
experts in place of the MLP from layer leading_dense_block_count on: the router's scores by
expert_gating_func (sigmoid in the released models), the experts chosen by those scores plus a per-expert
selection bias (exp_probs_b), weighted by the unbiased scores renormalized to sum 1.
"""

import dataclasses

from alchemist.arch.family import ExpertRouting, FixtureSpec, gating_from_file, leading_dense_ffns
from alchemist.arch.lfm2 import FAMILY as LFM2
from alchemist.arch.table import FFN_EXP_PROBS_B, FFN_GATED, FFN_MOE, only_in_ffn

FAMILY = dataclasses.replace(
    LFM2,
    name="lfm2moe",
    tensors=tuple(t for t in LFM2.tensors if t not in FFN_GATED)
    + only_in_ffn("dense", *FFN_GATED)
    + only_in_ffn("moe", *FFN_MOE, *FFN_EXP_PROBS_B),
    layer_ffns=leading_dense_ffns,  # llama.cpp's is_moe_layer = il >= n_layer_dense_lead
    moe=ExpertRouting(
        gating_from=gating_from_file(),
        normalize=True,
        expert_width=lambda hp, n_used: hp.int("expert_feed_forward_length", minimum=1),
    ),
    # layers 0 and 3 convolve, 1 and 2 attend; layer 0 has the dense MLP, 1 to 3 the experts
    fixture=FixtureSpec(
        n_layer=4,
        metadata=(
            ("attention.head_count_kv", (0, 2, 2, 0)),
            ("shortconv.l_cache", 3),
            ("leading_dense_block_count", 1),
            ("expert_count", 4),
            ("expert_used_count", 2),
            ("expert_feed_forward_length", 128),
            ("expert_gating_func", 2),
        ),
        # router logits of spread ~1, where the sigmoid still separates the experts (saturated scores near 1 are
        # near-ties that llama.cpp's activation rounding flips), and a selection bias of the size of the scores'
        # spread, so that it changes which experts are chosen
        scales=(("blk.{il}.ffn_gate_inp.weight", 0.25), ("blk.{il}.exp_probs_b.bias", 2.0)),
    ),
)
