"""Mamba-2 (Mamba-Codestral, the state-spaces mamba2 models): llama.cpp src/models/mamba.cpp with
build_mamba2_layer (LLM_ARCH_MAMBA2).

No attention and no MLP: every block is x + mamba2(rms_norm(x)) (Wiring.SINGLE), the Mamba-2 mixer the
hybrids use (alchemist/arch/granitehybrid.py describes it: convolution, selective scan in groups, D skip,
SiLU-gated group RMSNorm). Its files write attention.head_count and feed_forward_length as 0.
"""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import ATTN_NORM, OUTPUT, OUTPUT_NORM, SSM_MAMBA2, TOKEN_EMBD
from alchemist.ir import Activation, RopeStyle, Wiring

FAMILY = Family(
    name="mamba2",
    tensors=TOKEN_EMBD + OUTPUT_NORM + OUTPUT + ATTN_NORM + SSM_MAMBA2,
    rope=RopeStyle.NONE,
    activation=Activation.SILU,  # the mixer's gate
    wiring=Wiring.SINGLE,
    layer_mixers=lambda hp, n_layer: ["ssm"] * n_layer,
    layer_ffns=lambda hp, n_layer: ["none"] * n_layer,
    # as convert_hf_to_gguf.py writes Mamba-2: no attention heads, no MLP; an inner width of n_embd (4 heads of
    # 64 in 2 groups, state 16), so that out_proj is square
    fixture=FixtureSpec(
        n_layer=3,
        metadata=(
            ("attention.head_count", 0),
            ("feed_forward_length", 0),
            ("ssm.conv_kernel", 4),
            ("ssm.inner_size", 256),
            ("ssm.state_size", 16),
            ("ssm.time_step_rank", 4),
            ("ssm.group_count", 2),
        ),
        optional=("output.weight",),
    ),
)
