"""StableLM (2): llama.cpp src/models/stablelm.cpp.

LayerNorm with bias; NEOX partial rotary (rope.dimension_count < head size); optional q/k/v biases; optional
per-head q/k LayerNorm (one weight row per head); a SiLU gated MLP. When ffn_norm is absent the block is
parallel: x + attention(norm(x)) + mlp(norm(x)). The output is untied.
"""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_NORM_BIAS,
    ATTN_OUT,
    ATTN_QKV_BIAS,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    FFN_NORM,
    FFN_NORM_BIAS,
    OUTPUT_NORM,
    OUTPUT_NORM_BIAS,
    QK_NORM_HEAD_ROWS,
    TOKEN_EMBD,
    T,
    optional,
)
from alchemist.ir import Activation, NormKind, RopeStyle, Wiring

QK_NORM_PER_HEAD = optional(*QK_NORM_HEAD_ROWS)

FAMILY = Family(
    name="stablelm",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT_NORM_BIAS
    + (T("output.weight", "linear", "n_vocab", "n_embd"),)
    + ATTN_NORM
    + ATTN_NORM_BIAS
    + ATTN_QKV_SPLIT
    + optional(*ATTN_QKV_BIAS)
    + QK_NORM_PER_HEAD
    + ATTN_OUT
    + optional(*FFN_NORM, *FFN_NORM_BIAS)
    + FFN_GATED,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    norm=NormKind.LAYER,
    wiring_for=lambda hp, present: Wiring.SEQUENTIAL if "ffn_norm.weight" in present else Wiring.PARALLEL,
    # StableLM 2 1.6B: partial rotary (a quarter of each head), q/k/v biases, sequential; the 12B: parallel,
    # per-head q/k norms
    fixture=FixtureSpec(
        optional=tuple(t.name for t in ATTN_QKV_BIAS + FFN_NORM + FFN_NORM_BIAS),
        rope_dim=16,
        variants=(("parallel", FixtureSpec(optional=tuple(t.name for t in QK_NORM_PER_HEAD), rope_dim=16)),),
    ),
)
