"""Llama (Llama 2/3, Mistral, SmolLM2, TinyLlama): llama.cpp src/models/llama.cpp.

RoPE is NORM (adjacent pairs) because convert_hf_to_gguf permutes the Q/K rows; llama3 files may carry
`rope_freqs.weight` (per-frequency divisors). Biases are optional; the output is tied to the token
embedding when `output.weight` is absent.
"""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import ATTN_OUT_BIAS, ATTN_QKV_BIAS, FFN_GATED_BIAS, LLAMA, ROPE_FREQS, optional
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="llama",
    tensors=LLAMA + ROPE_FREQS + optional(*ATTN_QKV_BIAS, *ATTN_OUT_BIAS, *FFN_GATED_BIAS),
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    rope_scalings=("none", "linear", "llama3", "yarn"),
    fixture=FixtureSpec(
        vocab="spm",
        variants=(
            # llama3: per-frequency divisors in rope_freqs.weight
            ("llama3", FixtureSpec(vocab="spm", optional=("rope_freqs.weight",))),
            ("linear", FixtureSpec(vocab="spm", metadata=(("rope.scaling.type", "linear"), ("rope.scaling.factor", 4.0)))),
        ),
    ),
)
