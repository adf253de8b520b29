"""Qwen3-MoE: llama.cpp src/models/qwen3moe.cpp. Qwen3's attention (RMSNorm over each q/k head before NEOX
RoPE, no biases) and a mixture of experts in every layer: softmax over all experts, top-k, the chosen
weights renormalized; each expert a SwiGLU MLP of width expert_feed_forward_length (llama.cpp's fallback
when it is absent or 0: feed_forward_length / expert_used_count)."""

from alchemist.arch.family import ExpertRouting, Family, FixtureSpec, SnapshotSpec
from alchemist.arch.table import ATTN_NORM, ATTN_OUT, ATTN_QKV_SPLIT, FFN_MOE, FFN_NORM, OUTPUT, OUTPUT_NORM
from alchemist.arch.table import QK_NORM_HEAD, TOKEN_EMBD
from alchemist.ir import Activation, Gating, RopeStyle


def _expert_width(hp, n_expert_used: int) -> int:
    return hp.int("expert_feed_forward_length", default=0) or hp.int("feed_forward_length") // n_expert_used


FAMILY = Family(
    name="qwen3moe",
    tensors=TOKEN_EMBD + OUTPUT_NORM + OUTPUT + ATTN_NORM + ATTN_QKV_SPLIT + ATTN_OUT + FFN_NORM + QK_NORM_HEAD + FFN_MOE,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    moe=ExpertRouting(gating=Gating.SOFTMAX, normalize=True, expert_width=_expert_width),
    fixture=FixtureSpec(
        optional=("output.weight",),
        metadata=(("expert_count", 8), ("expert_used_count", 2), ("expert_feed_forward_length", 256)),
    ),
    snapshot=SnapshotSpec(
        model_types=("qwen3_moe",),
        config=(("moe_intermediate_size", "expert_feed_forward_length"),),
        renames=((".mlp.switch_mlp.", ".mlp.experts."),),  # MLX's stacked experts
        stacks=((r"\.mlp\.experts\.(?P<i>\d+)\.(?P<w>gate|up|down)_proj\.weight$", r".mlp.experts.\g<w>_proj.weight"),),
        requires=(
            ("norm_topk_prob", True, "llama.cpp's qwen3moe always renormalizes the chosen experts' weights"),
            ("decoder_sparse_step", 1, "llama.cpp's qwen3moe has experts in every layer"),
            ("mlp_only_layers", [], "llama.cpp's qwen3moe has experts in every layer"),
        ),
    ),
)
