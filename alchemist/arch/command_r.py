"""Command-R: llama.cpp src/models/command-r.cpp.

A parallel block (x + attention(norm(x)) + mlp(norm(x))) with LayerNorm without bias, NORM RoPE, a SiLU gated
MLP, per-head q/k LayerNorm (one weight row per head, in the 64+-layer models), logits times `logit_scale`
(when set) and the output always tied to the token embedding.
"""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    OUTPUT_NORM,
    QK_NORM_HEAD_ROWS,
    TOKEN_EMBD,
    optional,
)
from alchemist.ir import Activation, NormKind, RopeStyle, Wiring

QK_NORM_PER_HEAD = optional(*QK_NORM_HEAD_ROWS)

FAMILY = Family(
    name="command-r",
    tensors=TOKEN_EMBD + OUTPUT_NORM + ATTN_NORM + ATTN_QKV_SPLIT + QK_NORM_PER_HEAD + ATTN_OUT + FFN_GATED,
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    norm=NormKind.LAYER,
    wiring=Wiring.PARALLEL,
    logit_scale=lambda hp: hp.float("logit_scale", default=0.0) or 1.0,
    # llama.cpp creates the q/k norms only for 64+ layers, too many for a fixture; the same per-head
    # LayerNorm component is validated on stablelm:parallel
    fixture=FixtureSpec(metadata=(("logit_scale", 0.5),)),
)
