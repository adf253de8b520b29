"""Gemma 3 (text): llama.cpp src/models/gemma3.cpp.

Embeddings scaled by sqrt(n_embd); sandwich norms (post_attention_norm, post_ffw_norm); q/k RMSNorm before
NEOX RoPE; GELU (tanh) gated MLP; sliding-window layers (il % pattern < pattern - 1, pattern 6 by default)
with their own RoPE base rope.freq_base_swa (default 10000); queries scaled by 1/sqrt(head_dim), except the
27B model (62 layers), which uses 1/sqrt(n_embd / n_head). Norm weights are stored with Gemma's +1 already
added, so they multiply as stored. The output is tied unless output.weight exists.
"""

import math

from alchemist.arch.family import Family, FixtureSpec, SnapshotSpec, every_nth_dense
from alchemist.arch.table import ATTN_POST_NORM, FFN_POST_NORM, LLAMA, QK_NORM_HEAD
from alchemist.ir import Activation, RopeStyle


def _score_scale(hp, head_dim: int) -> float:
    if hp.int("block_count") == 62:
        return 1.0 / math.sqrt(hp.int("embedding_length") // hp.int("attention.head_count"))
    return 1.0 / math.sqrt(head_dim)


FAMILY = Family(
    name="gemma3",
    tensors=LLAMA + QK_NORM_HEAD + ATTN_POST_NORM + FFN_POST_NORM,
    rope=RopeStyle.NEOX,
    activation=Activation.GELU_TANH,
    score_scale=_score_scale,
    embedding_scale=lambda hp: math.sqrt(hp.int("embedding_length")),
    final_softcap=lambda hp: hp.float("final_logit_softcapping", default=0.0),
    sliding_layers=every_nth_dense(6),
    # small window and pattern 2 (layer 0 slides, layer 1 is global), so short tests cross the window
    fixture=FixtureSpec(
        vocab="spm",
        metadata=(("attention.sliding_window", 8), ("attention.sliding_window_pattern", 2)),
        embedding_std=0.05,
    ),
    # llama.cpp's llama_model::get_rope_freq_base/scale for a sliding layer: its own base, no scaling
    swa_rope=lambda hp, base, scale: (hp.float("rope.freq_base_swa", default=10000.0, positive=True), 1.0),
    # the pattern is read from config.json (the converter leaves it to llama.cpp's default, 6, as real files have)
    snapshot=SnapshotSpec(
        model_types=("gemma3_text",),
        config=(
            ("sliding_window", "attention.sliding_window"),
            ("sliding_window_pattern", "attention.sliding_window_pattern"),
            ("rope_local_base_freq", "rope.freq_base_swa"),
            ("final_logit_softcapping", "final_logit_softcapping"),
        ),
        norm_plus_one=True,
    ),
)
