"""Llama family (Llama 2/3, Mistral, SmolLM2, TinyLlama): llama.cpp src/models/llama.cpp.

RoPE is NORM (adjacent pairs) because convert_hf_to_gguf permutes the Q/K rows; llama3 files may carry
`rope_freqs.weight` (per-frequency divisors). The output projection is tied when `output.weight` is absent.
"""

from alchemist.arch.common import FamilyProfile
from alchemist.ir import Activation, RopeStyle

PROFILE = FamilyProfile(
    name="llama",
    rope_style=RopeStyle.NORM,
    activation=Activation.SILU,
    optional_layer_tensors=("attn_q.bias", "attn_output.bias", "ffn_up.bias"),
)
