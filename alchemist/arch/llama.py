"""Llama (Llama 2/3, Mistral, SmolLM2, TinyLlama): llama.cpp src/models/llama.cpp.

RoPE is NORM (adjacent pairs) because convert_hf_to_gguf permutes the Q/K rows; llama3 files may carry
`rope_freqs.weight` (per-frequency divisors). Biases are optional; the output is tied to the token
embedding when `output.weight` is absent.

Mixtral-style files (expert_count > 0) have a mixture of experts in place of the FFN in every layer: the
router ffn_gate_inp and the 3-D ffn_{gate,up,down}_exps (the gate optional: silu(up) without it); softmax
over all experts, top-k, weights renormalized, no weight scale (llama.cpp reads no MoE keys for llama).
"""

from alchemist.arch.family import Family, FixtureSpec, SnapshotSpec
from alchemist.arch.table import (
    ATTN_OUT_BIAS,
    ATTN_QKV_BIAS,
    FFN_GATED,
    FFN_GATED_BIAS,
    FFN_MOE,
    LLAMA,
    ROPE_FREQS,
    alternative,
    optional,
)
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="llama",
    # the FFN is dense or a mixture of experts, by the tensors the file has
    tensors=LLAMA[: -len(FFN_GATED)]
    + alternative("dense", *FFN_GATED)
    + alternative("moe", FFN_MOE[0], *optional(FFN_MOE[1]), *FFN_MOE[2:])
    + ROPE_FREQS
    + optional(*ATTN_QKV_BIAS, *ATTN_OUT_BIAS)
    + alternative("dense", *optional(*FFN_GATED_BIAS)),
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    rope_scalings=("none", "linear", "llama3", "yarn"),
    snapshot=SnapshotSpec(model_types=("llama", "mistral"), permute_qk=True),
    fixture=FixtureSpec(
        vocab="spm",
        variants=(
            # llama3: per-frequency divisors in rope_freqs.weight
            ("llama3", FixtureSpec(vocab="spm", optional=("rope_freqs.weight",))),
            ("linear", FixtureSpec(vocab="spm", metadata=(("rope.scaling.type", "linear"), ("rope.scaling.factor", 4.0)))),
            # Mixtral-style: 8 experts of feed_forward_length, 2 per token
            ("moe", FixtureSpec(
                vocab="spm",
                alternative="moe",
                optional=("blk.{il}.ffn_gate_exps.weight",),
                metadata=(("expert_count", 8), ("expert_used_count", 2)),
            )),
        ),
    ),
)
