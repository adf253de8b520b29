"""Qwen2 / Qwen2.5: llama.cpp src/models/qwen2.cpp. Llama-like, with q/k/v biases and NEOX RoPE."""

from alchemist.arch.common import FamilyProfile
from alchemist.ir import Activation, RopeStyle

PROFILE = FamilyProfile(
    name="qwen2",
    rope_style=RopeStyle.NEOX,
    activation=Activation.SILU,
    optional_layer_tensors=("attn_q.bias",),
)
