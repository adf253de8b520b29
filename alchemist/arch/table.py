"""Tensor tables: which GGUF tensors a family has, what each is for, and its shape.

In the spirit of gguf-py's MODEL_TENSORS and llama.cpp's `create_tensor`: a family's table is a tuple of
`TensorSpec`s, usually a sum of the shared groups below. Binding the IR, writing a fixture and auditing a
generated module all read this one table; a tensor list is never written anywhere else.

A shape is a tuple of dimension names (numpy order, GGUF `ne` reversed), resolved by `Dims`. A tensor is
required, or optional (llama.cpp's TENSOR_NOT_REQUIRED): an optional tensor's presence switches on what it
feeds (a bias, a norm, an untied output), and its presence must be the same in every layer (unless the table
says the file chooses per layer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

LAYER_PREFIX = "blk.{il}."
ALTUP_STREAMS, PER_LAYER_WIDTH, LAUREL_RANK = 4, 256, 64  # llama_hparams: n_altup, n_embd_altup, laurel_rank


@dataclass(frozen=True)
class TensorSpec:
    name: str  # "token_embd.weight", or "blk.{il}.attn_q.weight" for one per layer
    role: str  # linear | embedding | position_embedding | norm | bias | rope_factors
    shape: tuple[str, ...]  # dimension names, numpy order
    required: bool = True
    mixer: str | None = None  # per-layer tensor of only the layers that mix tokens this way ("attention", "conv")
    ffn: str | None = None  # per-layer tensor of only the layers whose FFN is of this kind ("dense", "moe")
    # per-layer tensor of only the multi-token-prediction layers past n_layer (loaded, never applied)
    mtp: bool = False
    # one of a family's alternatives for a component ("dense" or "moe" FFN): required only in files that have
    # that alternative (the file's layer 0 holds one of its tensors); "" for a tensor of every file
    alternative: str = ""
    # an optional per-layer tensor the file may have in some layers only (gemma4's attn_v: the global layers of the
    # larger models take their values from their keys); False: in every layer or none
    per_layer_choice: bool = False

    @property
    def per_layer(self) -> bool:
        return self.name.startswith(LAYER_PREFIX)

    @property
    def suffix(self) -> str:
        """The name within a block (`attn_q.weight`), or the whole name of a global tensor."""
        return self.name[len(LAYER_PREFIX) :] if self.per_layer else self.name

    def optional(self) -> TensorSpec:
        return replace(self, required=False)

    def in_layer(self, il: int, mixers=None, ffns=None, n_main: int | None = None) -> bool:
        """Whether block il holds this per-layer tensor: by the block's token mixer (`mixers`), its FFN kind
        (`ffns`), and whether it is a multi-token-prediction block (il >= n_main; None: there are none)."""
        return (
            (self.mixer is None or bool(mixers) and mixers[il] == self.mixer)
            and (self.ffn is None or bool(ffns) and ffns[il] == self.ffn)
            and (not self.mtp or n_main is not None and il >= n_main)
        )


@dataclass(frozen=True)
class Dims:
    """Every dimension name a table may use, from the hyperparameters."""

    n_vocab: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    rope_dim: int
    n_ctx: int
    conv_kernel: int = 0  # a short convolution's length (lfm2's shortconv.l_cache)
    n_expert: int = 0  # mixture of experts: experts per layer
    n_ff_exp: int = 0  # mixture of experts: each expert's FFN width
    n_ff_shexp: int = 0  # mixture of experts: the shared expert's FFN width
    n_layer: int = 0
    # a Mamba-2 mixer (llama_hparams ssm_*): conv length, inner width, state size per head, heads, groups
    ssm_conv: int = 0
    ssm_inner: int = 0
    ssm_state: int = 0
    ssm_head: int = 0
    ssm_group: int = 0
    # multi-head latent attention (llama_hparams n_lora_q, n_lora_kv, n_embd_head_k_mla, n_embd_head_v_mla)
    q_lora: int = 0
    kv_lora: int = 0
    head_dim_mla: int = 0
    head_dim_v_mla: int = 0
    # per-layer inputs' width where the file says it (gemma4's embedding_length_per_layer_input; 0: gemma3n's constant)
    n_embd_per_layer: int = 0

    def resolve(self, shape: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(self.size(name) for name in shape)

    def size(self, name: str) -> int:
        derived = {
            "n_q": self.n_head * self.head_dim,
            "n_kv": self.n_kv_head * self.head_dim,
            "n_qkv": (self.n_head + 2 * self.n_kv_head) * self.head_dim,
            "n_ff2": 2 * self.n_ff,
            "n_ff_exp2": 2 * self.n_ff_exp,
            "rope_half": self.rope_dim // 2,
            "n_embd3": 3 * self.n_embd,
            "n_embd2": 2 * self.n_embd,
            # gemma3n's sizes, constants of llama_hparams (n_altup, n_embd_altup, laurel_rank), not metadata
            "n_altup": ALTUP_STREAMS,
            "n_altup_in": ALTUP_STREAMS - 1,
            "n_altup_sq": ALTUP_STREAMS * ALTUP_STREAMS,
            "per_layer_width": self.n_embd_per_layer or PER_LAYER_WIDTH,
            "per_layer_all": self.n_layer * (self.n_embd_per_layer or PER_LAYER_WIDTH),
            "laurel_rank": LAUREL_RANK,
            # Mamba-2: in_proj gives [z | x B C | dt]; the convolution runs over x B C
            "ssm_in": 2 * self.ssm_inner + 2 * self.ssm_group * self.ssm_state + self.ssm_head,
            "ssm_xbc": self.ssm_inner + 2 * self.ssm_group * self.ssm_state,
            "ssm_group_width": self.ssm_inner // max(self.ssm_group, 1),
            "one": 1,
            # a gated delta-net: [q | k | v] of ssm_group k heads and ssm_head v heads, each ssm_state wide
            "dn_qkv": 2 * self.ssm_group * self.ssm_state + self.ssm_inner,
            "dn_head": self.ssm_inner // max(self.ssm_head, 1),
            "dn_qkvz": 2 * self.ssm_group * self.ssm_state + 2 * self.ssm_inner,
            "ssm_head2": 2 * self.ssm_head,
            "n_q_gated": 2 * self.n_head * self.head_dim,
            # latent attention: [latent | k_pe] per position; queries [not rotated | rotated] per head
            "kv_a": self.kv_lora + self.rope_dim,
            "qk_nope": self.head_dim_mla - self.rope_dim,
            "n_q_mla": self.n_head * self.head_dim_mla,
            "n_v_mla": self.n_head * self.head_dim_v_mla,
        }
        if name in derived:
            return derived[name]
        return getattr(self, name)


def T(name: str, role: str, *shape: str) -> TensorSpec:
    return TensorSpec(name, role, shape)


def optional(*specs: TensorSpec) -> tuple[TensorSpec, ...]:
    return tuple(s.optional() for s in specs)


def _blk(name: str) -> str:
    return LAYER_PREFIX + name


# --- groups that families add up -------------------------------------------------------------------------
TOKEN_EMBD = (T("token_embd.weight", "embedding", "n_vocab", "n_embd"),)
OUTPUT_NORM = (T("output_norm.weight", "norm", "n_embd"),)
OUTPUT_NORM_BIAS = (T("output_norm.bias", "bias", "n_embd"),)
OUTPUT = optional(T("output.weight", "linear", "n_vocab", "n_embd"))  # absent: tied to token_embd
POSITION_EMBD = (T("position_embd.weight", "position_embedding", "n_ctx", "n_embd"),)
ROPE_FREQS = optional(T("rope_freqs.weight", "rope_factors", "rope_half"))  # llama3 frequency divisors
ROPE_FACTORS = optional(
    T("rope_factors_long.weight", "rope_factors", "rope_half"),
    T("rope_factors_short.weight", "rope_factors", "rope_half"),
)

ATTN_NORM = (T(_blk("attn_norm.weight"), "norm", "n_embd"),)
ATTN_NORM_BIAS = (T(_blk("attn_norm.bias"), "bias", "n_embd"),)
FFN_NORM = (T(_blk("ffn_norm.weight"), "norm", "n_embd"),)
FFN_NORM_BIAS = (T(_blk("ffn_norm.bias"), "bias", "n_embd"),)
ATTN_POST_NORM = (T(_blk("post_attention_norm.weight"), "norm", "n_embd"),)
FFN_POST_NORM = (T(_blk("post_ffw_norm.weight"), "norm", "n_embd"),)

ATTN_QKV_SPLIT = (
    T(_blk("attn_q.weight"), "linear", "n_q", "n_embd"),
    T(_blk("attn_k.weight"), "linear", "n_kv", "n_embd"),
    T(_blk("attn_v.weight"), "linear", "n_kv", "n_embd"),
)
ATTN_QKV_BIAS = (
    T(_blk("attn_q.bias"), "bias", "n_q"),
    T(_blk("attn_k.bias"), "bias", "n_kv"),
    T(_blk("attn_v.bias"), "bias", "n_kv"),
)
ATTN_QKV_FUSED = (T(_blk("attn_qkv.weight"), "linear", "n_qkv", "n_embd"),)
ATTN_QKV_FUSED_BIAS = (T(_blk("attn_qkv.bias"), "bias", "n_qkv"),)
ATTN_OUT = (T(_blk("attn_output.weight"), "linear", "n_embd", "n_q"),)
ATTN_OUT_BIAS = (T(_blk("attn_output.bias"), "bias", "n_embd"),)
# q/k norms: over each head (one weight shared by the heads), or over the whole projection
QK_NORM_HEAD = (T(_blk("attn_q_norm.weight"), "norm", "head_dim"), T(_blk("attn_k_norm.weight"), "norm", "head_dim"))
QK_NORM_HEAD_ROWS = (  # one weight row per head (stablelm, command-r)
    T(_blk("attn_q_norm.weight"), "norm", "n_head", "head_dim"),
    T(_blk("attn_k_norm.weight"), "norm", "n_kv_head", "head_dim"),
)
QK_NORM_FULL = (T(_blk("attn_q_norm.weight"), "norm", "n_q"), T(_blk("attn_k_norm.weight"), "norm", "n_kv"))

FFN_GATED = (
    T(_blk("ffn_gate.weight"), "linear", "n_ff", "n_embd"),
    T(_blk("ffn_up.weight"), "linear", "n_ff", "n_embd"),
    T(_blk("ffn_down.weight"), "linear", "n_embd", "n_ff"),
)
FFN_GATED_BIAS = (
    T(_blk("ffn_gate.bias"), "bias", "n_ff"),
    T(_blk("ffn_up.bias"), "bias", "n_ff"),
    T(_blk("ffn_down.bias"), "bias", "n_embd"),
)
FFN_FUSED_GATED = (  # ffn_up holds [gate | up]
    T(_blk("ffn_up.weight"), "linear", "n_ff2", "n_embd"),
    T(_blk("ffn_down.weight"), "linear", "n_embd", "n_ff"),
)
FFN_PLAIN = (
    T(_blk("ffn_up.weight"), "linear", "n_ff", "n_embd"),
    T(_blk("ffn_down.weight"), "linear", "n_embd", "n_ff"),
)
FFN_PLAIN_BIAS = (T(_blk("ffn_up.bias"), "bias", "n_ff"), T(_blk("ffn_down.bias"), "bias", "n_embd"))

# The llama block: what most families start from.
LLAMA = TOKEN_EMBD + OUTPUT_NORM + OUTPUT + ATTN_NORM + ATTN_QKV_SPLIT + ATTN_OUT + FFN_NORM + FFN_GATED


def only_in(mixer: str, *specs: TensorSpec) -> tuple[TensorSpec, ...]:
    """Per-layer tensors that only the layers mixing tokens by `mixer` have (a hybrid's attention or conv layers)."""
    return tuple(replace(s, mixer=mixer) for s in specs)


def only_in_ffn(kind: str, *specs: TensorSpec) -> tuple[TensorSpec, ...]:
    """Per-layer tensors that only the layers whose FFN is `kind` have (leading dense layers before experts)."""
    return tuple(replace(s, ffn=kind) for s in specs)


# lfm2: attention layers (head-wise q/k norms) and gated short-convolution layers; its final norm is
# token_embd_norm.weight
TOKEN_EMBD_NORM = (T("token_embd_norm.weight", "norm", "n_embd"),)
SHORTCONV = only_in(
    "conv",
    T(_blk("shortconv.in_proj.weight"), "linear", "n_embd3", "n_embd"),
    T(_blk("shortconv.conv.weight"), "conv", "n_embd", "conv_kernel"),
    T(_blk("shortconv.out_proj.weight"), "linear", "n_embd", "n_embd"),
)


# a Mamba-2 mixer (llama.cpp build_mamba2_layer): in_proj, a depthwise convolution with its bias, the step
# size's bias, A (a negative decay rate per head, stored (heads, 1)), the D skip (per head), the grouped
# RMSNorm of the gated output, out_proj
SSM_MAMBA2 = only_in(
    "ssm",
    T(_blk("ssm_in.weight"), "linear", "ssm_in", "n_embd"),
    T(_blk("ssm_conv1d.weight"), "conv", "ssm_xbc", "ssm_conv"),
    T(_blk("ssm_conv1d.bias"), "bias", "ssm_xbc"),
    T(_blk("ssm_dt.bias"), "bias", "ssm_head"),
    T(_blk("ssm_a"), "decay", "ssm_head", "one"),
    T(_blk("ssm_d"), "skip", "ssm_head", "one"),
    T(_blk("ssm_norm.weight"), "norm", "ssm_group", "ssm_group_width"),
    T(_blk("ssm_out.weight"), "linear", "n_embd", "ssm_inner"),
)


# a gated delta-net mixer (llama.cpp's qwen35 build_layer_attn_linear): [q | k | v] and the output gate z, the
# convolution over [q | k | v], the decay's bias and A, the rates beta and alpha per v head, the head norm, out
DELTANET = only_in(
    "deltanet",
    T(_blk("attn_qkv.weight"), "linear", "dn_qkv", "n_embd"),
    T(_blk("attn_gate.weight"), "linear", "ssm_inner", "n_embd"),
    T(_blk("ssm_conv1d.weight"), "conv", "dn_qkv", "ssm_conv"),
    T(_blk("ssm_dt.bias"), "bias", "ssm_head"),
    T(_blk("ssm_a"), "decay", "ssm_head"),
    T(_blk("ssm_beta.weight"), "linear", "ssm_head", "n_embd"),
    T(_blk("ssm_alpha.weight"), "linear", "ssm_head", "n_embd"),
    T(_blk("ssm_norm.weight"), "norm", "dn_head"),
    T(_blk("ssm_out.weight"), "linear", "n_embd", "ssm_inner"),
)
# Qwen3-Next's: beta and alpha fused per k head ([beta of its v heads | alpha of its v heads]); [q | k | v] and z
# as above, or (older files) fused per k head in ssm_in ([q | k | v of its v heads | z of its v heads])
DELTANET_FUSED_RATES = tuple(
    spec
    for spec in DELTANET
    if spec.suffix not in ("ssm_beta.weight", "ssm_alpha.weight", "attn_qkv.weight", "attn_gate.weight")
) + only_in(
    "deltanet",
    T(_blk("ssm_ba.weight"), "linear", "ssm_head2", "n_embd"),
    *optional(
        *(spec for spec in DELTANET if spec.suffix in ("attn_qkv.weight", "attn_gate.weight")),
        T(_blk("ssm_in.weight"), "linear", "dn_qkvz", "n_embd"),
    ),
)
# attention whose q projection also gives a gate per head (Qwen3-Next, Qwen3.5): [q_h | gate_h] for each head h
ATTN_Q_GATED = (T(_blk("attn_q.weight"), "linear", "n_q_gated", "n_embd"),)


def alternative(name: str, *specs: TensorSpec) -> tuple[TensorSpec, ...]:
    """`specs` as the family's alternative `name` for their component (see TensorSpec.alternative)."""
    return tuple(replace(s, alternative=name) for s in specs)


# Mixture of experts (llama.cpp build_moe_ffn): a router, and each FFN matrix stacked over the experts, numpy
# shape (n_expert, n_out, n_in). Role "experts": a 3-D weight whose selected experts multiply x as x @ W[e].T.
FFN_MOE = (
    T(_blk("ffn_gate_inp.weight"), "linear", "n_expert", "n_embd"),
    T(_blk("ffn_gate_exps.weight"), "experts", "n_expert", "n_ff_exp", "n_embd"),
    T(_blk("ffn_up_exps.weight"), "experts", "n_expert", "n_ff_exp", "n_embd"),
    T(_blk("ffn_down_exps.weight"), "experts", "n_expert", "n_embd", "n_ff_exp"),
)
FFN_MOE_ROUTER_BIAS = (T(_blk("ffn_gate_inp.bias"), "bias", "n_expert"),)
# added to the gating scores to choose the experts, not to the weights they get (DeepSeek V3's lineage, lfm2moe)
FFN_EXP_PROBS_B = (T(_blk("exp_probs_b.bias"), "bias", "n_expert"),)
FFN_MOE_BIAS = (  # one bias row per expert
    T(_blk("ffn_gate_exps.bias"), "bias", "n_expert", "n_ff_exp"),
    T(_blk("ffn_up_exps.bias"), "bias", "n_expert", "n_ff_exp"),
    T(_blk("ffn_down_exps.bias"), "bias", "n_expert", "n_embd"),
)
# experts beside a dense MLP, each branch with its own norms in and out (Gemma 4's 26B-A4B; the dense MLP's
# are ffn_norm and post_ffw_norm_1): the router reads the RMS-normed input times its own scale; each expert's
# gate and up stacked as [gate | up] (or apart), its output times the expert's scale
FFN_MOE_BESIDE_MLP = (
    T(_blk("ffn_gate_inp.weight"), "linear", "n_expert", "n_embd"),
    T(_blk("ffn_gate_inp.scale"), "scale", "n_embd"),
    T(_blk("pre_ffw_norm_2.weight"), "norm", "n_embd"),
    T(_blk("post_ffw_norm_1.weight"), "norm", "n_embd"),
    T(_blk("post_ffw_norm_2.weight"), "norm", "n_embd"),
    T(_blk("ffn_gate_up_exps.weight"), "experts", "n_expert", "n_ff_exp2", "n_embd").optional(),
    *(s.optional() for s in FFN_MOE[1:3]),
    FFN_MOE[3],
    T(_blk("ffn_down_exps.scale"), "scale", "n_expert").optional(),
)
# the shared expert (a dense gated MLP every token goes through beside the routed ones)
FFN_SHEXP = (
    T(_blk("ffn_gate_shexp.weight"), "linear", "n_ff_shexp", "n_embd"),
    T(_blk("ffn_up_shexp.weight"), "linear", "n_ff_shexp", "n_embd"),
    T(_blk("ffn_down_shexp.weight"), "linear", "n_embd", "n_ff_shexp"),
)
# the shared expert's gate (Qwen3-Next, Qwen3.5 MoE): its output times sigmoid(x · gate) per token
FFN_SHEXP_GATE = (T(_blk("ffn_gate_inp_shexp.weight"), "linear", "n_embd"),)
# multi-token prediction (NextN) layers past n_layer: a whole block plus these; llama.cpp loads and skips them
NEXTN = tuple(
    replace(s, mtp=True)
    for s in (
        T(_blk("nextn.eh_proj.weight"), "linear", "n_embd", "n_embd2"),
        T(_blk("nextn.enorm.weight"), "norm", "n_embd"),
        T(_blk("nextn.hnorm.weight"), "norm", "n_embd"),
        T(_blk("nextn.embed_tokens.weight"), "embedding", "n_vocab", "n_embd").optional(),
        T(_blk("nextn.shared_head_head.weight"), "linear", "n_vocab", "n_embd").optional(),
        T(_blk("nextn.shared_head_norm.weight"), "norm", "n_embd").optional(),
    )
)
# multi-head latent attention (deepseek2): the compressed [latent | k_pe] row, the latent's norm, each head's
# matrices into and out of the latent (3-D, one per head), the output; queries directly (attn_q, the "lite"
# models) or through a low rank (attn_q_a, its norm, attn_q_b)
ATTN_MLA = (
    T(_blk("attn_kv_a_mqa.weight"), "linear", "kv_a", "n_embd"),
    T(_blk("attn_kv_a_norm.weight"), "norm", "kv_lora"),
    T(_blk("attn_k_b.weight"), "heads", "n_head", "kv_lora", "qk_nope"),
    T(_blk("attn_v_b.weight"), "heads", "n_head", "head_dim_v_mla", "kv_lora"),
    T(_blk("attn_output.weight"), "linear", "n_embd", "n_v_mla"),
)
ATTN_MLA_Q = optional(T(_blk("attn_q.weight"), "linear", "n_q_mla", "n_embd"))
ATTN_MLA_Q_LORA = optional(
    T(_blk("attn_q_a.weight"), "linear", "q_lora", "n_embd"),
    T(_blk("attn_q_a_norm.weight"), "norm", "q_lora"),
    T(_blk("attn_q_b.weight"), "linear", "n_q_mla", "q_lora"),
)

# attention sinks (gpt-oss): one logit per query head, F32
ATTN_SINKS = (T(_blk("attn_sinks.weight"), "sinks", "n_head"),)
# per-layer inputs (gemma3n, gemma4): a table read by token and a projection of the embedding, per layer a gate
PER_LAYER_INPUTS = (
    T("per_layer_token_embd.weight", "embedding", "n_vocab", "per_layer_all"),
    T("per_layer_model_proj.weight", "linear", "per_layer_all", "n_embd"),
    T("per_layer_proj_norm.weight", "norm", "per_layer_width"),
    T(_blk("inp_gate.weight"), "linear", "per_layer_width", "n_embd"),
    T(_blk("proj.weight"), "linear", "n_embd", "per_layer_width"),
    T(_blk("post_norm.weight"), "norm", "n_embd"),
)
# gemma3n (llama-model.cpp's gemma3n tensors): AltUp streams, per-layer inputs and LAuReL
ALTUP = (
    T("altup_proj.weight", "linear", "n_altup_in", "n_embd", "n_embd"),
    T("altup_unembd_proj.weight", "linear", "n_altup_in", "n_embd", "n_embd"),
    *PER_LAYER_INPUTS,
    T(_blk("altup_correct_coef.weight"), "linear", "n_altup", "n_altup"),
    T(_blk("altup_correct_scale.weight"), "norm", "n_embd"),
    T(_blk("altup_predict_coef.weight"), "linear", "n_altup_sq", "n_altup"),
    T(_blk("altup_router.weight"), "linear", "n_altup", "n_embd"),
    T(_blk("altup_router_norm.weight"), "norm", "n_embd"),
)
# gemma4: a scalar per layer that multiplies its output
LAYER_OUT_SCALE = (T(_blk("layer_output_scale.weight"), "scale", "one"),)
LAUREL = (
    T(_blk("laurel_l.weight"), "linear", "laurel_rank", "n_embd"),
    T(_blk("laurel_r.weight"), "linear", "n_embd", "laurel_rank"),
    T(_blk("laurel_post_norm.weight"), "norm", "n_embd"),
)
