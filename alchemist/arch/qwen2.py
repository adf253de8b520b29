"""Qwen2 / Qwen2.5: llama.cpp src/models/qwen2.cpp. Llama with q/k/v biases and NEOX RoPE."""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import ATTN_QKV_BIAS, LLAMA
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="qwen2",
    tensors=LLAMA + ATTN_QKV_BIAS,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    fixture=FixtureSpec(
        optional=("output.weight",),
        variants=(
            # YaRN with a short original context, so the 64-token tests reach the interpolated frequencies
            (
                "yarn",
                FixtureSpec(
                    optional=("output.weight",),
                    metadata=(
                        ("rope.scaling.type", "yarn"),
                        ("rope.scaling.factor", 4.0),
                        ("rope.scaling.original_context_length", 32),
                    ),
                ),
            ),
        ),
    ),
)
