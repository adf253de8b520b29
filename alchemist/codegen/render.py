"""Render a ModelIR into a formatted, deterministic Python module.

Metadata reaches the generated code only through the `py` filter (a Python literal made with `repr`
from a str/int/float/bool/None or a tuple of those) or as a validated identifier; the template is
rendered with StrictUndefined, formatted with black and parsed back with libcst before it is returned.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from pathlib import Path

import black
import jinja2
import libcst
import numpy as np

from alchemist.version import __version__
from alchemist import ir as ir_module
from alchemist.errors import UnsupportedModelError
from alchemist.ir import (
    Activation,
    LayerSpec,
    MLPKind,
    MLPSpec,
    ModelIR,
    QKNormScope,
    RopeScaling,
    RopeStyle,
    Wiring,
)

# An installed wheel ships the templates as alchemist/templates (see setup.py); a source checkout (editable
# install) keeps the one copy in the top-level templates/ folder.
TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"
if not TEMPLATES_DIR.is_dir():
    TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"
IDENTIFIER = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")  # a family name: letters, digits, _ and -
BLACK_MODE = black.Mode(line_length=120, target_versions={black.TargetVersion.PY312})


def py_literal(value) -> str:
    """The one way a value from the GGUF file becomes source text: a repr of plain data."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnsupportedModelError(f"refusing to emit non-finite number {value!r} into generated code")
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [py_literal(v) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    raise TypeError(f"py_literal: refusing to emit a {type(value).__name__}")


def py_constant(value) -> str:
    """py_literal, except that a tuple of numbers repeating a pattern (a per-layer constant) is written as the
    pattern times the count: (0,) * 24, (512, 512, 0) * 6."""
    if isinstance(value, tuple) and len(value) > 1 and all(isinstance(v, (bool, int, float)) for v in value):
        for period in range(1, len(value) // 2 + 1):
            count, rest = divmod(len(value), period)
            if not rest and value == value[:period] * count:
                return f"{py_literal(value[:period])} * {count}"
    return py_literal(value)


def module_slug(source_file: str) -> str:
    """A safe module name from the GGUF file name: 'gemma-3-270m-q4_k_m.gguf' -> 'gemma_3_270m_q4_k_m'."""
    stem = source_file[:-5] if source_file.lower().endswith(".gguf") else source_file
    slug = re.sub(r"[^a-z0-9]+", "_", stem.lower()).strip("_")[:64] or "model"
    if not slug[0].isalpha():
        slug = "model_" + slug
    return slug


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["py"] = py_literal
    env.filters["py_constant"] = py_constant
    return env


def _structure(layer: LayerSpec) -> LayerSpec:
    """A layer with its per-layer numbers blanked: what must be the same in every layer to share one block()."""
    att, mlp = layer.attention, layer.mlp
    if mlp is not None:  # per layer: N_FF where widths differ (the dense MLP's; experts have one width)
        mlp = dataclasses.replace(mlp, sparsity_std=0.0, n_ff=0 if mlp.router is None else mlp.n_ff)
    if att is None:  # a hybrid's layer mixing tokens otherwise, or not at all
        return dataclasses.replace(layer, index=0, mlp=mlp)
    rope = dataclasses.replace(att.rope, base=0.0, freq_scale=0.0, style=RopeStyle.NONE, dim=0)  # dim: ROPE_DIM
    if rope.scaling is RopeScaling.LLAMA3:  # which layers divide by the frequency factors: ROPE_FACTOR_LAYERS
        rope = dataclasses.replace(rope, scaling=RopeScaling.NONE, freq_factors=None)
    # per layer where they differ: ATTENTION_CHUNK; the head counts and sizes (N_HEAD, N_KV_HEAD, HEAD_DIM)
    att = dataclasses.replace(att, chunk=0, n_head=0, n_kv_head=0, head_dim=0, head_dim_v=0)
    kv_layer = None if att.kv_layer is None else -1  # which cache: per layer (KV_CACHE_OF); whether: the same
    if kv_layer is not None:  # whether its values are its keys' projection: per layer (VALUES_FROM_KEYS)
        att = dataclasses.replace(att, v=None)
    return dataclasses.replace(
        layer,
        index=0,
        attention=dataclasses.replace(att, sliding_window=0, rope=rope, kv_layer=kv_layer),
        mlp=mlp,
    )


def _rope_style(ir: ModelIR) -> RopeStyle:
    styles = {lay.attention.rope.style for lay in ir.attention_layers} - {RopeStyle.NONE}
    if len(styles) > 1:
        raise UnsupportedModelError(f"{ir.source_file}: layers rotate in different RoPE styles {sorted(styles)}")
    return styles.pop() if styles else RopeStyle.NONE


def check_renderable(ir: ModelIR) -> None:
    """Refuse an IR the templates cannot render faithfully (every IR field is either rendered or checked here)."""
    if not IDENTIFIER.match(ir.architecture):
        raise UnsupportedModelError(f"architecture name {ir.architecture!r} is not a valid identifier")
    first = ir.layers[0]
    # the first layer of each token mixer and FFN kind: a hybrid's layers agree with the first of their kind
    mixers = {}
    for lay in ir.layers:
        kind = (ir.mixes(lay), lay.attention is None, lay.mlp is None or lay.mlp.router is not None)
        ref = mixers.setdefault(kind, lay)
        if _structure(lay) != _structure(ref) or _mixerless(lay) != _mixerless(first):
            raise UnsupportedModelError(
                f"{ir.source_file}: layer {lay.index} differs from layer {ref.index} in more than its window and RoPE "
                "numbers; per-layer structure is not supported"
            )
    recurrent = all(lay.ssm is not None for lay in ir.layers)
    if not ir.attention_layers and not recurrent:
        raise UnsupportedModelError(
            f"{ir.source_file}: the templates need at least one attention layer, or Mamba-2 in every layer"
        )
    att = ir.attention_layers[0].attention if ir.attention_layers else None
    problems = []
    conv, ssm, deltanet = _conv(ir), _ssm(ir), _deltanet(ir)
    side_by_side = [lay.attention is not None and lay.ssm is not None for lay in ir.layers]
    if any(side_by_side) and not all(side_by_side):
        problems.append("attention and Mamba-2 side by side in some layers only")
    if any(
        [lay.attention, lay.conv, lay.ssm, lay.deltanet].count(None) < 3 - both
        for lay, both in zip(ir.layers, side_by_side)
    ):
        problems.append("a layer with more than one token mixer (other than attention beside Mamba-2)")
    single = first.wiring is Wiring.SINGLE
    if any((not ir.mixes(lay) or lay.mlp is None) and not single for lay in ir.layers):
        problems.append("a layer without a token mixer or without an MLP outside a single-sublayer block")
    if single and any(ir.mixes(lay) == (lay.mlp is not None) for lay in ir.layers):
        problems.append("a single-sublayer block with both a token mixer and an MLP, or neither")
    if single and (first.ffn_norm or first.attn_post_norm or first.ffn_post_norm or first.attn_norm is None):
        problems.append("a single-sublayer block needs one input norm and no other")
    if sum(x is not None for x in (conv, ssm, deltanet)) > 1:
        problems.append("more than one kind of token mixer beside attention")
    if deltanet is not None and (deltanet.conv_kernel < 2 or deltanet.n_v_head % deltanet.n_k_head):
        problems.append(f"a delta-net of {deltanet.n_v_head} v heads, {deltanet.n_k_head} k heads")
    if (deltanet is not None) != any(lay.attention.output_gate for lay in ir.attention_layers):
        problems.append("gated attention outside a delta-net hybrid, or a delta-net beside ungated attention")
    if conv is not None and conv.kernel < 2:
        problems.append(f"a convolution of length {conv.kernel} (at least 2)")
    if (conv or ssm or deltanet) is not None and first.wiring not in (Wiring.SEQUENTIAL, Wiring.SINGLE):
        problems.append("convolution, Mamba-2 or delta-net layers in a parallel block")
    if ssm is not None and (ssm.conv_kernel < 2 or ssm.n_head % ssm.n_group or ssm.n_inner % ssm.n_head):
        problems.append(f"a Mamba-2 mixer of {ssm.n_head} heads, {ssm.n_group} groups, convolution {ssm.conv_kernel}")
    if att is not None:
        problems += _attention_problems(att)
    for mlp in dict.fromkeys(lay.mlp for lay in ir.layers if lay.mlp is not None):
        if (mlp.kind is MLPKind.MOE) != bool(mlp.router):
            problems.append("a mixture of experts without a router (or a router outside one)")
        if (
            mlp.kind is not MLPKind.MOE
            and (mlp.kind is MLPKind.GATED) != bool(mlp.gate)
            or (mlp.gate_bias and not mlp.gate)
        ):
            problems.append(f"a {mlp.kind.value} MLP with{'out' if not mlp.gate else ''} a gate tensor")
        if mlp.activation is Activation.SWIGLU_OAI and not (mlp.kind is MLPKind.MOE and mlp.gate):
            problems.append("swiglu_oai outside a gated mixture of experts")
        if mlp.router and mlp.router.weight_inputs and mlp.router.n_expert_used != 1:
            problems.append("routing weights on the experts' inputs with more than one expert per token")
        if mlp.shared_gate and not mlp.shared:
            problems.append("a shared expert's gate without a shared expert")
        if mlp.shared and (mlp.shared.kind is not MLPKind.GATED or mlp.activation is Activation.SWIGLU_OAI):
            problems.append("a shared expert other than a gated MLP, or beside swiglu_oai experts")
        if mlp.branch_norms and not mlp.shared:
            problems.append("norms of a shared expert and routed experts without a shared expert")
        if mlp.gate_up_fused and (mlp.gate or mlp.gate_bias or mlp.up_bias or mlp.activation is Activation.SWIGLU_OAI):
            problems.append("experts' gate and up stacked in one tensor beside a gate tensor, biases or swiglu_oai")
    dense, moe = _ffn_kinds(ir)
    if dense and moe and (dense.kind is not MLPKind.GATED or dense.activation is not moe.activation):
        problems.append("dense layers beside expert layers need a gated MLP of the same activation")
    if dense and moe and (ir.altup is not None or any(_sparsity(lay) for lay in ir.layers)):
        problems.append("dense layers beside expert layers in the AltUp block or with activation sparsity")
    if dense and moe and first.wiring is not Wiring.SEQUENTIAL:
        problems.append("dense layers beside expert layers in a parallel block")
    if first.wiring is Wiring.PARALLEL and (first.attn_norm is None or first.attn_post_norm or first.ffn_post_norm):
        problems.append("a parallel block needs an input norm and has no post-norms")
    if att is None and (ir.altup is not None or first.wiring is not Wiring.SINGLE or _ffn_kinds(ir) != (None, None)):
        problems.append("a model without attention outside a single-sublayer block of Mamba-2 alone")
    problems += _altup_problems(ir) if att is not None else []
    problems += _per_layer_problems(ir, att)
    if problems:
        raise UnsupportedModelError(f"{ir.source_file}: the templates cannot render " + "; ".join(problems))


def _per_layer_problems(ir: ModelIR, att) -> list[str]:
    """What the templates cannot render of sizes that differ by layer, per-layer inputs and output scales."""
    first, problems = ir.layers[0], []
    if _varying_heads(ir) and (att.kv_layer is None or att.latent is not None or ir.altup is not None or _hybrid(ir)):
        problems.append("head counts or sizes that differ by layer outside the shared-KV attention of a plain block")
    if _varying_ffn(ir) and (first.mlp.kind is not MLPKind.GATED or any(_sparsity(lay) for lay in ir.layers)):
        problems.append("MLP widths that differ by layer outside a gated MLP without sparsity")
    gated = [lay.per_layer_gate is not None for lay in ir.layers]
    plain = first.wiring is Wiring.SEQUENTIAL and ir.altup is None
    if any(gated) and not (all(gated) and plain and ir.per_layer_input is not None):
        problems.append("per-layer input gates need every layer of a sequential block and the per-layer inputs")
    if ir.per_layer_input is not None and ir.altup is None and not any(gated):
        problems.append("per-layer inputs that no layer adds")
    if first.out_scale and not plain:
        problems.append("a layer output scale outside a sequential block")
    if att is not None and att.kv_layer is not None and _hybrid(ir):
        problems.append("shared KV caches beside other token mixers")
    return problems


def _values_from_keys(ir: ModelIR) -> str | None:
    """Which attention layers take their values from their keys' projection, having no v: "all", "some" or None."""
    if not ir.attention_layers or ir.attention_layers[0].attention.qkv or ir.attention_layers[0].attention.latent:
        return None
    without = [lay.attention.v is None for lay in ir.attention_layers]
    return "all" if all(without) else "some" if any(without) else None


def _hybrid(ir: ModelIR) -> bool:
    return any(x is not None for x in (_conv(ir), _ssm(ir), _deltanet(ir))) or ir.layers[0].wiring is Wiring.SINGLE


def _attention_problems(att) -> list[str]:
    """What the attention templates cannot render of the model's attention (its first attention layer's)."""
    problems = []
    if att.head_dim_v != att.head_dim and att.latent is None:
        problems.append(f"value heads of {att.head_dim_v} != key heads of {att.head_dim}")
    problems += _latent_problems(att)
    if att.rope.scaling not in RENDERABLE_ROPE_SCALING:
        problems.append(f"RoPE scaling {att.rope.scaling.value!r}")
    if (att.rope.freq_factors is not None) != (att.rope.scaling in (RopeScaling.LLAMA3, RopeScaling.LONGROPE)):
        problems.append("RoPE frequency factors without a scaling kind that reads them")
    if (att.rope.freq_factors_short is not None) != (att.rope.scaling is RopeScaling.LONGROPE):
        problems.append("short RoPE factors outside LongRoPE")
    if att.rope.ext_factor and att.rope.scaling is not RopeScaling.YARN:
        problems.append("a RoPE extrapolation factor outside YaRN")
    # the shared-KV attention takes a layer's values from its keys' projection where it has no v (gemma4)
    has_v = att.v or att.kv_layer is not None
    if att.latent is None and (
        bool(att.qkv) == bool(att.q or att.k or att.v) or not (att.qkv or (att.q and att.k and has_v))
    ):
        problems.append("attention needs either a fused qkv projection or all of q, k and v")
    if att.qkv_bias and not att.qkv or (att.q_bias or att.k_bias or att.v_bias) and att.qkv:
        problems.append("attention biases that do not match its projections")
    if bool(att.q_norm) != bool(att.k_norm):
        problems.append("a q norm without a k norm (or the reverse)")
    if att.group_size * att.n_kv_head != att.n_head:
        problems.append(f"{att.n_head} query heads are not a multiple of {att.n_kv_head} KV heads")
    return problems


def _latent_problems(att) -> list[str]:
    """What the latent attention template (deepseek2's component) cannot render."""
    lat = att.latent
    if lat is None:
        return []
    problems = []
    if att.qkv or att.q or att.k or att.v or att.q_norm or att.kv_layer is not None or att.output_gate:
        problems.append("latent attention beside q/k/v projections, q/k norms, KV sharing or an output gate")
    if att.qkv_bias or att.q_bias or att.k_bias or att.v_bias or att.out_bias or att.sinks:
        problems.append("latent attention with biases or sinks")
    if att.logit_softcap or att.prescale_queries or att.temperature or att.rotated_qk_norm or att.chunk:
        problems.append(
            "latent attention with a softcap, prescaled queries, a temperature, q/k normed after RoPE or chunks"
        )
    if att.n_kv_head != 1 or att.head_dim != lat.kv_lora_rank + att.rope.dim or att.head_dim_v != lat.kv_lora_rank:
        problems.append("latent attention whose cached row is not one head of [latent | RoPE part]")
    if att.rope.style is RopeStyle.NONE or att.rope.freq_factors_short:
        problems.append("latent attention without RoPE, or with LongRoPE")
    if bool(lat.q) == bool(lat.q_a or lat.q_b) or bool(lat.q_a) != bool(lat.q_b) or bool(lat.q_a) != bool(lat.q_a_norm):
        problems.append("latent attention needs attn_q, or attn_q_a with its norm and attn_q_b")
    return problems


RENDERABLE_ROPE_SCALING = tuple(RopeScaling)
DELTA_CHUNK = 64  # delta-net-base.cpp's chunk size for the gated delta rule


def _mixerless(layer: LayerSpec) -> LayerSpec:
    """What every layer of a hybrid shares: all but its token mixer and its FFN (checked per kind)."""
    return dataclasses.replace(_structure(layer), attention=None, conv=None, ssm=None, deltanet=None, mlp=None)


def _sparsity(lay: LayerSpec) -> float:
    return lay.mlp.sparsity_std if lay.mlp is not None else 0.0


def _activations(ir: ModelIR) -> list[Activation]:
    """The activation functions the module defines: the MLPs', and SiLU where a Mamba-2 or delta-net mixer gates."""
    dense, moe = _ffn_kinds(ir)
    acts = [(dense or moe).activation] if (dense or moe) else []
    if (_ssm(ir) or _deltanet(ir)) is not None and Activation.SILU not in acts:
        acts.append(Activation.SILU)
    return acts


def _ffn_kinds(ir: ModelIR) -> tuple[MLPSpec | None, MLPSpec | None]:
    """(the dense layers' MLP, the expert layers' MLP), None where the model has no such layer."""
    dense = next((lay.mlp for lay in ir.layers if lay.mlp is not None and lay.mlp.router is None), None)
    moe = next((lay.mlp for lay in ir.layers if lay.mlp is not None and lay.mlp.router is not None), None)
    return dense, moe


def _conv(ir: ModelIR):
    """The short convolution of a hybrid's convolution layers (the same in each), or None."""
    return next((lay.conv for lay in ir.layers if lay.conv is not None), None)


def _ssm(ir: ModelIR):
    """The Mamba-2 mixer of a hybrid's Mamba-2 layers (the same in each), or None."""
    return next((lay.ssm for lay in ir.layers if lay.ssm is not None), None)


def _deltanet(ir: ModelIR):
    """The gated delta-net of a hybrid's delta-net layers (the same in each), or None."""
    return next((lay.deltanet for lay in ir.layers if lay.deltanet is not None), None)


def _altup_problems(ir: ModelIR) -> list[str]:
    """What the AltUp block and the shared-KV attention templates (gemma3n's components) cannot render."""
    first = ir.layers[0]
    att, problems = ir.attention_layers[0].attention, []
    sparse = any(_sparsity(lay) for lay in ir.layers)
    if sparse and first.mlp.kind is not MLPKind.GATED:
        problems.append("activation sparsity outside a gated MLP")
    if att.v_norm is not None and att.kv_layer is None:
        problems.append("a value norm outside the shared-KV attention")
    if att.kv_layer is not None:
        if not (att.q and att.k) or att.q_bias or att.k_bias or att.v_bias or att.out_bias:
            problems.append("shared-KV attention needs q and k (and v) projections without biases")
        if att.q_norm is None or att.v_norm is None or att.qk_norm_scope is not QKNormScope.HEAD:
            problems.append("shared-KV attention needs per-head q/k norms and a value norm")
        if (
            att.logit_softcap
            or att.prescale_queries
            or att.rope.freq_factors_short
            or att.temperature
            or att.rotated_qk_norm
            or att.chunk
        ):
            problems.append(
                "shared-KV attention with a logit softcap, prescaled queries, LongRoPE, a temperature, q/k normed "
                "after RoPE or chunks"
            )
        if any(lay.attention.rope.style is RopeStyle.NONE for lay in ir.layers):
            problems.append("shared-KV attention on layers without RoPE")
        for lay in ir.layers:
            src = lay.attention.kv_layer
            if not 0 <= src <= lay.index or ir.layers[src].attention.kv_layer != src:
                problems.append(f"layer {lay.index} reads the KV cache of layer {src}, which does not write one")
    altup_wired = first.wiring is Wiring.ALTUP
    if altup_wired != (ir.altup is not None) or altup_wired != (first.altup is not None):
        problems.append("AltUp streams, AltUp layers and the AltUp block must come together")
    if (first.laurel is not None) != altup_wired:
        problems.append("LAuReL only inside the AltUp block, which has it")
    if altup_wired:
        if att.kv_layer is None or first.mlp.kind is not MLPKind.GATED:
            problems.append("the AltUp block needs the shared-KV attention and a gated MLP")
        if None in (first.attn_norm, first.ffn_norm, first.attn_post_norm, first.ffn_post_norm):
            problems.append("the AltUp block needs input and post norms around attention and the MLP")
        if first.residual_scale != 1.0 or ir.embedding.positions or ir.altup.n_streams < 2:
            problems.append("the AltUp block with a residual scale, learned positions or fewer than 2 streams")
    return problems


def _constant_rows(ir: ModelIR) -> list[tuple[str, object, str]]:
    """(name, value, comment) for every configuration constant of the generated module, in file order."""
    first = ir.layers[0]
    att = ir.attention_layers[0].attention if ir.attention_layers else None
    dense, moe = _ffn_kinds(ir)
    mixed = dense is not None and moe is not None
    mlp = dense or moe  # N_FF: the dense layers' width beside experts
    style = _rope_style(ir)
    rows = [
        ("ARCHITECTURE", ir.architecture, ""),
        ("N_VOCAB", ir.n_vocab, ""),
        ("N_EMBD", ir.n_embd, ""),
        ("N_LAYER", ir.n_layer, ""),
    ]
    if att is not None and _varying_heads(ir):
        rows += [
            ("N_HEAD", tuple(_per_attention(ir, lambda a: a.n_head, 0)), "per layer"),
            ("N_KV_HEAD", tuple(_per_attention(ir, lambda a: a.n_kv_head, 0)), "per layer"),
            ("HEAD_DIM", tuple(_per_attention(ir, lambda a: a.head_dim, 0)), "per layer"),
            ("GROUP_SIZE", tuple(_per_attention(ir, lambda a: a.group_size, 0)), "per layer: query heads per KV head"),
        ]
    elif att is not None:
        rows += [
            ("N_HEAD", att.n_head, ""),
            ("N_KV_HEAD", att.n_kv_head, ""),
            ("HEAD_DIM", att.head_dim, ""),
            ("GROUP_SIZE", att.group_size, "query heads sharing one KV head"),
        ]
    if mlp is not None and _varying_ffn(ir):
        widths = tuple(lay.mlp.n_ff if lay.mlp is not None and lay.mlp.router is None else 0 for lay in ir.layers)
        rows.append(("N_FF", widths, "per layer"))
    elif mlp is not None:
        rows.append(("N_FF", mlp.n_ff, ""))
    rows += [("CONTEXT_LENGTH", ir.n_ctx_train, ""), ("NORM_EPS", ir.norm_eps, "")]
    if att is not None:
        rows.append(("SCORE_SCALE", att.score_scale, "multiplies q·k before the softmax"))
    if mixed:
        rows.append(("N_FF_EXP", moe.n_ff, "each expert's MLP width"))
        rows.append(("MOE_LAYERS", tuple(lay.mlp.router is not None for lay in ir.layers), "per layer: experts"))
    if moe:
        width = "N_FF_EXP" if mixed else "N_FF"
        rows.append(("N_EXPERT", moe.router.n_expert, f"experts per layer, each an MLP of width {width}"))
        rows.append(("N_EXPERT_USED", moe.router.n_expert_used, "experts each token is routed to"))
        if moe.shared:
            rows.append(("N_FF_SHARED", moe.shared.n_ff, "the shared expert's MLP width"))
        if moe.router.weight_scale != 1.0:
            rows.append(("EXPERT_WEIGHT_SCALE", moe.router.weight_scale, "multiplies the routing weights"))
        if moe.router.input_scale:
            # llama.cpp's 1.0f / sqrtf((float) n_embd), in float32
            scale = float(np.float32(1.0) / np.sqrt(np.float32(ir.n_embd)))
            rows.append(("ROUTER_INPUT_SCALE", scale, "the router reads rms_norm(x) times this, 1 / sqrt(N_EMBD)"))
        if moe.router.n_group:
            rows.append(("N_EXPERT_GROUP", moe.router.n_group, "groups of experts, each N_EXPERT / N_EXPERT_GROUP"))
            rows.append(("N_EXPERT_GROUP_USED", moe.router.n_group_used, "groups a token chooses its experts in"))
    if att is not None and att.temperature:
        t = att.temperature
        rows.append(("ATTN_TEMPERATURE_SCALE", t.scale, "q · (log(floor((p + offset) / length) + 1) · scale + 1)"))
        rows.append(("ATTN_TEMPERATURE_LENGTH", t.length, "positions per step of that factor"))
        rows.append(("ATTN_TEMPERATURE_OFFSET", t.offset, "added to the position p"))
    if att is not None and att.logit_softcap:
        rows.append(("ATTN_LOGIT_SOFTCAP", att.logit_softcap, "scores = cap · tanh(scores / cap)"))
    if ir.embedding.scale != 1.0:
        rows.append(("EMBED_SCALE", ir.embedding.scale, "token embeddings are scaled on input"))
    if first.residual_scale != 1.0:
        rows.append(("RESIDUAL_SCALE", first.residual_scale, "each branch is scaled before its residual add"))
    if ir.output.logit_scale != 1.0:
        rows.append(("LOGIT_SCALE", ir.output.logit_scale, "multiplies the logits"))
    if ir.output.final_softcap:
        rows.append(("FINAL_LOGIT_SOFTCAP", ir.output.final_softcap, "logits = cap · tanh(logits / cap)"))
    if att is not None:
        windows = tuple(_per_attention(ir, lambda a: a.sliding_window, 0))
        rows.append(("SLIDING_WINDOW", windows, "per layer; 0: all positions"))
    if any(lay.attention.chunk for lay in ir.attention_layers):
        chunks = tuple(_per_attention(ir, lambda a: a.chunk, 0))
        rows.append(("ATTENTION_CHUNK", chunks, "per layer: attends within chunks of this many positions; 0: none"))
    if style is not RopeStyle.NONE:
        if _varying_heads(ir):
            dims = tuple(_per_attention(ir, lambda a: a.rope.dim, 0))
            rows.append(("ROPE_DIM", dims, f"per layer: leading dims of each head RoPE rotates ({style.value} style)"))
        else:
            rows.append(
                ("ROPE_DIM", att.rope.dim, f"leading dims of each head that RoPE rotates ({style.value} style)")
            )
        rows.append(("ROPE_BASE", tuple(_per_attention(ir, lambda a: a.rope.base, 0.0)), "per layer"))
        rows.append(("ROPE_FREQ_SCALE", tuple(_per_attention(ir, lambda a: a.rope.freq_scale, 0.0)), "per layer"))
        rope = att.rope
        if rope.attn_factor != 1.0:
            rows.append(("ROPE_ATTN_FACTOR", rope.attn_factor, "multiplies cos and sin (the magnitude correction)"))
        if rope.ggml_attn_factor is not None:
            rows.append(("ROPE_GGML_ATTN_FACTOR", rope.ggml_attn_factor, "llama.cpp's share of ROPE_ATTN_FACTOR"))
        if rope.scaling is RopeScaling.YARN:
            rows.append(("YARN_EXT_FACTOR", rope.ext_factor, "how much of the extrapolated angle YaRN mixes in"))
            rows.append(("YARN_BETA_FAST", rope.beta_fast, ""))
            rows.append(("YARN_BETA_SLOW", rope.beta_slow, ""))
        if rope.scaling in (RopeScaling.YARN, RopeScaling.LONGROPE):
            rows.append(("ROPE_ORIG_CTX", rope.n_ctx_orig, "the context the model was originally trained for"))
        factor_layers = _rope_factor_layers(ir)
        if factor_layers is not None:
            rows.append(("ROPE_FACTOR_LAYERS", factor_layers, "per layer: whether it divides by the frequency factors"))
        rotates = tuple(_per_attention(ir, lambda a: a.rope.style is not RopeStyle.NONE, False))
        if not all(lay.attention.rope.style is not RopeStyle.NONE for lay in ir.attention_layers):
            rows.append(("ROPE_LAYERS", rotates, "per layer: whether it applies RoPE"))
    conv = _conv(ir)
    if conv is not None:
        rows.append(
            ("CONV_LAYERS", tuple(lay.conv is not None for lay in ir.layers), "per layer: a short convolution mixes")
        )
        rows.append(("CONV_KERNEL", conv.kernel, "positions a convolution output reads, the current one last"))
        rows.append(("LAYER_CACHES", ir.layer_caches(), "per layer: its caches, (kind, shape of a position's row)"))
    ssm = _ssm(ir)
    if ssm is not None:
        rows += [
            ("SSM_LAYERS", tuple(lay.ssm is not None for lay in ir.layers), "per layer: Mamba-2 mixes"),
            ("SSM_CONV", ssm.conv_kernel, "positions the convolution reads, the current one last"),
            ("SSM_INNER", ssm.n_inner, "x's width: SSM_HEAD · SSM_HEAD_DIM"),
            ("SSM_XBC", ssm.n_xbc, "the convolution's channels: x, B and C"),
            ("SSM_HEAD", ssm.n_head, ""),
            ("SSM_HEAD_DIM", ssm.head_dim, ""),
            ("SSM_GROUP", ssm.n_group, "B and C are shared by SSM_HEAD / SSM_GROUP heads each"),
            ("SSM_STATE", ssm.n_state, "the state's size per head and channel"),
            ("LAYER_CACHES", ir.layer_caches(), "per layer: its caches, (kind, shape of a position's row or a state)"),
            (
                "STATE_KINDS",
                ("conv_window", "ssm"),
                "the caches that hold one state per sequence, not a row per position",
            ),
        ]
    if first.wiring is Wiring.SINGLE:
        rows.append(("FFN_LAYERS", tuple(lay.mlp is not None for lay in ir.layers), "per layer: an MLP, not a mixer"))
    deltanet = _deltanet(ir)
    if deltanet is not None:
        rows += [
            ("DELTA_LAYERS", tuple(lay.deltanet is not None for lay in ir.layers), "per layer: a delta-net mixes"),
            ("DELTA_CONV", deltanet.conv_kernel, "positions the convolution reads, the current one last"),
            ("DELTA_K_HEAD", deltanet.n_k_head, "q and k heads"),
            ("DELTA_V_HEAD", deltanet.n_v_head, "v heads, each with its state"),
            ("DELTA_HEAD_DIM", deltanet.head_dim, "the size of every q, k and v head"),
            ("DELTA_QKV", deltanet.n_qkv, "[q | k | v]: the convolution's channels"),
            ("DELTA_CHUNK", DELTA_CHUNK, "tokens per chunk of the delta rule's chunked form (llama.cpp's)"),
            ("LAYER_CACHES", ir.layer_caches(), "per layer: its caches, (kind, shape of a position's row or a state)"),
            ("STATE_KINDS", ("conv_window", "delta"), "the caches that hold one state per sequence"),
        ]
    if att is not None and att.latent is not None:
        lat = att.latent
        rows += [
            ("KV_LORA_RANK", lat.kv_lora_rank, "the latent each position's keys and values are compressed to"),
            ("HEAD_DIM_NOPE", lat.head_dim_nope, "per query head: the part without RoPE, read through attn_k_b"),
            ("HEAD_DIM_V", lat.head_dim_v, "per head: the value size after attn_v_b"),
            (
                "LAYER_CACHES",
                ir.layer_caches(),
                "per layer: its cache, one row of [latent | RoPE part] per position, keys and values in one",
            ),
        ]
    if ir.tap_names:
        rows.append(("TAP_NAMES", ir.tap_names, "(tap, llama.cpp's name for that tensor in this family's graph)"))
    if att is not None and _varying_heads(ir):
        rows.append(("LAYER_CACHES", ir.layer_caches(), "per KV cache: (kind, shape of a position's row)"))
    if att is not None and att.kv_layer is not None:
        rows.append(("N_KV_CACHE", len(ir.kv_cache_layers), "KV caches: fewer than layers when layers share them"))
        rows.append(("KV_CACHE_OF", ir.kv_cache_of, "per layer: the KV cache its attention reads"))
        writes = tuple(lay.attention.kv_layer == lay.index for lay in ir.layers)
        rows.append(("WRITES_KV", writes, "per layer: computes and caches keys/values"))
        if _values_from_keys(ir) == "some":
            from_keys = tuple(_per_attention(ir, lambda a: a.v is None, False))
            rows.append(("VALUES_FROM_KEYS", from_keys, "per layer: its values are its keys' projection (no attn_v)"))
    if any(_sparsity(lay) for lay in ir.layers):
        sparsity = tuple(_sparsity(lay) for lay in ir.layers)
        rows.append(("ACTIVATION_SPARSITY", sparsity, "per layer, see gaussian_topk; 0: dense"))
    if ir.altup is not None:
        rows += [
            ("N_ALTUP", ir.altup.n_streams, "residual streams (AltUp); stream 0 is the active one"),
            ("ALTUP_ROUTER_SCALE", first.altup.router_scale, "multiplies the router's normed input"),
            *_per_layer_input_rows(ir),
            ("LAUREL_JOIN_SCALE", first.laurel.join_scale, "(attention + LAuReL) are joined times this"),
        ]
    elif ir.per_layer_input is not None:
        rows += _per_layer_input_rows(ir)
    return rows


def _per_layer_input_rows(ir: ModelIR) -> list[tuple[str, object, str]]:
    pli = ir.per_layer_input
    return [
        ("PER_LAYER_WIDTH", pli.width, "size of each layer's per-layer input"),
        ("PER_LAYER_TOKEN_SCALE", pli.token_scale, "multiplies the per-layer token embeddings"),
        ("PER_LAYER_PROJ_SCALE", pli.proj_scale, "multiplies the per-layer projection of the embedding"),
        ("PER_LAYER_INPUT_SCALE", pli.sum_scale, "multiplies their sum"),
    ]


def _varying_heads(ir: ModelIR) -> bool:
    """Whether the attention layers differ in their head counts or sizes (gemma4's sliding and global layers)."""
    sizes = {(lay.attention.n_head, lay.attention.n_kv_head, lay.attention.head_dim) for lay in ir.attention_layers}
    return len(sizes | {0}) > 2 or len({lay.attention.rope.dim for lay in ir.attention_layers}) > 1


def _varying_ffn(ir: ModelIR) -> bool:
    """Whether the dense MLPs differ in width (gemma4's double-wide MLPs of the KV-sharing layers)."""
    return len({lay.mlp.n_ff for lay in ir.layers if lay.mlp is not None and lay.mlp.router is None}) > 1


def _rope_factor_layers(ir: ModelIR) -> tuple[bool, ...] | None:
    """Per layer whether its RoPE divides by frequency factors, where only some layers do (gemma4's global
    layers), else None."""
    flags = tuple(_per_attention(ir, lambda a: a.rope.freq_factors is not None, False))
    return flags if len({f for f, lay in zip(flags, ir.layers) if lay.attention is not None}) > 1 else None


def _per_attention(ir: ModelIR, value, other) -> list:
    """A per-layer number of the attention layers; `other` for the layers that mix tokens otherwise."""
    return [other if lay.attention is None else value(lay.attention) for lay in ir.layers]


def module_constants(ir: ModelIR) -> dict:
    """The configuration constants a generated module defines, name -> value, each exactly as the IR says.

    The template renders them and the auditor compares a module's literals against them: one mapping."""
    check_renderable(ir)
    return (
        {name: value for name, value, _ in _constant_rows(ir)} | {"DATA_OFFSET": ir.data_offset} | _snapshot_tables(ir)
    )


def _snapshot_tables(ir: ModelIR) -> dict:
    """A snapshot's files (name, size) and each tensor's (file, transform); nothing for a GGUF file."""
    if not ir.source_files:
        return {}
    tables = {
        "SOURCE_FILES": tuple(tuple(f) for f in ir.source_files),
        "TENSOR_FILES": {t.name: (t.file, tuple(t.transform)) for t in ir.tensors},
    }
    quantized = {t.name: _tuples(t.quant) for t in ir.tensors if t.quant}
    stacked = {t.name: _tuples(t.parts) for t in ir.tensors if t.parts}
    return tables | ({"MLX_QUANTIZED": quantized} if quantized else {}) | ({"TENSOR_PARTS": stacked} if stacked else {})


def _tuples(value):
    """Nested lists (as an IR read back from JSON has them) as the tuples the module's literals are."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def template_context(ir: ModelIR) -> dict:
    check_renderable(ir)
    first = ir.layers[0]
    att = ir.attention_layers[0].attention if ir.attention_layers else None
    style = _rope_style(ir)
    q_norm = att.q_norm if att is not None else None
    norms = [first.attn_norm, first.ffn_norm, first.attn_post_norm, first.ffn_post_norm, q_norm, ir.output.norm]
    rotated_qk_norm = att is not None and att.rotated_qk_norm
    norm_kinds = sorted({n.kind.value for n in norms if n is not None} | ({"rms"} if rotated_qk_norm else set()))
    dense, moe = _ffn_kinds(ir)
    mixed = dense is not None and moe is not None
    if att is not None and _varying_heads(ir):
        summary = (
            f"{ir.n_layer} layers, d_model {ir.n_embd}, query and KV heads and their size per layer (N_HEAD, "
            f"N_KV_HEAD, HEAD_DIM), vocabulary {ir.n_vocab}."
        )
    elif att is not None:
        summary = (
            f"{ir.n_layer} layers, d_model {ir.n_embd}, {att.n_head} query heads / {att.n_kv_head} KV heads of size "
            f"{att.head_dim}, vocabulary {ir.n_vocab}."
        )
    else:
        summary = f"{ir.n_layer} layers, d_model {ir.n_embd}, no attention, vocabulary {ir.n_vocab}."
    conv = _conv(ir)
    if conv is not None:
        n_conv = sum(lay.conv is not None for lay in ir.layers)
        summary += f"\n{n_conv} of the layers mix tokens with a short convolution of length {conv.kernel}."
    if att is not None and att.latent is not None:
        summary += (
            f"\nLatent attention: keys and values of every head from one cached row of {att.head_dim} per position "
            f"(a latent of {att.latent.kv_lora_rank} and {att.rope.dim} RoPE dims)."
        )
    deltanet = _deltanet(ir)
    if deltanet is not None:
        n_delta = sum(lay.deltanet is not None for lay in ir.layers)
        summary += (
            f"\n{n_delta} of the layers mix tokens with a gated delta-net: {deltanet.n_v_head} states of "
            f"{deltanet.head_dim}x{deltanet.head_dim}, {deltanet.n_k_head} k heads."
        )
    ssm = _ssm(ir)
    if ssm is not None:
        n_ssm = sum(lay.ssm is not None for lay in ir.layers)
        summary += (
            f"\n{n_ssm} of the layers mix tokens with Mamba-2: {ssm.n_head} heads of {ssm.head_dim}, state "
            f"{ssm.n_state}, {ssm.n_group} groups."
        )
    # the first attention layer that divides by RoPE frequency factors (gemma4's global layers), else the first's
    factored = next((lay.attention for lay in ir.attention_layers if lay.attention.rope.freq_factors), None)
    altup = ir.altup is not None
    if altup:
        n_sparse = sum(1 for lay in ir.layers if _sparsity(lay))
        n_shared = ir.n_layer - len(ir.kv_cache_layers)
        summary += (
            f"\nAltUp: {ir.altup.n_streams} residual streams; a per-layer input of {ir.per_layer_input.width} "
            f"for every layer; LAuReL beside attention;\n{n_sparse} layers with activation sparsity; "
            f"{n_shared} layers attending to an earlier layer's KV cache."
        )
    if ir.per_layer_input is not None and not altup:
        n_shared = ir.n_layer - len(ir.kv_cache_layers)
        summary += (
            f"\nA per-layer input of {ir.per_layer_input.width} for every layer, added after its MLP; {n_shared} "
            "layers attending to an earlier layer's KV cache."
        )
    return dict(
        attention_template=(
            None
            if att is None
            else "attention_latent" if att.latent else "attention" if att.kv_layer is None else "attention_shared_kv"
        ),
        block_components=(["laurel"] if first.laurel else [])
        + (["altup"] if altup else [])
        + (["per_layer_gate"] if first.per_layer_gate else []),
        forward_template="forward_altup" if altup else "forward",
        sparse_mlp=any(_sparsity(lay) for lay in ir.layers),
        sparsity_ddof=next((lay.mlp.sparsity_ddof for lay in ir.layers if _sparsity(lay)), 1),
        altup=ir.altup,
        arch=ir.architecture,
        summary=summary,
        model_name=ir.model_name,
        source_file=ir.source_file,
        source_sha256=ir.source_sha256,
        file_size=ir.file_size,
        data_offset=ir.data_offset,
        snapshot=_snapshot_tables(ir),
        generator=f"alchemist {__version__}",
        ir_hash=ir.ir_hash(),
        constants=_constant_rows(ir),
        norm_kinds=norm_kinds,
        primitives=_primitives(ir, style, norm_kinds),
        activations=[act.value for act in _activations(ir)],
        act_fn=ACTIVATION_FUNCTIONS[_activations(ir)[0]],
        rope=style is not RopeStyle.NONE,
        rope_style=style.value,
        rope_layers=any(lay.attention.rope.style is RopeStyle.NONE for lay in ir.attention_layers)
        and style is not RopeStyle.NONE,
        conv=conv,
        ssm=ssm,
        deltanet=deltanet,
        recurrent=ssm is not None or deltanet is not None,
        hybrid=_hybrid(ir) or att is not None and att.latent is not None,
        latent=att.latent if att is not None else None,
        side_by_side=ssm is not None and all(lay.attention is not None for lay in ir.layers),
        tap_names=bool(ir.tap_names),
        rope_factors=factored.rope.freq_factors if factored is not None else None,
        rope_scaling=(factored or att).rope.scaling.value if att is not None else None,
        rope_factor_layers=_rope_factor_layers(ir) is not None,
        varying_heads=att is not None and _varying_heads(ir),
        per_layer_input=ir.per_layer_input,
        kv_shared=att is not None and att.kv_layer is not None,
        values_from_keys=_values_from_keys(ir),
        att_v=next((lay.attention.v for lay in ir.attention_layers if lay.attention.v), None),
        rope_factors_short=att.rope.freq_factors_short if att is not None else None,
        rope_attn_factor=att.rope.attn_factor if att is not None else 1.0,
        layer=first,
        att=att,
        mlp=dense or moe,  # the dense one beside experts
        moe=moe,
        mixed_ffn=mixed,
        chunks=any(lay.attention.chunk for lay in ir.attention_layers),
        embedding=ir.embedding,
        output=ir.output,
        tensors=ir.tensors,
        metadata=ir.metadata,
    )


def _primitives(ir: ModelIR, style: RopeStyle, norm_kinds: list[str]) -> list[str]:
    """The fields of alchemist.kernels.Primitives the module defines (its EXACT bundle), in the dataclass's order."""
    from dataclasses import fields

    from alchemist.kernels.primitives import Primitives

    defined = {"project", *(ACTIVATION_FUNCTIONS[act] for act in _activations(ir))}
    if ir.attention_layers:
        defined.add("causal_attention")
    defined |= {f"{kind}_norm" for kind in norm_kinds}
    if _ffn_kinds(ir)[1] is not None:
        defined.add("project_experts")
    if ir.attention_layers and ir.attention_layers[0].attention.latent is not None:
        defined.add("project_heads")
    if style is not RopeStyle.NONE:
        defined |= {"rope_angles", "rope"}
    return [f.name for f in fields(Primitives) if f.name in defined]


ACTIVATION_FUNCTIONS = {
    Activation.SILU: "silu",
    Activation.GELU_TANH: "gelu",
    Activation.SWIGLU_OAI: "swiglu_oai",
    Activation.RELU_SQR: "relu_sqr",
}


def render_module(ir: ModelIR) -> str:
    """Source text of the generated module for `ir`: rendered, black-formatted, libcst-parseable.

    Remembered on disk by the IR's repr and the renderer's sources (rendering the template takes ~0.1 s, which
    every new process opening a model would pay before its first token)."""
    key = hashlib.sha256(f"{_renderer_digest()}\0{ir!r}".encode()).hexdigest()
    return _remembered_text(
        "rendered", key, lambda: _format(_environment().get_template("model.py.j2").render(**template_context(ir)))
    )


def _remembered_text(subdir: str, key: str, make) -> str:
    """The text remembered under alchemist's cache `subdir`/`key`.py, else make() (then remembered)."""
    from alchemist.paths import cache_subdir, remember

    memo = cache_subdir(subdir) / f"{key}.py"
    try:
        return memo.read_text()
    except OSError:
        pass
    text = make()
    remember(memo, text)
    return text


def _renderer_digest() -> str:
    """sha256 over what turns an IR into source text: this module, the IR's classes, Primitives, the templates,
    black. Read on every render (~1 ms), so a template edited while a process runs is never remembered under
    the digest of its previous text."""
    digest = hashlib.sha256(f"{__version__}\0{black.__version__}\0{BLACK_MODE}".encode())
    primitives = Path(__file__).parents[1] / "kernels" / "primitives.py"  # EXACT's fields and their order
    for path in [Path(__file__), Path(ir_module.__file__), primitives, *sorted(TEMPLATES_DIR.rglob("*"))]:
        if path.is_file():
            digest.update(f"\0{path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _format(raw: str) -> str:
    """black-format `raw` and check that libcst parses it; remembered on disk by the raw text's sha256
    (black and libcst take 0.5 s for a model module, on every load_llm otherwise)."""
    key = hashlib.sha256(f"{black.__version__}\0{BLACK_MODE}\0{raw}".encode()).hexdigest()
    return _remembered_text("formatted", key, lambda: _formatted(raw))


def _formatted(raw: str) -> str:
    source = black.format_str(raw, mode=BLACK_MODE)
    libcst.parse_module(source)  # raises on anything that is not valid Python
    return source
