"""DeepSeek-V2 / V3 / R1 and their lineage (Kimi K2, GigaChat3, ...): llama.cpp src/models/deepseek2.cpp
(LLM_ARCH_DEEPSEEK2), in the absorbed multi-head latent attention form that current GGUF files carry.

Llama's pre-norm block with multi-head latent attention (LatentAttentionSpec): queries through a low rank
(attn_q_a, its RMS norm, attn_q_b; attn_q directly when attention.q_lora_rank is 0, the "lite" models), split
per head into a part without RoPE and a NORM-rotated part; keys and values compressed per position into one
cached row [latent (kv_lora_rank, RMS-normed) | k_pe (rotated)]; each head's scores through its attn_k_b, its
output through its attn_v_b. The scores are scaled by 1/sqrt(key_length_mla), the head size before absorption.
The first leading_dense_block_count layers have a dense SiLU MLP, the others a mixture of experts: softmax (V2)
or sigmoid (V3, expert_gating_func) scores, chosen with the selection bias exp_probs_b where the file has one,
within the expert_group_used_count best of expert_group_count groups (a group's score: its two best), weighted
by the unbiased scores, renormalized when expert_weights_norm and scaled by expert_weights_scale, plus a shared
expert of expert_shared_count times the expert width. Multi-token-prediction layers (nextn) are loaded and
never applied. Files from before the absorbed form (attn_kv_b, no key_length_mla) are refused.
"""

import numpy as np


from alchemist.arch.family import (
    ExpertRouting,
    Family,
    FixtureSpec,
    gating_from_file,
    inverse_yarn_mscale,
    leading_dense_ffns,
    logf,
)
from alchemist.arch.table import (
    ATTN_MLA,
    ATTN_MLA_Q,
    ATTN_MLA_Q_LORA,
    ATTN_NORM,
    FFN_EXP_PROBS_B,
    FFN_GATED,
    FFN_MOE,
    FFN_NORM,
    FFN_SHEXP,
    NEXTN,
    OUTPUT,
    OUTPUT_NORM,
    TOKEN_EMBD,
    only_in_ffn,
    optional,
)
from alchemist.errors import UnsupportedModelError
from alchemist.ir import Activation, Gating, RopeStyle


def _yarn_freq_scale(hp) -> float:
    """1 / rope.scaling.factor under YaRN, else 1; a linear factor (which would change deepseek2.cpp's kq_scale
    through llama_context's attn_factor, in no file we know of) is refused."""
    factor = hp.float("rope.scaling.factor", default=0.0)
    kind = hp.str("rope.scaling.type", default="linear")
    if kind == "linear" and factor not in (0.0, 1.0):
        raise UnsupportedModelError(f"{hp.facts.path}: deepseek2 with linear RoPE scaling ({factor}) is not supported")
    return 1.0 / factor if kind == "yarn" and factor else 1.0


def _score_scale(hp, head_dim_mla: int) -> float:
    """deepseek2.cpp's kq_scale in float32: mscale² / sqrtf(key_length_mla), mscale = attn_factor_org · (1 + 0.1 ·
    yarn_log_mul · ln(1/freq_scale)), attn_factor_org = the graph's attn_factor · (1 + 0.1 ln(1/freq_scale));
    yarn_log_mul is the file's rope.scaling.yarn_log_multiplier / 0.1 (the loader cancels the converter's 0.1)."""
    f = np.float32
    freq_scale = _yarn_freq_scale(hp)
    if freq_scale == 1.0:
        return float(f(1.0) / np.sqrt(f(head_dim_mla)))
    ln = f(logf(float(f(1) / f(freq_scale))))
    log_mul = f(f(hp.float("rope.scaling.yarn_log_multiplier", default=0.0)) / f(0.1))
    org = f(f(inverse_yarn_mscale(hp, freq_scale)) * f(f(1) + f(f(0.1) * ln)))
    mscale = f(org * f(f(1) + f(f(f(0.1) * log_mul) * ln)))
    return float(f(f(mscale * mscale) / np.sqrt(f(head_dim_mla))))


SMALL_MOE = (("expert_count", 4), ("expert_used_count", 2), ("expert_feed_forward_length", 128))


def _fixture(q_lora_rank: int, *metadata, optional=("blk.{il}.attn_q.weight",), extra_optional=(), **spec):
    """A fixture of 3 layers (the first dense) with one KV head of [latent 256 | RoPE 32], query heads of 64 + 32
    and values of 64; queries through a low rank of q_lora_rank (0: attn_q directly)."""
    return FixtureSpec(
        n_layer=3,
        rope_dim=32,
        optional=("output.weight", *optional, *extra_optional),
        metadata=(
            ("attention.head_count_kv", 1),
            ("attention.key_length", 256 + 32),
            ("attention.value_length", 256),
            ("attention.key_length_mla", 64 + 32),
            ("attention.value_length_mla", 64),
            ("attention.q_lora_rank", q_lora_rank),
            ("attention.kv_lora_rank", 256),
            ("leading_dense_block_count", 1),
            *metadata,
        ),
        **spec,
    )


FAMILY = Family(
    name="deepseek2",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT
    + ATTN_NORM
    + ATTN_MLA_Q
    + ATTN_MLA_Q_LORA
    + ATTN_MLA
    + FFN_NORM
    + only_in_ffn("dense", *FFN_GATED)
    + only_in_ffn("moe", *FFN_MOE, *optional(*FFN_EXP_PROBS_B), *FFN_SHEXP)
    + NEXTN,
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    latent_attention=True,
    score_scale=_score_scale,
    # YaRN: deepseek2.cpp scales q·k by mscale² and keeps RoPE's magnitude at 1 (its graph's attn_factor)
    rope_scalings=("none", "linear", "yarn"),
    yarn_attn_factor=inverse_yarn_mscale,
    layer_ffns=leading_dense_ffns,
    mtp_layers=lambda hp: hp.int("nextn_predict_layers", default=0),
    moe=ExpertRouting(
        gating_from=gating_from_file(default=Gating.SOFTMAX),  # absent or NONE: DeepSeek-V2's softmax
        normalize_from=lambda hp: hp.bool("expert_weights_norm", default=False),
        weight_scale=lambda hp: hp.float("expert_weights_scale", default=0.0) or 1.0,
        expert_width=lambda hp, n_used: hp.int("expert_feed_forward_length", minimum=1),
        shared_width=lambda hp, n_ff_exp: n_ff_exp * hp.int("expert_shared_count", minimum=1),
        groups=lambda hp: (hp.int("expert_group_count", default=0), hp.int("expert_group_used_count", default=0)),
    ),
    # DeepSeek-V3's shape scaled down: layer 0 dense, layers 1-2 experts (8 in 4 groups, 2 of them used, 2
    # experts per token, sigmoid scores with a selection bias) and a shared expert; queries through a low rank.
    # Variants: DeepSeek-V2-Lite's shape (queries by attn_q, softmax scores without groups or selection bias), and
    # DeepSeek-V3's YaRN (factor 40 over 4096 positions there) with the log multiplier its files carry
    fixture=_fixture(
        256,
        ("expert_count", 8),
        ("expert_used_count", 2),
        ("expert_group_count", 4),
        ("expert_group_used_count", 2),
        ("expert_feed_forward_length", 128),
        ("expert_shared_count", 1),
        ("expert_weights_norm", True),
        ("expert_weights_scale", 2.5),
        ("expert_gating_func", 2),
        optional=("blk.{il}.attn_q_a.weight", "blk.{il}.attn_q_a_norm.weight", "blk.{il}.attn_q_b.weight"),
        extra_optional=("blk.{il}.exp_probs_b.bias",),
        scales=(("blk.{il}.ffn_gate_inp.weight", 0.5), ("blk.{il}.exp_probs_b.bias", 1.0)),
        variants=(
            ("lite", _fixture(0, *SMALL_MOE, ("expert_shared_count", 2), ("expert_weights_scale", 1.0))),
            (
                "yarn",
                _fixture(
                    0,
                    *SMALL_MOE,
                    ("expert_shared_count", 1),
                    ("expert_weights_scale", 1.0),
                    ("rope.scaling.type", "yarn"),
                    ("rope.scaling.factor", 40.0),
                    ("rope.scaling.original_context_length", 16),
                    ("rope.scaling.yarn_log_multiplier", 0.1),
                ),
            ),
        ),
    ),
)
