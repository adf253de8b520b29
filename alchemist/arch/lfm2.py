"""LFM2 (Liquid): llama.cpp src/models/lfm2.cpp.

A hybrid: each layer mixes tokens either with attention (RMSNorm over each q/k head before NEOX RoPE) or with
a gated short causal convolution (B, C, X = in_proj(x); out_proj(C · conv(B · X)) over the last
shortconv.l_cache positions); the per-layer attention.head_count_kv array says which (0: convolution). Every
layer has the same pre-norm SiLU gated MLP. The final norm is token_embd_norm.weight; the output is tied unless
output.weight exists.
"""

from alchemist.arch.family import Family, FixtureSpec, recurrent_where_no_kv_heads
from alchemist.arch.table import (
    ATTN_NORM,
    ATTN_OUT,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    FFN_NORM,
    OUTPUT,
    QK_NORM_HEAD,
    SHORTCONV,
    TOKEN_EMBD,
    TOKEN_EMBD_NORM,
    only_in,
)
from alchemist.errors import UnsupportedModelError
from alchemist.ir import Activation, RopeStyle


def _mixers(hp, n_layer: int) -> list[str]:
    """llama.cpp's is_recr(il) = n_head_kv(il) == 0: a convolution layer."""
    if not hp.bool("attention.causal", default=True):
        # the embedding variant pads the convolution on both sides and attends both ways
        raise UnsupportedModelError(f"{hp.facts.path}: {hp.key('attention.causal')} = false is not supported")
    return recurrent_where_no_kv_heads("conv")(hp, n_layer)


FAMILY = Family(
    name="lfm2",
    tensors=TOKEN_EMBD
    + TOKEN_EMBD_NORM
    + OUTPUT
    + ATTN_NORM
    + only_in("attention", *ATTN_QKV_SPLIT, *QK_NORM_HEAD, *ATTN_OUT)
    + SHORTCONV
    + FFN_NORM
    + FFN_GATED,
    rope=RopeStyle.NEOX,
    activation=Activation.SILU,
    layer_mixers=_mixers,
    # attention.sliding_window > 0 makes every attention layer slide (lfm2.cpp: is_swa = !is_recr)
    sliding_layers=lambda hp, n_layer: [True] * n_layer,
    output_norm="token_embd_norm.weight",
    # lfm2.cpp's names; its Qcur/Kcur are the projections (before the norm and RoPE), and it names the FFN's
    # input norm "ffn_out"
    tap_names=(
        ("attn_norm", "model.layers.{}.operator_norm"),
        ("Qcur_normed", "model.layers.{}.self_attn.q_layernorm"),
        ("Kcur_normed", "model.layers.{}.self_attn.k_layernorm"),
        ("Qcur", "Qcur_rope"),
        ("Kcur", "Kcur_rope"),
        ("conv_in", "model.layers.{}.conv.in_proj"),
        ("conv", "model.layers.{}.conv.conv"),
        ("conv_out", "model.layers.{}.conv.out_proj"),
        ("ffn_norm", "model.layers.{}.ffn_out"),
    ),
    # layers 0 and 3 convolve, 1 and 2 attend: both kinds within the first two layers
    fixture=FixtureSpec(
        n_layer=4,
        metadata=(("attention.head_count_kv", (0, 2, 2, 0)), ("shortconv.l_cache", 3)),
        variants=(
            (
                "swa",
                FixtureSpec(
                    n_layer=4,
                    metadata=(
                        ("attention.head_count_kv", (0, 2, 2, 0)),
                        ("shortconv.l_cache", 3),
                        ("attention.sliding_window", 5),
                    ),
                ),
            ),
        ),
    ),
)
