"""ModelIR: the architecture-neutral description of a decoder-only transformer that codegen renders.

A model is components named by kind: an embedding, N blocks (norms, attention, MLP and how they are wired)
and an output. Each component names the GGUF tensors it reads (a layer's as a suffix of `blk.<il>.`, None
where the family has no such tensor) and carries the numbers it needs. Everything is plain data (frozen
dataclasses of ints, floats, strings, enums and tuples) so that it can be hashed, compared and written as
JSON (`alchemist inspect --ir`). Family files build it from GGUF facts (alchemist/arch); codegen never
looks at the GGUF file again, and refuses any value it has no template for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum

# field metadata of a field added after IRs were first hashed: to_dict() leaves it out while it holds its
# default, so the IR (and the ir_sha256 of the generated module) of a model that does not use it is unchanged
LATER = {"omit_default": True}


class RopeStyle(str, Enum):
    NONE = "none"  # no rotary embedding (gpt2; layers that skip RoPE)
    NORM = "norm"  # rotate adjacent pairs (2i, 2i+1): llama
    NEOX = "neox"  # rotate (i, i + n_rot/2): qwen2, qwen3, gemma, phi3, ...


class RopeScaling(str, Enum):
    NONE = "none"
    LINEAR = "linear"  # positions divided by the factor
    LLAMA3 = "llama3"  # per-frequency divisors stored in rope_freqs.weight
    YARN = "yarn"  # NTK-by-parts interpolation with an attention (magnitude) factor
    LONGROPE = "longrope"  # phi3: per-frequency divisors rope_factors_{long,short}.weight and a magnitude factor


class Activation(str, Enum):
    SILU = "silu"
    GELU_TANH = "gelu_tanh"  # ggml_gelu: the tanh approximation
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss, gated only: min(g, 7) · sigmoid(1.702 · min(g, 7)) · (clip(u, ±7) + 1)
    RELU_SQR = "relu_sqr"  # relu(x)² (Nemotron-H)


class NormKind(str, Enum):
    RMS = "rms"  # x / sqrt(mean(x²) + eps) · w
    LAYER = "layer"  # (x - mean) / sqrt(var + eps) · w + b


class MLPKind(str, Enum):
    GATED = "gated"  # down(act(gate(x)) · up(x))
    FUSED_GATED = "fused_gated"  # up(x) holds [gate | up]: down(act(first half) · second half)
    PLAIN = "plain"  # down(act(up(x)))
    MOE = "moe"  # a router picks experts per token; each is a (gated) MLP of its own 3-D expert tensors


class Gating(str, Enum):
    """How a mixture-of-experts router turns its logits into expert scores and routing weights."""

    SOFTMAX = "softmax"  # softmax over all experts; top-k of the probabilities; weights = those probabilities
    SOFTMAX_WEIGHT = "softmax_weight"  # top-k of the raw logits, then a softmax over the k chosen (gpt-oss)
    SIGMOID = "sigmoid"  # sigmoid of each logit; top-k of those; weights = those sigmoids


class Wiring(str, Enum):
    SEQUENTIAL = "sequential"  # x += attn(norm(x)); x += mlp(norm(x)); each branch optionally post-normed
    PARALLEL = "parallel"  # x += attn(norm(x)) + mlp(norm(x)): both branches read the same residual
    ALTUP = "altup"  # gemma3n: N_ALTUP residual streams, predicted and corrected around one active stream
    SINGLE = "single"  # x += f(norm(x)), f the layer's one sublayer: its token mixer, or (a mixer-less layer) its MLP


class QKNormScope(str, Enum):
    HEAD = "head"  # over each head's HEAD_DIM values (weight shared by heads, or one row per head)
    FULL = "full"  # over the whole projection (olmo2)


@dataclass(frozen=True)
class TensorBinding:
    """One GGUF tensor and how the graph uses it. `shape` is numpy order (GGUF ne reversed)."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    offset: int  # within the GGUF data section
    nbytes: int
    # "linear" (y = x @ W.T, W is (n_out, n_in)), "embedding" (rows read by token id; also the tied
    # output projection), "position_embedding" (rows read by position), "norm", "bias", "rope_factors",
    # "experts" (3-D expert stacks), "sinks" (attention sink logits, one per query head), "scale" (a scalar that
    # multiplies a layer's output)
    role: str
    # True when alchemist's kernels can use the tensor in its GGUF block format (a quantized matrix of a
    # type alchemist.kernels supports, read by the graph only as a projection or an embedding)
    kernel: bool = False
    # False for a tensor llama.cpp loads but never applies (gemma3n's K/V projections on KV-sharing layers)
    read: bool = field(default=True, metadata=LATER)
    # a snapshot's tensor: the index of its file in ModelIR.source_files (offset is then within that file), and
    # what the loader does to its values, as convert_hf_to_gguf would (("rope_pairs", n_head): llama's q/k rows)
    file: int = field(default=0, metadata=LATER)
    transform: tuple = field(default=(), metadata=LATER)
    # a snapshot's MLX-quantized weight (ggml_type "MLX_AFFINE", shape the dequantized one, offset/nbytes its packed
    # uint32 values): (bits, group size, scales and biases as (file, offset, nbytes, type)); w = scale · q + bias
    quant: tuple = field(default=(), metadata=LATER)
    # a snapshot's tensor stacked on a new first axis from several stored ones: each one's (file, offset, nbytes)
    parts: tuple = field(default=(), metadata=LATER)

    @property
    def quantized(self) -> bool:
        return self.ggml_type != "F32"


@dataclass(frozen=True)
class NormSpec:
    kind: NormKind
    weight: str | None  # tensor name (suffix within the block for layer norms); None: no learned scale
    bias: str | None = None


@dataclass(frozen=True)
class RopeSpec:
    style: RopeStyle
    dim: int  # leading dims of each head that are rotated
    base: float
    freq_scale: float  # 1 / linear (or YaRN) scaling factor
    scaling: RopeScaling = RopeScaling.NONE
    freq_factors: str | None = None  # rope_freqs.weight (llama3) / rope_factors_long.weight (longrope)
    freq_factors_short: str | None = None  # longrope: rope_factors_short.weight, used up to n_ctx_orig
    attn_factor: float = 1.0  # multiplies cos and sin (YaRN's and LongRoPE's magnitude correction)
    ext_factor: float = 0.0  # YaRN: how much of the extrapolated angle to mix in
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0  # YaRN, LongRoPE: the context the model was originally trained for
    # YaRN: the attn_factor llama.cpp hands ggml's rope where a family sets its own (mistral3); attn_factor is
    # then this times ggml's magnitude 1 + 0.1 ln(1 / freq_scale), as ggml rounds it
    ggml_attn_factor: float | None = field(default=None, metadata=LATER)


@dataclass(frozen=True)
class AttentionTemperature:
    """Llama 4's attention temperature tuning (llama.cpp's llm_graph_input_attn_temp): the queries of a token at
    position p are multiplied by log(floor((p + offset) / length) + 1) · scale + 1, a factor that grows by one
    step every `length` positions."""

    scale: float
    length: int
    offset: float = 0.0
    # only the layers without RoPE scale their queries, before llama.cpp names them Qcur (Llama 4)
    unrotated_only: bool = field(default=False, metadata=LATER)


@dataclass(frozen=True)
class LatentAttentionSpec:
    """Multi-head latent attention (DeepSeek-V2/V3; llama.cpp deepseek2.cpp's absorbed-weight form). Keys and
    values of every head come from one compressed row per position, [latent (kv_lora_rank) | k_pe (the RoPE
    part)], which is all the cache keeps: each query head's non-rotated part goes through its attn_k_b into the
    latent space, attention reads the cached rows as one KV head (their latent part as values), and each head's
    output comes back through its attn_v_b. AttentionSpec then has one KV head of head_dim = kv_lora_rank + the
    RoPE dims."""

    kv_lora_rank: int
    head_dim_nope: int  # per query head: the part that is not rotated (key_length_mla - rope dims)
    head_dim_v: int  # per head: the value size after decompression (value_length_mla)
    kv_a: str  # attn_kv_a_mqa.weight: x -> [latent | k_pe]
    kv_a_norm: NormSpec  # RMS norm of the latent
    k_b: str  # attn_k_b.weight (n_head, kv_lora_rank, head_dim_nope)
    v_b: str  # attn_v_b.weight (n_head, head_dim_v, kv_lora_rank)
    # queries: attn_q.weight (the "lite" models), or through a low rank: attn_q_a, its RMS norm, attn_q_b
    q: str | None = None
    q_a: str | None = None
    q_a_norm: NormSpec | None = None
    q_b: str | None = None


@dataclass(frozen=True)
class AttentionSpec:
    n_head: int
    n_kv_head: int
    head_dim: int  # key/query head size
    head_dim_v: int
    rope: RopeSpec
    sliding_window: int  # 0: attends to the whole context
    score_scale: float  # multiplies q·k
    out: str  # attn_output.weight
    # projections: a fused [q | k | v] matrix, or three
    qkv: str | None = None
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv_bias: str | None = None
    q_bias: str | None = None
    k_bias: str | None = None
    v_bias: str | None = None
    out_bias: str | None = None
    q_norm: NormSpec | None = None  # normalizes queries before RoPE
    k_norm: NormSpec | None = None
    qk_norm_scope: QKNormScope = QKNormScope.HEAD
    logit_softcap: float = 0.0  # scores = cap · tanh(scores / cap) before the mask (gemma2)
    prescale_queries: bool = False  # q · score_scale after RoPE, then unscaled q·k (phi3 names that q "Qcur")
    # attn_sinks.weight (n_head,): one more logit per query head in the softmax, unscaled; it adds no value (gpt-oss)
    sinks: str | None = field(default=None, metadata=LATER)
    # the layer whose keys and values this layer attends to: None, its own (the classic block); its own index, a
    # layer that writes its KV cache; an earlier one, a KV-sharing layer that computes only queries (gemma3n)
    kv_layer: int | None = field(default=None, metadata=LATER)
    v_norm: NormSpec | None = field(default=None, metadata=LATER)  # normalizes values (gemma3n: no weight)
    temperature: AttentionTemperature | None = field(default=None, metadata=LATER)  # scales q after RoPE
    # RMS-normalizes q and k per head, without a weight, after RoPE in the layers that rotate (Llama 4's L2 norm)
    rotated_qk_norm: bool = field(default=False, metadata=LATER)
    # chunked attention: a query sees only the keys of its own chunk of this many positions (Llama 4's local
    # layers); 0: none. Rendered as a limit: a cache longer than the chunk is refused, so chunks never split
    chunk: int = field(default=0, metadata=LATER)
    # the q projection gives each head's queries and then as many gate values: the attention output times
    # sigmoid(gate) before the output projection (Qwen3-Next, Qwen3.5)
    output_gate: bool = field(default=False, metadata=LATER)
    # multi-head latent attention (DeepSeek): the projections above are None; n_kv_head is 1 and head_dim the
    # cached row's width
    latent: LatentAttentionSpec | None = field(default=None, metadata=LATER)

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_kv_head


@dataclass(frozen=True)
class RouterSpec:
    """The router of a mixture of experts (llama.cpp's build_moe_ffn): logits = x @ weight.T (+ bias), scores
    by `gating`, the n_expert_used best experts per token (ties: the lower index first) in descending order,
    their weights normalized to sum 1 (when `normalize`; the sum clamped below at 2^-14) and scaled by
    `weight_scale`; the experts' outputs are weighted and summed in that rank order."""

    n_expert: int
    n_expert_used: int
    weight: str  # ffn_gate_inp.weight, (n_expert, n_embd)
    bias: str | None = None  # ffn_gate_inp.bias, added to the logits before gating (gpt-oss)
    gating: Gating = Gating.SOFTMAX
    normalize: bool = True
    weight_scale: float = 1.0
    # exp_probs_b.bias (n_expert,): added to the scores to choose the experts; the weights are the unbiased scores
    selection_bias: str | None = field(default=None, metadata=LATER)
    # group-limited routing (DeepSeek-V3): the experts in n_group groups of equal size; a token chooses among the
    # n_group_used groups whose two best selection scores sum highest; 0: no groups
    n_group: int = field(default=0, metadata=LATER)
    n_group_used: int = field(default=0, metadata=LATER)
    # the routing weight multiplies the token before its expert instead of the expert's output (Llama 4; one expert)
    weight_inputs: bool = field(default=False, metadata=LATER)
    # (n_embd,): the router reads rms_norm(x) / sqrt(n_embd) times this scale instead of x (Gemma 4)
    input_scale: str | None = field(default=None, metadata=LATER)


@dataclass(frozen=True)
class BranchNorms:
    """The norms of a mixture of experts whose shared expert and routed experts each have their own norm in and
    out (Gemma 4): the MoE then reads the residual stream itself, and returns shared_out(shared(shared_in(x))) +
    experts_out(experts(experts_in(x)))."""

    shared_in: NormSpec  # ffn_norm
    shared_out: NormSpec  # post_ffw_norm_1
    experts_in: NormSpec  # pre_ffw_norm_2
    experts_out: NormSpec  # post_ffw_norm_2


@dataclass(frozen=True)
class MLPSpec:
    kind: MLPKind
    activation: Activation
    n_ff: int
    up: str
    down: str
    gate: str | None = None
    up_bias: str | None = None
    down_bias: str | None = None
    gate_bias: str | None = None
    # MOE: the router; up/gate/down (and their biases) are then 3-D expert tensors (n_expert, n_out, n_in)
    router: RouterSpec | None = field(default=None, metadata=LATER)
    # activation sparsity (gemma3n): gate <- relu(gate - (mean + sparsity_std · std)) per token before the
    # activation, std with n - sparsity_ddof (llama.cpp's n - 1; Hugging Face's and mlx-lm's n); 0: dense
    sparsity_std: float = field(default=0.0, metadata=LATER)
    sparsity_ddof: int = field(default=1, metadata=LATER)
    # MOE: the shared expert, a dense MLP (ffn_*_shexp) every token goes through, added to the routed experts' sum
    shared: "MLPSpec | None" = field(default=None, metadata=LATER)
    # MOE: (n_embd,): the shared expert's output times sigmoid(x · shared_gate) per token (Qwen3-Next, Qwen3.5 MoE)
    shared_gate: str | None = field(default=None, metadata=LATER)
    # MOE: `up` names each expert's gate and up stacked as [gate | up] (2 · n_ff rows); gate is then None
    gate_up_fused: bool = field(default=False, metadata=LATER)
    # MOE: (n_expert,): each expert's output times its scale, before the routing weight (Gemma 4)
    down_scale: str | None = field(default=None, metadata=LATER)
    # MOE: the shared and routed experts' own norms (Gemma 4); None: the block's ffn_norm before the whole MoE
    branch_norms: BranchNorms | None = field(default=None, metadata=LATER)


@dataclass(frozen=True)
class ShortConvSpec:
    """A gated short causal convolution mixing tokens instead of attention (lfm2):
    B, C, X = split3(in_proj(x)); out_proj(C · conv(B · X)), conv depthwise over the last `kernel` positions."""

    kernel: int  # positions each output reads: the current one and kernel - 1 before it
    in_proj: str  # (3·n_embd, n_embd): [B | C | X]
    conv: str  # (n_embd, kernel): weight [d, kernel - 1] multiplies the current position
    out_proj: str  # (n_embd, n_embd)


@dataclass(frozen=True)
class SSMSpec:
    """A Mamba-2 mixer (llama.cpp build_mamba2_layer) mixing tokens instead of attention: z, xBC, dt = in_proj(x);
    xBC = silu(conv(xBC) + conv_bias) over the last `conv_kernel` positions; x, B, C = split(xBC); per head a
    state (head_dim, state) decaying by exp(softplus(dt + dt_bias) · A) and taking in B ⊗ x · softplus(...);
    y = C · state + D · x; out_proj(norm(y · silu(z)) per group)."""

    conv_kernel: int  # positions the convolution reads: the current one and conv_kernel - 1 before it
    n_inner: int  # x's width, n_head · head_dim
    n_state: int  # the state's size per head and channel (B's and C's width per group)
    n_head: int
    n_group: int  # B and C are shared by n_head / n_group heads each
    in_proj: str  # (2·n_inner + 2·n_group·n_state + n_head, n_embd): [z | x B C | dt]
    conv: str  # (n_inner + 2·n_group·n_state, conv_kernel): depthwise filter, tap conv_kernel - 1 on the current
    conv_bias: str | None
    dt_bias: str  # (n_head,)
    a: str  # (n_head, 1): A, negative
    d: str  # (n_head, 1): D, the skip
    norm: NormSpec | None  # (n_group, n_inner / n_group): RMSNorm of each group of the gated output
    out_proj: str  # (n_embd, n_inner)

    @property
    def head_dim(self) -> int:
        return self.n_inner // self.n_head

    @property
    def n_xbc(self) -> int:
        return self.n_inner + 2 * self.n_group * self.n_state


@dataclass(frozen=True)
class DeltaNetSpec:
    """A gated delta-net mixer (llama.cpp's qwen35/qwen3next linear attention, delta-net-base.cpp) mixing tokens
    instead of attention: q, k, v = silu(conv(qkv(x))) over the last `conv_kernel` positions; q and k L2-normed
    per head, the k heads repeated to the v heads; per v head a state (head_dim, head_dim) decaying by
    exp(softplus(alpha(x) + dt_bias) · a) and corrected towards v by the delta rule with rate sigmoid(beta(x));
    out = out_proj(rms_norm(state · q per head) · silu(gate(x)))."""

    conv_kernel: int  # positions the convolution reads: the current one and conv_kernel - 1 before it
    n_k_head: int  # q and k heads
    n_v_head: int  # v heads (and states): a multiple of n_k_head
    head_dim: int  # the size of every q, k and v head
    conv: str  # (the qkv width, conv_kernel): depthwise filter, tap conv_kernel - 1 on the current position
    dt_bias: str  # (n_v_head,)
    a: str  # (n_v_head,): A, negative
    norm: NormSpec  # (head_dim,): RMSNorm of each head's output
    out_proj: str  # (n_embd, n_v_head·head_dim)
    qkv: str | None = None  # (2·n_k_head·head_dim + n_v_head·head_dim, n_embd): [q | k | v]
    gate: str | None = None  # (n_v_head·head_dim, n_embd): z, the output gate
    # or both fused per k head (older Qwen3-Next files): [q | k | v of its v heads | z of its v heads] per k head
    qkvz: str | None = field(default=None, metadata=LATER)
    beta: str | None = None  # (n_v_head, n_embd)
    alpha: str | None = None  # (n_v_head, n_embd)
    # or both fused per k head (Qwen3-Next): [beta of its v heads | alpha of its v heads] per k head
    beta_alpha: str | None = field(default=None, metadata=LATER)
    # which k head v head h reads: h % n_k_head (ggml_repeat's tiling, Qwen3.5) or h // (n_v_head / n_k_head)
    # (a repeat-interleave, Qwen3-Next)
    k_heads_tiled: bool = field(default=True, metadata=LATER)

    @property
    def n_qkv(self) -> int:
        return (2 * self.n_k_head + self.n_v_head) * self.head_dim


@dataclass(frozen=True)
class LaurelSpec:
    """LAuReL (gemma3n): a low-rank branch beside attention, h + norm(right(left(h))), joined with the attention
    output as (attention + laurel) · join_scale."""

    left: str  # laurel_l.weight (rank, n_embd)
    right: str  # laurel_r.weight (n_embd, rank)
    post_norm: NormSpec
    join_scale: float


@dataclass(frozen=True)
class AltUpLayerSpec:
    """One layer's AltUp tensors (gemma3n): the router that weighs the streams, the predict and correct
    coefficients, and the gated path that adds the layer's per-layer input to the non-active streams."""

    router: str  # altup_router.weight (n_altup, n_embd)
    router_norm: NormSpec
    router_scale: float  # multiplies the normed router input (1 / n_embd)
    predict_coef: str  # altup_predict_coef.weight (n_altup², n_altup)
    correct_coef: str  # altup_correct_coef.weight (n_altup, n_altup)
    correct_scale: str  # altup_correct_scale.weight (n_embd,): scales the corrected active stream
    inp_gate: str  # per-layer input gate (width, n_embd)
    proj: str  # per-layer input projection back to the embedding (n_embd, width)
    post_norm: NormSpec


@dataclass(frozen=True)
class PerLayerGateSpec:
    """A layer's per-layer input added to its output (gemma4): x + norm(proj(act(inp_gate · x) · input)), the
    input this layer's share of ModelIR.per_layer_input."""

    inp_gate: str  # inp_gate.weight (width, n_embd)
    proj: str  # proj.weight (n_embd, width)
    post_norm: NormSpec


@dataclass(frozen=True)
class LayerSpec:
    index: int
    wiring: Wiring
    attention: AttentionSpec | None  # None in a layer that mixes tokens otherwise (conv), or not at all
    mlp: MLPSpec | None  # None in a layer without one (Wiring.SINGLE: a token mixer alone)
    attn_norm: NormSpec | None  # before attention (and before the MLP too, in a parallel block)
    ffn_norm: NormSpec | None  # before the MLP
    attn_post_norm: NormSpec | None = None  # on the attention output, before the residual add
    ffn_post_norm: NormSpec | None = None
    residual_scale: float = 1.0  # multiplies each branch before the residual add (granite)
    conv: ShortConvSpec | None = field(default=None, metadata=LATER)  # the token mixer when attention is None
    ssm: SSMSpec | None = field(default=None, metadata=LATER)  # the token mixer when attention is None
    deltanet: DeltaNetSpec | None = field(default=None, metadata=LATER)  # the token mixer when attention is None
    altup: AltUpLayerSpec | None = field(default=None, metadata=LATER)  # with Wiring.ALTUP
    laurel: LaurelSpec | None = field(default=None, metadata=LATER)
    # the layer's per-layer input, added after the MLP (gemma4; gemma3n adds it inside AltUp)
    per_layer_gate: PerLayerGateSpec | None = field(default=None, metadata=LATER)
    # layer_output_scale.weight (1,): multiplies the layer's output, the residual stream (gemma4)
    out_scale: str | None = field(default=None, metadata=LATER)


@dataclass(frozen=True)
class EmbeddingSpec:
    weight: str  # token_embd.weight
    scale: float = 1.0  # gemma: sqrt(n_embd); granite: embedding_scale
    positions: str | None = None  # learned absolute position embedding (gpt2)


@dataclass(frozen=True)
class PerLayerInputSpec:
    """Per-layer inputs (gemma3n, gemma4): for every layer a vector of `width` from the token (a row of token_embd,
    n_layer · width wide, times token_scale) and from the scaled embedding (model_proj · x · proj_scale, RMS-normed
    per layer), summed and times sum_scale."""

    token_embd: str  # per_layer_token_embd.weight (n_vocab, n_layer · width), read by token
    model_proj: str  # per_layer_model_proj.weight (n_layer · width, n_embd)
    proj_norm: NormSpec  # per_layer_proj_norm.weight (width,), shared by every layer
    width: int
    token_scale: float
    proj_scale: float
    sum_scale: float


@dataclass(frozen=True)
class AltUpSpec:
    """AltUp (gemma3n): the embedding widened into n_streams residual streams (stream 0 active) by `proj`,
    each rescaled to the embedding's L2 magnitude, and merged back after the last layer by `unembd_proj`."""

    n_streams: int
    proj: str  # altup_proj.weight (n_streams - 1, n_embd, n_embd)
    unembd_proj: str  # altup_unembd_proj.weight (n_streams - 1, n_embd, n_embd)


@dataclass(frozen=True)
class OutputSpec:
    norm: NormSpec
    weight: str  # output.weight, or token_embd.weight when tied
    logit_scale: float = 1.0  # multiplies the logits (command-r; granite's divisor as its inverse)
    final_softcap: float = 0.0  # logits = cap · tanh(logits / cap)

    @property
    def tied(self) -> bool:
        return self.weight == "token_embd.weight"


@dataclass(frozen=True)
class ModelIR:
    architecture: str  # family name, validated identifier
    model_name: str  # general.name: free text, only ever emitted as a literal
    source_file: str
    source_sha256: str
    file_size: int
    data_offset: int
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    norm_eps: float
    embedding: EmbeddingSpec
    layers: tuple[LayerSpec, ...]
    output: OutputSpec
    tensors: tuple[TensorBinding, ...]
    # (alchemist's tap name, llama.cpp's callback name for the same tensor) where the family's graph names it
    # its own way (lfm2)
    tap_names: tuple[tuple[str, str], ...] = field(default=(), metadata=LATER)
    altup: AltUpSpec | None = field(default=None, metadata=LATER)
    # each layer's own input (gemma3n: added to AltUp's other streams; gemma4: a layer's per_layer_gate)
    per_layer_input: PerLayerInputSpec | None = field(default=None, metadata=LATER)
    # the GGUF metadata the family read, key -> value (a per-layer array as ("ndarray", dtype, values)): with the
    # tensor inventory, what rebuilds this IR (the generated module carries it as METADATA for its audit)
    metadata: tuple[tuple[str, object], ...] = field(default=(), metadata=LATER)
    # read from a Hugging Face snapshot directory (source_file): its safetensors files, (name, size) each; () for a
    # GGUF file. A snapshot's metadata is in GGUF keys, as convert_hf_to_gguf would write them
    source_files: tuple[tuple[str, int], ...] = field(default=(), metadata=LATER)

    @property
    def attention_layers(self) -> tuple[LayerSpec, ...]:
        """The layers that mix tokens with attention: all of them, except a hybrid's convolution layers."""
        return tuple(lay for lay in self.layers if lay.attention is not None)

    def mixes(self, lay: LayerSpec) -> bool:
        """Whether the layer mixes tokens (a Wiring.SINGLE block may hold only an MLP)."""
        return any(m is not None for m in (lay.attention, lay.conv, lay.ssm, lay.deltanet))

    def _owns_caches(self, lay: LayerSpec) -> bool:
        """A layer keeps caches unless it attends to an earlier layer's keys and values (gemma3n's KV sharing)."""
        return lay.attention is None or lay.attention.kv_layer in (None, lay.index)

    @property
    def kv_cache_layers(self) -> tuple[int, ...]:
        """The layers that own caches, in order: every layer, except those that read another layer's."""
        return tuple(lay.index for lay in self.layers if self._owns_caches(lay))

    @property
    def unapplied_blocks(self) -> tuple[int, ...]:
        """The file's blocks past n_layer (multi-token-prediction layers): bound, their tensors never read."""
        return tuple(
            sorted(
                {int(t.name.split(".")[1]) for t in self.tensors if t.name.startswith("blk.")}
                - set(range(self.n_layer))
            )
        )

    @property
    def kv_cache_of(self) -> tuple[int, ...]:
        """Per layer: the index (among kv_cache_layers) of the caches it reads and writes."""
        owners = self.kv_cache_layers
        return tuple(
            owners.index(
                lay.index if lay.attention is None or lay.attention.kv_layer is None else lay.attention.kv_layer
            )
            for lay in self.layers
        )

    def layer_caches(self) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]:
        """Per layer that owns caches (kv_cache_layers), those caches, each (kind, shape): of one position's row
        for "k" and "v" (N_KV_HEAD, HEAD_DIM) of attention and "conv" (n_embd,) (the gated input B·X) of a short
        convolution; of one sequence's state (STATE_KINDS) for a Mamba-2 layer's "conv_window"
        (conv_kernel - 1, n_xbc), its last inputs, and "ssm" (n_head, head_dim, n_state), and for a delta-net
        layer's "conv_window" (conv_kernel - 1, n_qkv) and "delta" (n_v_head, head_dim of k, head_dim of v); a
        latent attention layer's one "kv_latent" (1, kv_lora_rank + RoPE dims), keys and values in one row; a
        layer with attention and Mamba-2 side by side, "k" and "v" and then Mamba-2's two."""
        caches = []
        for lay in self.layers:
            if not self._owns_caches(lay):
                continue
            if not self.mixes(lay):
                caches.append(())  # an MLP-only layer
            elif lay.deltanet is not None:
                dn = lay.deltanet
                window = ("conv_window", (dn.conv_kernel - 1, dn.n_qkv))
                caches.append((window, ("delta", (dn.n_v_head, dn.head_dim, dn.head_dim))))
            elif lay.ssm is not None:
                ssm = lay.ssm
                window = ("conv_window", (ssm.conv_kernel - 1, ssm.n_xbc))
                states = (window, ("ssm", (ssm.n_head, ssm.head_dim, ssm.n_state)))
                # beside attention (falcon-h1's layers): its key and value rows first
                row = (lay.attention.n_kv_head, lay.attention.head_dim) if lay.attention is not None else None
                caches.append(((("k", row), ("v", row)) if row else ()) + states)
            elif lay.conv is not None:
                caches.append((("conv", (self.n_embd,)),))
            elif lay.attention.latent is not None:
                caches.append((("kv_latent", (1, lay.attention.head_dim)),))
            else:
                row = (lay.attention.n_kv_head, lay.attention.head_dim)
                caches.append((("k", row), ("v", row)))
        return tuple(caches)

    def tensor(self, name: str) -> TensorBinding:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict:
        return _jsonable(_asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def ir_hash(self) -> str:
        """sha256 of the canonical JSON: the generated module records it, the auditor re-checks it."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def computation_hash(self) -> str:
        """sha256 of what the model computes, without where it was read from: the source's name and identity, the
        metadata keys read, each tensor's place, order and transform (its name, type, shape and role stay). A GGUF
        file and the snapshot it was converted from (or to) share it."""
        d = self.to_dict()
        for key in (
            "model_name",
            "source_file",
            "source_sha256",
            "file_size",
            "data_offset",
            "source_files",
            "metadata",
        ):
            d.pop(key, None)
        kept = ("name", "ggml_type", "shape", "role", "kernel", "read")
        d["tensors"] = sorted(({k: t[k] for k in kept if k in t} for t in d["tensors"]), key=lambda t: t["name"])
        return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _asdict(obj):
    """dataclasses.asdict, leaving out LATER fields that hold their default."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: _asdict(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)
        }
    if isinstance(obj, (list, tuple)):
        return type(obj)(_asdict(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _asdict(v) for k, v in obj.items()}
    return obj


def _jsonable(obj):
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
