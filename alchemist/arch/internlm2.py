"""InternLM2: llama.cpp src/models/internlm2.cpp. Llama with NORM RoPE and an untied output (the converter
splits InternLM2's fused wqkv into attn_q/k/v)."""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import ATTN_NORM, ATTN_OUT, ATTN_QKV_SPLIT, FFN_GATED, FFN_NORM, OUTPUT_NORM, TOKEN_EMBD, T
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="internlm2",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + (T("output.weight", "linear", "n_vocab", "n_embd"),)
    + ATTN_NORM
    + ATTN_QKV_SPLIT
    + ATTN_OUT
    + FFN_NORM
    + FFN_GATED,
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    fixture=FixtureSpec(),
)
