"""Cohere2 (Command R7B, Command A): llama.cpp src/models/cohere2.cpp.

Command-R's parallel block (LayerNorm without bias, SiLU gated MLP, tied output, logits times the required
`logit_scale`) with sliding-window attention on three of every four layers (pattern 4; window
attention.sliding_window, required), and NORM RoPE only on the sliding layers (the global ones use no
position encoding), at the global base and scale.
"""

from alchemist.arch.family import Family, FixtureSpec, every_nth_dense
from alchemist.arch.table import ATTN_NORM, ATTN_OUT, ATTN_QKV_SPLIT, FFN_GATED, OUTPUT_NORM, TOKEN_EMBD
from alchemist.ir import Activation, NormKind, RopeStyle, Wiring

FAMILY = Family(
    name="cohere2",
    tensors=TOKEN_EMBD + OUTPUT_NORM + ATTN_NORM + ATTN_QKV_SPLIT + ATTN_OUT + FFN_GATED,
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    norm=NormKind.LAYER,
    wiring=Wiring.PARALLEL,
    logit_scale=lambda hp: hp.float("logit_scale"),
    sliding_layers=every_nth_dense(4),
    rope_on_layer=lambda hp, il, sliding: sliding,
    # 4 layers (three sliding with RoPE, one global without), a window short tests cross
    fixture=FixtureSpec(n_layer=4, metadata=(("attention.sliding_window", 8), ("logit_scale", 0.5))),
)
