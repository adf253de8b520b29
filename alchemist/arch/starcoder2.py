"""StarCoder2: llama.cpp src/models/starcoder2.cpp.

LayerNorm with bias (attn, ffn, output); q/k/v/o biases; NEOX RoPE; a plain GELU MLP with biases
(up -> gelu -> down, LLM_FFN_SEQ). The output is tied unless output.weight exists.
"""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_NORM_BIAS,
    ATTN_OUT,
    ATTN_OUT_BIAS,
    ATTN_QKV_BIAS,
    ATTN_QKV_SPLIT,
    FFN_NORM,
    FFN_NORM_BIAS,
    FFN_PLAIN,
    FFN_PLAIN_BIAS,
    OUTPUT,
    OUTPUT_NORM,
    OUTPUT_NORM_BIAS,
    TOKEN_EMBD,
    optional,
)
from alchemist.ir import Activation, NormKind, RopeStyle

FAMILY = Family(
    name="starcoder2",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT_NORM_BIAS
    + OUTPUT
    + ATTN_NORM
    + ATTN_NORM_BIAS
    + ATTN_QKV_SPLIT
    + optional(*ATTN_QKV_BIAS)
    + ATTN_OUT
    + ATTN_OUT_BIAS
    + FFN_NORM
    + FFN_NORM_BIAS
    + FFN_PLAIN
    + FFN_PLAIN_BIAS,
    rope=RopeStyle.NEOX,
    activation=Activation.GELU_TANH,
    norm=NormKind.LAYER,
    fixture=FixtureSpec(optional=tuple(t.name for t in ATTN_QKV_BIAS) + ("output.weight",)),
)
