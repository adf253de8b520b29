"""Granite (3.x dense): llama.cpp src/models/granite.cpp.

Llama (NORM RoPE, SiLU gated MLP) with four scales from metadata: token embeddings times
`embedding_scale`, each residual branch times `residual_scale`, q·k times `attention.scale`, and the logits
divided by `logit_scale` (required). Optional attn_output and MLP biases, optional rope_freqs.
"""

from alchemist.arch.family import Family, FixtureSpec, attention_scale_key
from alchemist.arch.table import ATTN_OUT_BIAS, FFN_GATED_BIAS, LLAMA, ROPE_FREQS, optional
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="granite",
    tensors=LLAMA + ROPE_FREQS + optional(*ATTN_OUT_BIAS, *FFN_GATED_BIAS),
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    score_scale=attention_scale_key,
    # llama.cpp applies each scale only when it is non-zero
    embedding_scale=lambda hp: hp.float("embedding_scale", default=0.0) or 1.0,
    residual_scale=lambda hp: hp.float("residual_scale", default=0.0) or 1.0,
    logit_scale=lambda hp: 1.0 / hp.float("logit_scale", positive=True),
    # rope.scaling.finetuned (default true) switches RoPE on or off in every layer
    rope_on_layer=lambda hp, il, sliding: hp.bool("rope.scaling.finetuned", default=True),
    rope_scalings=("none", "linear", "llama3", "yarn"),
    fixture=FixtureSpec(
        metadata=(("embedding_scale", 2.0), ("residual_scale", 0.5), ("attention.scale", 0.1), ("logit_scale", 4.0)),
        optional=("output.weight", "blk.{il}.attn_output.bias"),
    ),
)
