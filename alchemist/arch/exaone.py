"""EXAONE 3: llama.cpp src/models/exaone.cpp. Llama with NEOX RoPE and optional llama3-style
`rope_freqs.weight`; the output is tied unless output.weight exists."""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import LLAMA, ROPE_FREQS
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="exaone",
    tensors=LLAMA + ROPE_FREQS,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    rope_scalings=("none", "linear", "llama3", "yarn"),
    fixture=FixtureSpec(optional=("output.weight", "rope_freqs.weight")),
)
