"""GPT-2: llama.cpp src/models/gpt2.cpp.

Learned absolute position embeddings (position_embd, one row per position up to the training context) added
to the token embeddings; no RoPE; LayerNorm with bias; a fused [q | k | v] projection with bias; output
bias; a plain GELU MLP with biases. The output is tied unless output.weight exists.
"""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_NORM_BIAS,
    ATTN_OUT,
    ATTN_OUT_BIAS,
    ATTN_QKV_FUSED,
    ATTN_QKV_FUSED_BIAS,
    FFN_NORM,
    FFN_NORM_BIAS,
    FFN_PLAIN,
    FFN_PLAIN_BIAS,
    OUTPUT,
    OUTPUT_NORM,
    OUTPUT_NORM_BIAS,
    POSITION_EMBD,
    TOKEN_EMBD,
)
from alchemist.ir import Activation, NormKind, RopeStyle

FAMILY = Family(
    name="gpt2",
    tensors=TOKEN_EMBD
    + POSITION_EMBD
    + OUTPUT_NORM
    + OUTPUT_NORM_BIAS
    + OUTPUT
    + ATTN_NORM
    + ATTN_NORM_BIAS
    + ATTN_QKV_FUSED
    + ATTN_QKV_FUSED_BIAS
    + ATTN_OUT
    + ATTN_OUT_BIAS
    + FFN_NORM
    + FFN_NORM_BIAS
    + FFN_PLAIN
    + FFN_PLAIN_BIAS,
    rope=RopeStyle.NONE,
    activation=Activation.GELU_TANH,
    norm=NormKind.LAYER,
    fixture=FixtureSpec(),
)
