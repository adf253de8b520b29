"""Gemma 3 (text): llama.cpp src/models/gemma3.cpp.

Quirks: embeddings scaled by sqrt(n_embd); sandwich norms (post_attention_norm, post_ffw_norm); q/k
RMSNorm before NEOX RoPE; GELU (tanh) gated MLP; sliding-window layers (il % pattern < pattern - 1)
using rope.freq_base_swa (default 10000); queries scaled by 1/sqrt(head_dim), except the 27B model
(62 layers) which uses 1/sqrt(n_embd / n_head). Norm weights are stored with Gemma's +1 already added,
so they multiply as stored. Output is tied to the token embedding unless output.weight exists.
"""

import math

from alchemist.arch.common import FamilyProfile
from alchemist.ir import Activation, RopeStyle


def _score_scale(hp, n_embd: int, n_head: int, head_dim: int) -> float:
    n_layer = hp.int("block_count")
    return 1.0 / math.sqrt(n_embd // n_head) if n_layer == 62 else 1.0 / math.sqrt(head_dim)


PROFILE = FamilyProfile(
    name="gemma3",
    rope_style=RopeStyle.NEOX,
    activation=Activation.GELU_TANH,
    embedding_scale_sqrt=True,
    qk_norm=True,
    sandwich_norms=True,
    sliding_window=True,
    default_swa_pattern=6,
    score_scale=_score_scale,
)
