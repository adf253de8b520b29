"""Nemotron-H (NVIDIA Nemotron-H, Nemotron Nano 2): llama.cpp src/models/nemotron-h.cpp.

Every block is one pre-normed sublayer and a residual add (Wiring.SINGLE): a Mamba-2 mixer where both
attention.head_count_kv and feed_forward_length are 0 for the layer, attention (no RoPE) where only
feed_forward_length is 0, else an MLP, down(relu(up(x))²). The per-layer arrays of those two keys say which.
"""

from alchemist.arch.family import Family, FixtureSpec, attention_scale_key
from alchemist.arch.granitehybrid import MIXERS, SSM_FIXTURE
from alchemist.arch.table import (
    FFN_PLAIN,
    FFN_PLAIN_BIAS,
    only_in_ffn,
    optional,
)
from alchemist.ir import Activation, RopeStyle, Wiring


def _per_layer(hp, key: str, n_layer: int) -> list[int]:
    values = hp.ints(key, n_layer)
    return values if values is not None else [hp.int(key)] * n_layer


def _mixers(hp, n_layer: int) -> list[str]:
    """llama.cpp's is_recurrent(il) (n_head_kv(il) == 0 and n_ff(il) == 0), attention where n_ff(il) == 0, else
    an MLP-only block ("none": no token mixer)."""
    kv = _per_layer(hp, "attention.head_count_kv", n_layer)
    ff = _per_layer(hp, "feed_forward_length", n_layer)
    return ["ssm" if k == 0 and f == 0 else "attention" if f == 0 else "none" for k, f in zip(kv, ff)]


FAMILY = Family(
    name="nemotron_h",
    tensors=MIXERS + only_in_ffn("dense", *FFN_PLAIN, *optional(*FFN_PLAIN_BIAS)),
    rope=RopeStyle.NONE,
    activation=Activation.RELU_SQR,
    wiring=Wiring.SINGLE,
    layer_mixers=_mixers,
    layer_ffns=lambda hp, n_layer: ["dense" if m == "none" else "none" for m in _mixers(hp, n_layer)],
    score_scale=attention_scale_key,
    # nemotron-h.cpp names the block output nemotron_h_block_out, and an MLP block's output (before the add) l_out
    tap_names=(("l_out", "nemotron_h_block_out"), ("ffn_out", "l_out")),
    # a Mamba-2 block, an attention block, an MLP block, a Mamba-2 block
    fixture=FixtureSpec(
        n_layer=4,
        metadata=(
            ("attention.head_count_kv", (0, 2, 0, 0)),
            ("feed_forward_length", (0, 0, 512, 0)),
            ("attention.layer_norm_epsilon", 1e-5),
            *SSM_FIXTURE,
        ),
    ),
)
