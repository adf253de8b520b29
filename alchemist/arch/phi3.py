"""Phi-3 / Phi-3.5 / Phi-4-mini: llama.cpp src/models/phi3.cpp.

A fused [q | k | v] projection, a fused [gate | up] projection (SwiGLU: silu of the first half times the
second), NEOX RoPE over `rope.dimension_count` dims, RMSNorm, and LongRoPE (`rope.scaling.type` longrope):
each frequency divided by rope_factors_long when the context exceeds
rope.scaling.original_context_length, else by rope_factors_short, with cos and sin times
rope.scaling.attn_factor. Queries are scaled by 1/sqrt(head_dim) after RoPE (llama.cpp names the scaled
ones Qcur); llama.cpp disables Phi's sliding window. The output is tied unless output.weight exists.
"""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_QKV_FUSED,
    FFN_FUSED_GATED,
    FFN_NORM,
    OUTPUT,
    OUTPUT_NORM,
    ROPE_FACTORS,
    TOKEN_EMBD,
)
from alchemist.ir import Activation, RopeStyle

LONGROPE = (("rope.scaling.type", "longrope"), ("rope.scaling.attn_factor", 1.2))
FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")

FAMILY = Family(
    name="phi3",
    tensors=TOKEN_EMBD + OUTPUT_NORM + OUTPUT + ROPE_FACTORS + ATTN_NORM + ATTN_QKV_FUSED + ATTN_OUT + FFN_NORM + FFN_FUSED_GATED,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    rope_scalings=("none", "linear", "longrope"),
    prescale_queries=True,
    # LongRoPE with a 32-position original context, so the 64-position tests use the long factors; the
    # variant keeps the training context and uses the short ones. Partial rotary, as in Phi-4-mini.
    fixture=FixtureSpec(
        optional=("output.weight", *FACTORS),
        metadata=(*LONGROPE, ("rope.scaling.original_context_length", 32)),
        rope_dim=48,
        variants=(("short", FixtureSpec(optional=FACTORS, metadata=LONGROPE, rope_dim=48)),),
    ),
)
