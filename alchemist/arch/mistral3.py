"""Mistral 3 (Ministral 3, Mistral Small 3.x text models): llama.cpp src/models/mistral3.cpp.

Llama's block (NORM RoPE, SiLU gated MLP, or a softmax-routed mixture of experts when the file has a router)
with two differences: q·k is scaled by `attention.scale` when it is set, and with
`attention.temperature_scale` set the queries are tuned by position after RoPE (Llama 4's temperature:
log(floor(p / n) + 1) · scale + 1, n = rope.scaling.original_context_length, llama.cpp's n_ctx_orig_yarn).
"""

from alchemist.arch.family import Family, FixtureSpec, attention_scale_key, inverse_yarn_mscale
from alchemist.arch.llama import FAMILY as LLAMA
from alchemist.errors import GGUFError
from alchemist.ir import Activation, AttentionTemperature, RopeStyle


def _temperature(hp) -> AttentionTemperature | None:
    scale = hp.float("attention.temperature_scale", default=0.0)
    if scale == 0.0:
        return None
    length = hp.int("rope.scaling.original_context_length", default=hp.int("context_length"))
    if length == 0:  # llama.cpp: "invalid n_ctx_orig_yarn for attention temperature scaling"
        raise GGUFError(hp.facts.path, hp.key("rope.scaling.original_context_length"), "must be > 0 with a temperature")
    return AttentionTemperature(scale=scale, length=length, offset=0.0)


FAMILY = Family(
    name="mistral3",
    tensors=LLAMA.tensors,
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    score_scale=attention_scale_key,
    attn_temperature=_temperature,
    rope_scalings=("none", "linear", "yarn"),
    # mistral3.cpp hands ggml_rope_ext 1 / (1 + 0.1 ln factor), which (about) cancels ggml's YaRN magnitude
    yarn_attn_factor=inverse_yarn_mscale,
    yarn_betas=lambda hp: (
        hp.float("rope.scaling.yarn_beta_fast", default=32.0),
        hp.float("rope.scaling.yarn_beta_slow", default=1.0),
    ),
    # the queries' factor steps every 4 positions, so a short prompt sees three steps
    fixture=FixtureSpec(
        metadata=(("attention.temperature_scale", 0.5), ("rope.scaling.original_context_length", 4)),
        optional=("output.weight",),
        variants=(
            # Ministral 3's files: YaRN (beta and log-multiplier keys as they ship) with the temperature
            (
                "yarn",
                FixtureSpec(
                    metadata=(
                        ("attention.temperature_scale", 0.5),
                        ("rope.scaling.type", "yarn"),
                        ("rope.scaling.factor", 5.0),  # one where ggml's rounding of the factors shows
                        ("rope.scaling.original_context_length", 4),
                        ("rope.scaling.yarn_beta_fast", 32.0),
                        ("rope.scaling.yarn_beta_slow", 1.0),
                        ("rope.scaling.yarn_log_multiplier", 1.0),
                    ),
                    optional=("output.weight",),
                ),
            ),
        ),
    ),
)
