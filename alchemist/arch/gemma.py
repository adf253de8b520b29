"""Gemma (1): llama.cpp src/models/gemma.cpp.

Embeddings scaled by sqrt(n_embd); RMSNorm weights stored with Gemma's +1 already added; GELU (tanh) gated
MLP; NEOX RoPE; queries scaled by 1/sqrt(head_dim); the output is always the token embedding.
"""

import math

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import ATTN_NORM, ATTN_OUT, ATTN_QKV_SPLIT, FFN_GATED, FFN_NORM, OUTPUT_NORM, TOKEN_EMBD
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="gemma",
    tensors=TOKEN_EMBD + OUTPUT_NORM + ATTN_NORM + ATTN_QKV_SPLIT + ATTN_OUT + FFN_NORM + FFN_GATED,
    rope=RopeStyle.NEOX,
    activation=Activation.GELU_TANH,
    embedding_scale=lambda hp: math.sqrt(hp.int("embedding_length")),
    fixture=FixtureSpec(vocab="spm", embedding_std=0.05),
)
