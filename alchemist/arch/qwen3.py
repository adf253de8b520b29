"""Qwen3 (dense): llama.cpp src/models/qwen3.cpp. No biases; RMSNorm over each q/k head before NEOX RoPE."""

from alchemist.arch.family import Family, FixtureSpec, SnapshotSpec
from alchemist.arch.table import LLAMA, QK_NORM_HEAD
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="qwen3",
    tensors=LLAMA + QK_NORM_HEAD,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    fixture=FixtureSpec(optional=("output.weight",)),
    snapshot=SnapshotSpec(model_types=("qwen3",)),
)
