"""Qwen2 / Qwen2.5: llama.cpp src/models/qwen2.cpp. Llama with q/k/v biases and NEOX RoPE."""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import ATTN_QKV_BIAS, LLAMA
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="qwen2",
    tensors=LLAMA + ATTN_QKV_BIAS,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    fixture=FixtureSpec(optional=("output.weight",)),
)
