"""Gemma 2: llama.cpp src/models/gemma2.cpp.

Gemma with sandwich norms (post_attention_norm, post_ffw_norm), attention-logit softcapping
(attn_logit_softcapping, default 50) and final-logit softcapping (final_logit_softcapping, default 30),
queries pre-scaled by 1/sqrt(head_dim) (1/sqrt(n_embd / n_head) for the 27B model, 46 layers), and
sliding-window attention on even layers (pattern 2; window attention.sliding_window, default 4096) with
the same RoPE base unless rope.freq_base_swa says otherwise.
"""

import math

from alchemist.arch.family import Family, FixtureSpec, every_nth_dense
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_POST_NORM,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    FFN_NORM,
    FFN_POST_NORM,
    OUTPUT_NORM,
    TOKEN_EMBD,
)
from alchemist.ir import Activation, RopeStyle


def _score_scale(hp, head_dim: int) -> float:
    if hp.int("block_count") == 46:
        return 1.0 / math.sqrt(hp.int("embedding_length") // hp.int("attention.head_count"))
    return 1.0 / math.sqrt(head_dim)


FAMILY = Family(
    name="gemma2",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + ATTN_NORM
    + ATTN_QKV_SPLIT
    + ATTN_OUT
    + ATTN_POST_NORM
    + FFN_NORM
    + FFN_GATED
    + FFN_POST_NORM,
    rope=RopeStyle.NEOX,
    activation=Activation.GELU_TANH,
    score_scale=_score_scale,
    embedding_scale=lambda hp: math.sqrt(hp.int("embedding_length")),
    attn_softcap=lambda hp: hp.float("attn_logit_softcapping", default=50.0, positive=True),
    final_softcap=lambda hp: hp.float("final_logit_softcapping", default=30.0, positive=True),
    sliding_layers=every_nth_dense(2),
    default_window=4096,
    swa_rope=lambda hp, base, scale: (hp.float("rope.freq_base_swa", default=base, positive=True), scale),
    fixture=FixtureSpec(
        vocab="spm",
        metadata=(("attention.sliding_window", 8), ("attn_logit_softcapping", 5.0), ("final_logit_softcapping", 8.0)),
        embedding_std=0.05,
    ),
)
