"""Gemma 3n (text): llama.cpp src/models/gemma3n.cpp.

Gemma 3's attention (NEOX RoPE, q/k RMSNorm per head, sandwich norms, sliding-window layers with their own
RoPE base, default 10000) with kq scale 1 and values RMS-normed without a weight, inside an AltUp block:
- the scaled embedding widened into 4 residual streams by altup_proj (each rescaled to the embedding's L2
  magnitude); each layer predicts every stream from all four (altup_predict_coef, weighted by a router:
  tanh(altup_router · RMSNorm(x) / n_embd)), runs the active stream 0 through attention, LAuReL
  (laurel_l, laurel_r, laurel_post_norm; joined as (attention + active + laurel) / sqrt 2) and a GELU MLP,
  then corrects every stream by the active one's innovation (altup_correct_coef + 1) and adds the layer's
  gated per-layer input (inp_gate, proj, post_norm) to streams 1-3; altup_unembd_proj merges them back;
- per-layer inputs: rows of per_layer_token_embd (read by token) · sqrt(256) plus per_layer_model_proj · x
  / sqrt(n_embd), RMS-normed per layer (per_layer_proj_norm), summed and / sqrt 2;
- activation sparsity in layers 0-9: gate <- relu(gate - (mean + 1.6448533535 · std)) before GELU;
- KV sharing: layers from 20 on compute only queries and attend to the cache written by layer 18 (sliding)
  or 19 (global).
Norm weights multiply as stored. The sizes (4 streams, width 256, rank 64), the 20-layer KV start, the 10
sparse layers and the final softcap 30 are llama.cpp constants: the GGUF keys for them are not read.
"""

import dataclasses
import math

import numpy as np

from alchemist.arch.family import (
    Family,
    FixtureSpec,
    Hparams,
    SnapshotSpec,
    every_nth_dense,
    gemma_fixture_scales,
    shared_kv_source,
)
from alchemist.arch.table import (
    ALTUP,
    ALTUP_STREAMS,
    ATTN_NORM,
    ATTN_OUT,
    ATTN_POST_NORM,
    ATTN_QKV_SPLIT,
    FFN_GATED,
    FFN_NORM,
    FFN_POST_NORM,
    LAUREL,
    LAUREL_RANK,
    OUTPUT,
    OUTPUT_NORM,
    PER_LAYER_WIDTH,
    QK_NORM_HEAD,
    TOKEN_EMBD,
)
from alchemist.errors import UnsupportedModelError
from alchemist.ir import (
    AltUpLayerSpec,
    AltUpSpec,
    Activation,
    LaurelSpec,
    ModelIR,
    NormKind,
    NormSpec,
    PerLayerInputSpec,
    RopeStyle,
    Wiring,
)

KV_FROM_START = 20  # llama_model_gemma3n: n_layer_kv_from_start
SPARSE_LAYERS = 10  # graph::n_layer_sparsity
SPARSITY_STD = float(np.float32(1.6448533535003662))  # graph::f_sparsity_std_mul, Normal(0, 1).icdf(0.95)
INV_SQRT2 = float(np.float32(1.0) / np.sqrt(np.float32(2.0)))  # 1.0f / sqrtf(2.0f)
KV_SHARED = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")  # loaded on KV-sharing layers, never applied


def _components(hp: Hparams, ir: ModelIR) -> ModelIR:
    rms = lambda weight: NormSpec(NormKind.RMS, weight)  # noqa: E731
    sliding = [lay.attention.sliding_window > 0 for lay in ir.layers]
    if not any(sliding):
        raise UnsupportedModelError(f"{hp.facts.path}: gemma3n needs sliding-window layers (llama.cpp's iSWA cache)")
    # the std over n - 1 in llama.cpp, over n in Hugging Face's and mlx-lm's model: a snapshot computes as its own
    sparsity_ddof = 0 if getattr(hp.facts, "source_files", ()) else 1
    layers = []
    for lay in ir.layers:
        il = lay.index
        attention = dataclasses.replace(
            lay.attention,
            kv_layer=shared_kv_source(il, sliding, KV_FROM_START, f"{hp.facts.path}: gemma3n"),
            v_norm=NormSpec(NormKind.RMS, None),
        )
        mlp = dataclasses.replace(
            lay.mlp, sparsity_std=SPARSITY_STD if il < SPARSE_LAYERS else 0.0, sparsity_ddof=sparsity_ddof
        )
        altup = AltUpLayerSpec(
            router="altup_router.weight",
            router_norm=rms("altup_router_norm.weight"),
            router_scale=float(np.float32(1.0) / np.float32(ir.n_embd)),
            predict_coef="altup_predict_coef.weight",
            correct_coef="altup_correct_coef.weight",
            correct_scale="altup_correct_scale.weight",
            inp_gate="inp_gate.weight",
            proj="proj.weight",
            post_norm=rms("post_norm.weight"),
        )
        laurel = LaurelSpec("laurel_l.weight", "laurel_r.weight", rms("laurel_post_norm.weight"), INV_SQRT2)
        layers.append(
            dataclasses.replace(lay, wiring=Wiring.ALTUP, attention=attention, mlp=mlp, altup=altup, laurel=laurel)
        )
    # K/V projections of a KV-sharing layer are loaded (llama.cpp requires them) but never applied
    unread = {f"blk.{lay.index}.{s}" for lay in layers if lay.attention.kv_layer != lay.index for s in KV_SHARED}
    tensors = tuple(dataclasses.replace(t, read=False) if t.name in unread else t for t in ir.tensors)
    per_layer = PerLayerInputSpec(
        token_embd="per_layer_token_embd.weight",
        model_proj="per_layer_model_proj.weight",
        proj_norm=rms("per_layer_proj_norm.weight"),
        width=PER_LAYER_WIDTH,
        token_scale=float(np.sqrt(np.float32(PER_LAYER_WIDTH))),
        proj_scale=float(np.float32(1.0) / np.sqrt(np.float32(ir.n_embd))),
        sum_scale=INV_SQRT2,
    )
    altup = AltUpSpec(ALTUP_STREAMS, "altup_proj.weight", "altup_unembd_proj.weight")
    return dataclasses.replace(ir, layers=tuple(layers), tensors=tensors, altup=altup, per_layer_input=per_layer)


def _layer_kinds(n_layer: int) -> tuple[bool, ...]:
    """Sliding (True) or global per layer, written as the converter writes it (a bool array): every 5th global."""
    return tuple(il % 5 < 4 for il in range(n_layer))


def _scales(branch: float) -> tuple[tuple[str, float], ...]:
    """Fixture value scales: the gemmas' (gemma_fixture_scales), router weights up so that the streams really mix
    (random ones of the usual size give tanh(~0.004)), and LAuReL's post-norm times `branch` too."""
    return (
        ("blk.{il}.altup_router.weight", 64.0),
        ("blk.{il}.altup_correct_coef.weight", 2.0),
        *gemma_fixture_scales(branch),
        ("blk.{il}.laurel_post_norm.weight", branch),
    )


FAMILY = Family(
    name="gemma3n",
    tensors=TOKEN_EMBD
    + OUTPUT_NORM
    + OUTPUT
    + ATTN_NORM
    + ATTN_QKV_SPLIT
    + ATTN_OUT
    + QK_NORM_HEAD
    + ATTN_POST_NORM
    + FFN_NORM
    + FFN_GATED
    + FFN_POST_NORM
    + ALTUP
    + LAUREL,
    rope=RopeStyle.NEOX,
    activation=Activation.GELU_TANH,
    score_scale=lambda hp, head_dim: 1.0,  # f_attention_scale: q and k are RMS-normed
    embedding_scale=lambda hp: math.sqrt(hp.int("embedding_length")),
    final_softcap=lambda hp: 30.0,  # llama_hparams' default; gemma3n does not read final_logit_softcapping
    sliding_layers=every_nth_dense(5),
    swa_rope=lambda hp, base, scale: (hp.float("rope.freq_base_swa", default=10000.0, positive=True), 1.0),
    components=_components,
    # 6 layers: every one sparse, layers 2 and 5 global (a bool array, as the converter writes it), the sliding
    # layers with their own RoPE base; values scaled as _scales says. kv_shared_config(): the KV-sharing one
    fixture=FixtureSpec(
        vocab="spm",
        n_layer=6,
        metadata=(
            ("attention.sliding_window", 8),
            ("attention.sliding_window_pattern", (True, True, False, True, True, False)),
            ("rope.freq_base_swa", 1000.0),
        ),
        embedding_std=0.5,
        scales=_scales(0.3),
    ),
    # what convert_hf_to_gguf's Gemma3NModel does: the text model's tensors (language_model.*) by gguf-py's name
    # map, the AltUp projections stacked, the norms as stored; the sizes llama.cpp takes as constants required
    snapshot=SnapshotSpec(
        model_types=("gemma3n",),
        text_config="text_config",
        only="language_model.",
        renames=(("model.language_model.", "model."), (".correct_output_scale", ".correct_output_scale.weight")),
        stacks=(
            (r"\.altup_projections\.(?P<i>\d+)\.weight$", ".altup_projections.weight"),
            (r"\.altup_unembed_projections\.(?P<i>\d+)\.weight$", ".altup_unembed_projections.weight"),
        ),
        config=(
            ("sliding_window", "attention.sliding_window"),
            ("rope_local_base_freq", "rope.freq_base_swa"),
        ),
        flags=(("layer_types", "attention.sliding_window_pattern", "sliding_attention"),),
        requires=(
            ("altup_num_inputs", ALTUP_STREAMS, "llama.cpp's gemma3n has 4 AltUp streams"),
            ("altup_active_idx", 0, "llama.cpp's gemma3n computes on stream 0"),
            ("altup_correct_scale", True, "llama.cpp's gemma3n scales the corrected stream"),
            ("hidden_size_per_layer_input", PER_LAYER_WIDTH, "llama.cpp's gemma3n has per-layer inputs 256 wide"),
            ("laurel_rank", LAUREL_RANK, "llama.cpp's gemma3n has LAuReL of rank 64"),
            ("final_logit_softcapping", 30.0, "llama.cpp's gemma3n caps the logits at 30"),
            ("num_kv_shared_layers", lambda c: max(0, c.get("num_hidden_layers", 0) - KV_FROM_START),
             "llama.cpp's gemma3n shares the caches of layers 18 and 19 from layer 20 on"),
            ("activation_sparsity_pattern", lambda c: [0.95 if il < SPARSE_LAYERS else 0.0
                                                        for il in range(c.get("num_hidden_layers", 0))],
             "llama.cpp's gemma3n keeps the top 5% of the gate in its first 10 layers"),
        ),  # fmt: skip
        pad_rows=(("per_layer_token_embd.weight", "vocab_size"),),
    ),
)
