"""Qwen3 (dense): llama.cpp src/models/qwen3.cpp. No biases; RMSNorm over each q/k head before NEOX RoPE."""

from alchemist.arch.common import FamilyProfile
from alchemist.ir import Activation, RopeStyle

PROFILE = FamilyProfile(
    name="qwen3",
    rope_style=RopeStyle.NEOX,
    activation=Activation.SILU,
    qk_norm=True,
)
