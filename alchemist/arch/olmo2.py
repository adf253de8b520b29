"""OLMo 2 (and OLMo 3's sliding-window variant): llama.cpp src/models/olmo2.cpp.

Post-norm only: x + post_attention_norm(attention(x)), then x + post_ffw_norm(mlp(x)) (no norm before either
branch); RMSNorm over the whole q and k projections (not per head) before NEOX RoPE; SiLU gated MLP;
untied output. With attention.sliding_window > 0, three of every four layers slide (pattern 4); they rotate
at the global base without the model's RoPE scaling (rope.freq_base_swa is not read).
"""

from alchemist.arch.family import Family, FixtureSpec, every_nth_dense
from alchemist.arch.table import (
    ATTN_OUT,
    ATTN_POST_NORM,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    FFN_POST_NORM,
    OUTPUT_NORM,
    QK_NORM_FULL,
    TOKEN_EMBD,
    T,
)
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="olmo2",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + (T("output.weight", "linear", "n_vocab", "n_embd"),)
    + ATTN_QKV_SPLIT
    + QK_NORM_FULL
    + ATTN_OUT
    + ATTN_POST_NORM
    + FFN_GATED
    + FFN_POST_NORM,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    sliding_layers=every_nth_dense(4),
    # the sliding layers rotate at the global base without the model's RoPE scaling (olmo2.cpp)
    swa_rope=lambda hp, base, scale: (base, 1.0),
    swa_plain_rope=True,
    fixture=FixtureSpec(
        variants=(("swa", FixtureSpec(n_layer=4, metadata=(("attention.sliding_window", 8),))),),
    ),
)
