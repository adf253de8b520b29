"""EXAONE 4: llama.cpp src/models/exaone4.cpp.

Post-norm blocks like OLMo 2 (post_attention_norm, post_ffw_norm, no pre-norms), RMSNorm over each q/k head
before NEOX RoPE, SiLU gated MLP, optional llama3-style rope_freqs; the output is tied unless output.weight
exists. Only the 64-layer (32B) model slides: three of every four layers (pattern 4), which alone apply
RoPE; every layer of the smaller models applies RoPE over the whole context.
"""

from alchemist.arch.family import Family, FixtureSpec, every_nth_dense
from alchemist.arch.table import (
    ATTN_OUT,
    ATTN_POST_NORM,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    FFN_POST_NORM,
    OUTPUT,
    OUTPUT_NORM,
    QK_NORM_HEAD,
    ROPE_FREQS,
    TOKEN_EMBD,
)
from alchemist.ir import Activation, RopeStyle


def _sliding_layers(hp, n_layer: int) -> list[bool]:
    if n_layer != 64:
        return [False] * n_layer
    return every_nth_dense(4)(hp, n_layer)


FAMILY = Family(
    name="exaone4",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT
    + ROPE_FREQS
    + ATTN_QKV_SPLIT
    + QK_NORM_HEAD
    + ATTN_OUT
    + ATTN_POST_NORM
    + FFN_GATED
    + FFN_POST_NORM,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    sliding_layers=_sliding_layers,
    # with sliding layers, only they rotate (llama.cpp: use_rope = is_swa(il) || no sliding window at all)
    rope_on_layer=lambda hp, il, sliding: sliding or hp.int("block_count") != 64,
    rope_scalings=("none", "linear", "llama3", "yarn"),
    fixture=FixtureSpec(optional=("output.weight",)),
)
