"""Falcon-H1: llama.cpp src/models/falcon-h1.cpp (LLM_ARCH_FALCON_H1).

Every layer mixes tokens with attention and Mamba-2 side by side: both read the same RMS-normed input, and the
residual stream takes the sum of their outputs; then a pre-norm gated SiLU MLP (optional biases). Attention is
llama's with NEOX RoPE; the Mamba-2 mixer is granitehybrid's component (conv bias and group norm optional, as
llama.cpp loads them). Falcon-H1's µP multipliers are folded into the weights by the converter, so the file
carries none. Every layer keeps a KV cache and a Mamba-2 state.
"""

from dataclasses import replace

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_OUT_BIAS,
    ATTN_QKV_BIAS,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    FFN_GATED_BIAS,
    OUTPUT,
    OUTPUT_NORM,
    ROPE_FREQS,
    SSM_MAMBA2,
    TOKEN_EMBD,
    T,
    optional,
)
from alchemist.ir import Activation, RopeStyle

# the pre-FFN norm, which llama.cpp loads without the .weight suffix (tn(LLM_TENSOR_FFN_NORM, i))
FFN_NORM_BARE = (T("blk.{il}.ffn_norm", "norm", "n_embd"),)

# Mamba-2 in every layer (its tensors untagged by mixer); the conv bias and the group norm optional
SSM_EVERY_LAYER = tuple(
    replace(s, mixer=None, required=s.required and s.suffix not in ("ssm_conv1d.bias", "ssm_norm.weight"))
    for s in SSM_MAMBA2
)

FAMILY = Family(
    name="falcon-h1",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT
    + ROPE_FREQS
    + ATTN_NORM
    + ATTN_QKV_SPLIT
    + optional(*ATTN_QKV_BIAS, *ATTN_OUT_BIAS)
    + ATTN_OUT
    + SSM_EVERY_LAYER
    + FFN_NORM_BARE
    + FFN_GATED
    + optional(*FFN_GATED_BIAS),
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    parallel_ssm=True,
    ffn_norm="ffn_norm",
    # llama.cpp names the attention output after RoPE Qcur-post-rope (its Qcur is before RoPE)
    tap_names=(("Qcur", "Qcur-post-rope"), ("Kcur", "Kcur-post-rope"), ("Vcur", "Vcur-post-rope")),
    # Mamba-2 beside attention: 4 heads of 64 in 2 groups, state 16 (inner 256 = n_embd, as Falcon-H1's 0.5B
    # has inner = n_embd)
    fixture=FixtureSpec(
        metadata=(
            ("ssm.conv_kernel", 4),
            ("ssm.inner_size", 256),
            ("ssm.state_size", 16),
            ("ssm.time_step_rank", 4),
            ("ssm.group_count", 2),
        ),
        optional=("output.weight", "blk.{il}.ssm_conv1d.bias", "blk.{il}.ssm_norm.weight"),
    ),
)
