"""Llama 4 (Scout, Maverick; MobileLLM-style dense files): llama.cpp src/models/llama4.cpp.

Llama's block (NORM RoPE with llama3 frequency factors when the file has them) with four changes. Every
`interleave_moe_layer_step`-th layer has a mixture of experts instead of the dense MLP: sigmoid scores, one
expert per token whose input (not output) the score multiplies, no renormalization, and a shared expert of the
expert width. One layer in four skips RoPE (n_no_rope_layer_step = 4); those layers attend to the whole
context and scale their queries by Llama 4's temperature (log(floor((p + 1) / 8192) + 1) · 0.1 + 1), the
others attend within chunks of 8192 positions and RMS-normalize q and k without a weight after RoPE (except
on the 128-expert model, whose attention has no such norm). A file with attention.sliding_window = 0 has
neither chunks nor temperature, and RoPE on all layers but the last.
"""

from alchemist.arch.family import ExpertRouting, Family, FixtureSpec, attention_scale_key
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    FFN_MOE,
    FFN_NORM,
    FFN_SHEXP,
    OUTPUT,
    OUTPUT_NORM,
    ROPE_FREQS,
    TOKEN_EMBD,
    only_in_ffn,
)
from alchemist.ir import Activation, AttentionTemperature, Gating, RopeStyle

CHUNK = 8192  # llama.cpp's n_swa for Llama 4's chunked layers, and its temperature's floor scale


def _chunked(hp) -> bool:
    """llama4.cpp: an attention.sliding_window of 0 turns the chunks (and the temperature) off."""
    return hp.int("attention.sliding_window", default=CHUNK) != 0


def _no_rope_step(hp, n_layer: int) -> int:
    return 4 if _chunked(hp) else n_layer


FAMILY = Family(
    name="llama4",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT
    + ROPE_FREQS
    + ATTN_NORM
    + ATTN_QKV_SPLIT
    + ATTN_OUT
    + FFN_NORM
    + only_in_ffn("dense", *FFN_GATED)
    + only_in_ffn("moe", *FFN_MOE, *FFN_SHEXP),
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    score_scale=attention_scale_key,
    # llama4.cpp names the attention output "ffn_norm" in its expert layers (cb(cur, ...) before cur is the norm):
    # the pre-FFN norm's output goes under a name llama.cpp does not use, so it is never compared with that
    tap_names=(("ffn_norm", "ffn_inp_normed"),),
    rope_scalings=("none", "linear", "llama3", "yarn"),
    rope_on_layer=lambda hp, il, sliding: (il + 1) % _no_rope_step(hp, hp.int("block_count")) != 0,
    # the chunked layers: 3 of every 4, the ones that rotate (llama.cpp's swa pattern 4)
    sliding_layers=lambda hp, n_layer: [_chunked(hp) and il % 4 < 3 for il in range(n_layer)],
    attention_chunk=lambda hp: CHUNK if _chunked(hp) else 0,
    attn_temperature=lambda hp: (
        AttentionTemperature(scale=0.1, length=CHUNK, offset=1.0, unrotated_only=True) if _chunked(hp) else None
    ),
    rotated_qk_norm=lambda hp: hp.int("expert_count", default=0) != 128,
    layer_ffns=lambda hp, n_layer: [
        "moe" if (il + 1) % max(hp.int("interleave_moe_layer_step", minimum=1), 1) == 0 else "dense"
        for il in range(n_layer)
    ],
    moe=ExpertRouting(
        gating=Gating.SIGMOID,
        normalize=False,
        weight_inputs=True,
        expert_width=lambda hp, n_used: hp.int("expert_feed_forward_length", minimum=1),
    ),
    # layers 1 and 3 route (step 2); layer 3 has no RoPE (the temperature's layer)
    fixture=FixtureSpec(
        n_layer=4,
        optional=("output.weight",),
        metadata=(
            ("expert_count", 4),
            ("expert_used_count", 1),
            ("expert_feed_forward_length", 128),
            ("interleave_moe_layer_step", 2),
        ),
    ),
)
