"""A family: one small declarative value per architecture, as llama.cpp's src/models/<family>.cpp computes it.

A family differs from another by data: its tensor table (alchemist/arch/table.py), its RoPE style and
activation, its norm kind, how its blocks are wired, and a few numbers read from metadata. Where a number
needs a computation (gemma's sqrt(n_embd), granite's 1/logit_scale, a sliding-window pattern), the
family gives a small function of the hyperparameters. `alchemist.arch.build.build_ir` does the rest for
every family alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from alchemist import libm
from alchemist.arch.table import Dims, TensorSpec
from alchemist.errors import GGUFError, UnsupportedModelError
from alchemist.gguf_io import GGUFFacts
from alchemist.ir import Activation, AttentionTemperature, Gating, ModelIR, NormKind, RopeStyle, Wiring

REQUIRED = object()


class Hparams:
    """Typed, validated reads of `<arch>.<key>` metadata (llama.cpp's `ml.get_key`)."""

    def __init__(self, facts: GGUFFacts, arch: str):
        self.facts = facts
        self.arch = arch
        self.read: set[str] = set()  # the keys looked up that the file has: what the IR was built from

    def _lookup(self, full: str):
        """metadata[full], or None when absent; a present key is remembered in `read`."""
        if full not in self.facts.metadata:
            return None
        self.read.add(full)
        return self.facts.metadata[full]

    def key(self, key: str) -> str:
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def has(self, key: str) -> bool:
        return self._lookup(self.key(key)) is not None

    def _raw(self, key: str, default):
        full = self.key(key)
        value = self._lookup(full)
        if value is not None:
            return full, value
        if default is REQUIRED:
            raise GGUFError(self.facts.path, full, "required hyperparameter is missing")
        return full, default

    def int(self, key: str, default=REQUIRED, minimum: int = 0) -> int:
        full, v = self._raw(key, default)
        if isinstance(v, np.ndarray):
            if v.size == 0 or not np.all(v == v.flat[0]):
                raise UnsupportedModelError(
                    f"{self.facts.path}: {full}: per-layer values {v.tolist()} are not supported"
                )
            v = v.flat[0].item()
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise GGUFError(self.facts.path, full, f"expected an integer, got {type(v).__name__}")
        v = int(v)
        if v < minimum:
            raise GGUFError(self.facts.path, full, f"must be >= {minimum}, got {v}")
        if key == "block_count" and v > len(self.facts.tensors):
            # Every block has tensors; refusing a larger count keeps per-layer lists from being sized by it.
            n_tensors = len(self.facts.tensors)
            raise GGUFError(self.facts.path, full, f"{v} blocks, but the file has only {n_tensors} tensors")
        return v

    def float(self, key: str, default=REQUIRED, positive: bool = False) -> float:
        full, v = self._raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise GGUFError(self.facts.path, full, f"expected a number, got {type(v).__name__}")
        v = float(v)
        if not math.isfinite(v):
            raise GGUFError(self.facts.path, full, f"must be finite, got {v}")
        if positive and v <= 0:
            raise GGUFError(self.facts.path, full, f"must be positive, got {v}")
        return v

    def bool(self, key: str, default=REQUIRED) -> bool:
        full, v = self._raw(key, default)
        if not isinstance(v, (bool, np.bool_)):
            raise GGUFError(self.facts.path, full, f"expected a boolean, got {type(v).__name__}")
        return bool(v)

    def str(self, key: str, default=REQUIRED) -> str:
        full, v = self._raw(key, default)
        if not isinstance(v, str):
            raise GGUFError(self.facts.path, full, f"expected a string, got {type(v).__name__}")
        return v

    def _per_layer(self, key: str, n: int) -> np.ndarray | None:
        """`key`'s per-layer array of n entries, or None when absent or a scalar."""
        full = self.key(key)
        raw = self._lookup(full)
        if not isinstance(raw, np.ndarray):
            return None
        if raw.size != n:
            raise GGUFError(self.facts.path, full, f"has {raw.size} entries for {n} layers")
        return raw

    def ints(self, key: str, n: int) -> list[int] | None:
        """A per-layer integer array (e.g. lfm2's head_count_kv), or None when absent or a scalar."""
        raw = self._per_layer(key, n)
        if raw is None:
            return None
        if raw.dtype.kind not in "iu":
            raise GGUFError(self.facts.path, self.key(key), f"expected integers, got {raw.dtype}")
        return [int(x) for x in raw.tolist()]

    def bools(self, key: str, n: int) -> list[bool] | None:
        """A per-layer boolean array (e.g. sliding_window_pattern as an array), or None when absent/scalar."""
        raw = self._per_layer(key, n)
        return None if raw is None else [bool(x) for x in raw.tolist()]


def every_nth_dense(default_pattern: int, dense_first: bool = False) -> Callable[[Hparams, int], list[bool]]:
    """llama.cpp's load_swa_pattern(n, dense_first): layer il slides when il % n < n - 1 (the last of every n
    is global), or with dense_first when il % n != 0 (the first of every n is global).
    `attention.sliding_window_pattern` overrides n, or gives the per-layer flags as an array."""

    def pattern(hp: Hparams, n_layer: int) -> list[bool]:
        flags = hp.bools("attention.sliding_window_pattern", n_layer)
        if flags is not None:
            return flags
        n = hp.int("attention.sliding_window_pattern", default=default_pattern)
        if dense_first:
            return [n == 0 or il % n != 0 for il in range(n_layer)]
        return [n == 0 or il % n < n - 1 for il in range(n_layer)]

    return pattern


def recurrent_where_no_kv_heads(recurrent: str) -> Callable[[Hparams, int], list[str]]:
    """Family.layer_mixers of llama.cpp's hybrids, is_recurrent(il) = n_head_kv(il) == 0: layer il mixes tokens
    with `recurrent` ("conv", "ssm") where attention.head_count_kv is 0, else with attention; a scalar count
    applies to every layer."""

    def mixers(hp: Hparams, n_layer: int) -> list[str]:
        counts = hp.ints("attention.head_count_kv", n_layer)
        if counts is None:
            counts = [hp.int("attention.head_count_kv", default=hp.int("attention.head_count"))] * n_layer
        return [recurrent if n == 0 else "attention" for n in counts]

    return mixers


def shared_kv_source(il: int, sliding: list[bool], kv_from_start: int, where: str) -> int:
    """llama.cpp's create_memory reuse rule (gemma3n, gemma4): layers from kv_from_start on attend to the cache of
    layer kv_from_start - 2 (sliding) or kv_from_start - 1 (global), which must be of that kind; the others to
    their own."""
    if il < kv_from_start:
        return il
    src = kv_from_start - (2 if sliding[il] else 1)
    kind = "sliding" if sliding[il] else "global"
    if src < 0 or sliding[src] != sliding[il]:
        raise UnsupportedModelError(
            f"{where} layer {il} ({kind}) shares the KV cache of layer {src}, which is not a {kind} layer "
            f"(llama.cpp reads layer {kv_from_start - 2} for sliding and {kv_from_start - 1} for global layers)"
        )
    return src


def gemma_fixture_scales(branch: float) -> tuple[tuple[str, float], ...]:
    """Fixture value scales of the gemmas with kq scale 1 over RMS-normed q and k (gemma3n, gemma4): q norms down so
    that unit-RMS heads (scores of ±head_dim) make no softmax sharp enough to amplify the noise of llama.cpp's
    arithmetic layer after layer; gates up so that most GELU inputs lie outside (-10, 10), where llama.cpp's FP16
    GELU table is exact; every branch's post-norm times `branch`, so that a layer changes the residual stream by a
    fraction (a random deep stack of full-size branches is chaotic)."""
    return (
        ("blk.{il}.attn_q_norm.weight", 0.0625),
        ("blk.{il}.ffn_gate.weight", 50.0),
        ("blk.{il}.inp_gate.weight", 40.0),
        ("blk.{il}.post_norm.weight", branch),
        ("blk.{il}.post_attention_norm.weight", branch),
        ("blk.{il}.post_ffw_norm.weight", branch),
    )


def inverse_sqrt_head_dim(hp: Hparams, head_dim: int) -> float:
    """llama.cpp's default kq_scale, 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


def attention_scale_key(hp: Hparams, head_dim: int) -> float:
    """`attention.scale` when it is set and non-zero, else 1/sqrt(head_dim) (the granite families)."""
    return hp.float("attention.scale", default=0.0) or 1.0 / math.sqrt(head_dim)


def logf(x: float) -> float:
    """glibc's logf, the one llama.cpp calls, in float32."""
    return float(libm.f32("logf")(float(np.float32(x))))


def yarn_mscale_ggml(freq_scale: float) -> float:
    """ggml's YaRN magnitude, fmaf(0.1f, logf(1 / freq_scale), 1.0f) (rope_yarn; the float64 sum is exact)."""
    f = np.float32
    return float(f(float(f(0.1)) * logf(float(f(1) / f(freq_scale))) + 1.0))


def inverse_yarn_mscale(hp: Hparams, freq_scale: float) -> float:
    """1.0f / (1.0f + 0.1f * logf(1.0f / freq_scale)) in float32 without FMA: the attn_factor mistral3.cpp and
    deepseek2.cpp hand ggml_rope_ext under YaRN, cancelling ggml's own magnitude (Family.yarn_attn_factor)."""
    f = np.float32
    return float(f(1) / f(f(f(0.1) * f(logf(float(f(1) / f(freq_scale))))) + f(1)))


# gguf-py's ExpertGatingFuncType (llama.cpp's llama_expert_gating_func_type); 0 is NONE, "the family's default"
GATING_FUNCS = {1: Gating.SOFTMAX, 2: Gating.SIGMOID, 3: Gating.SOFTMAX_WEIGHT}


def gating_from_file(default: Gating | None = None) -> Callable[[Hparams], Gating]:
    """ExpertRouting.gating_from reading expert_gating_func: required when `default` is None, else 0 or absent
    give `default`."""

    def gating(hp: Hparams) -> Gating:
        code = hp.int("expert_gating_func") if default is None else hp.int("expert_gating_func", default=0)
        if code == 0 and default is not None:
            return default
        if code not in GATING_FUNCS:
            raise GGUFError(hp.facts.path, hp.key("expert_gating_func"), f"unknown gating function {code}")
        return GATING_FUNCS[code]

    return gating


def leading_dense_ffns(hp: Hparams, n_layer: int) -> list[str]:
    """Family.layer_ffns of llama.cpp's n_layer_dense_lead: the first leading_dense_block_count layers dense."""
    n_dense = hp.int("leading_dense_block_count", default=0)
    return ["dense" if il < n_dense else "moe" for il in range(n_layer)]


def expert_width_from_ff(hp: Hparams, n_expert_used: int) -> int:
    """llama's experts are feed_forward_length wide (llama.cpp reads no expert width for it)."""
    return hp.int("feed_forward_length", minimum=1)


@dataclass(frozen=True)
class ExpertRouting:
    """How a family's mixture of experts routes, where llama.cpp fixes it per family (build_moe_ffn's arguments)
    rather than reading it from the file; used when the file has a router (ffn_gate_inp)."""

    gating: Gating = Gating.SOFTMAX
    # (hp) -> the gating, where the file says it (expert_gating_func); default: `gating`
    gating_from: Callable[[Hparams], Gating] | None = None
    normalize: bool = True  # renormalize the chosen experts' weights to sum 1
    normalize_from: Callable[[Hparams], bool] | None = None  # (hp) -> normalize, where the file says it
    weight_inputs: bool = False  # the weight multiplies the expert's input, not its output (Llama 4)
    weight_scale: Callable[[Hparams], float] = lambda hp: 1.0  # multiplies the weights (expert_weights_scale)
    # (hp, n_expert_used) -> each expert's FFN width
    expert_width: Callable[[Hparams, int], int] = expert_width_from_ff
    # (hp, expert width) -> the shared expert's FFN width, used when the file has ffn_*_shexp tensors
    shared_width: Callable[[Hparams, int], int] = lambda hp, n_ff_exp: n_ff_exp
    # (hp) -> (n_group, n_group_used) of group-limited routing (DeepSeek-V3); (0, 0): none
    groups: Callable[[Hparams], tuple[int, int]] = lambda hp: (0, 0)


@dataclass(frozen=True)
class SnapshotSpec:
    """How a Hugging Face snapshot (config.json and safetensors) of the family reads: what llama.cpp's
    convert_hf_to_gguf does for it, as data. Tensor names map through gguf-py's TensorNameMap; config.json keys
    through alchemist.snapshot.config's common table plus `config`."""

    model_types: tuple[str, ...]  # config.json "model_type" values of the family
    config: tuple[tuple[str, str], ...] = ()  # (config key, GGUF key) beyond the common table
    # the converter reorders each head's q and k rows from rotate-half to adjacent pairs (llama's NORM RoPE), and
    # writes rope.dimension_count (head_dim, or hidden_size / num_attention_heads)
    permute_qk: bool = False
    # Gemma's norms: Hugging Face stores w and computes x · (1 + w); GGUF stores 1 + w (every *norm.weight)
    norm_plus_one: bool = False
    # (old, new) replaced in each tensor name before gguf-py maps it (MLX's stacked experts, `switch_mlp`)
    renames: tuple[tuple[str, str], ...] = ()
    # (config key, the only value llama.cpp's family computes (or a function of the config giving it), why): another
    # value is refused
    requires: tuple[tuple[str, object, str], ...] = ()
    # the config.json object holding the text model's keys, where the model is multimodal ("text_config")
    text_config: str = ""
    # tensors whose names lack this are not the text model's (vision and audio towers): skipped, as the converter does
    only: str = ""
    # (config key, GGUF key, value): a per-layer list of names written as the bool array "name == value"
    flags: tuple[tuple[str, str, str], ...] = ()
    # (GGUF tensor name, config key): a table stored with fewer rows than the key says, padded with zero rows as
    # the converter pads it (gemma3n's per-layer embeddings: 262144 rows of a 262400-token vocabulary)
    pad_rows: tuple[tuple[str, str], ...] = ()
    # (pattern, name): tensors whose names match the pattern (its group "i": their index) stacked, in index order,
    # into one tensor named by the replacement (transformers' experts, one tensor each)
    stacks: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class FixtureSpec:
    """How `alchemist.fixtures` writes a tiny random-weight model of the family (tensors: from its table)."""

    vocab: str = "bpe"  # "spm" (SentencePiece, llama tokenizer) or "bpe" (GPT-2 byte-level)
    metadata: tuple[tuple[str, object], ...] = ()  # extra `<arch>.<key>` values (int -> uint32, float -> float32)
    optional: tuple[str, ...] = ()  # optional tensors (table names) to include, e.g. "output.weight"
    absent: tuple[str, ...] = ()  # tensors (file names) of those left out, where the table lets a layer go without
    embedding_std: float = 1.0  # spread of the random token embedding
    n_layer: int = 2  # more when the family's layers differ by index (e.g. RoPE on 3 of every 4)
    rope_dim: int | None = None  # partial rotary: fewer than the head's 64 dims
    alternative: str = ""  # which of the table's alternatives to write (default: the first), e.g. "moe"
    # (table name, factor): multiplies the random values of a tensor (e.g. router weights that would be ~0)
    scales: tuple[tuple[str, float], ...] = ()
    # other shapes of the same family worth their own fixture: (name, FixtureSpec), written as "<family>:<name>"
    variants: tuple[tuple[str, "FixtureSpec"], ...] = ()


@dataclass(frozen=True)
class Family:
    name: str  # general.architecture value
    tensors: tuple[TensorSpec, ...]
    rope: RopeStyle
    activation: Activation
    norm: NormKind = NormKind.RMS
    wiring: Wiring = Wiring.SEQUENTIAL
    # numbers computed from the hyperparameters (hp); defaults are llama's
    score_scale: Callable[[Hparams, int], float] = inverse_sqrt_head_dim  # (hp, head_dim) -> kq scale
    embedding_scale: Callable[[Hparams], float] = lambda hp: 1.0
    residual_scale: Callable[[Hparams], float] = lambda hp: 1.0
    logit_scale: Callable[[Hparams], float] = lambda hp: 1.0
    attn_softcap: Callable[[Hparams], float] = lambda hp: 0.0
    prescale_queries: bool = False  # llama.cpp scales Qcur before attention (and names the result Qcur)
    # (hp) -> Llama 4's temperature tuning of the queries by position, or None (the default: none)
    attn_temperature: Callable[[Hparams], AttentionTemperature | None] = lambda hp: None
    # (hp) -> q and k RMS-normed without a weight after RoPE, in the layers that rotate (Llama 4)
    rotated_qk_norm: Callable[[Hparams], bool] = lambda hp: False
    # the q projection carries a sigmoid gate per head for the attention output (table: ATTN_Q_GATED)
    gated_attention: bool = False
    # every layer mixes tokens with attention and Mamba-2 side by side, summed (falcon-h1; table: SSM_MAMBA2 without
    # its mixer tag)
    parallel_ssm: bool = False
    # multi-head latent attention (table: ATTN_MLA): keys and values through a compressed latent; score_scale
    # then gets the head size of q·k before absorption (key_length_mla)
    latent_attention: bool = False
    # a delta-net's v head h reads k head h % n_k_head (ggml_repeat's tiling), else h // (n_v_head / n_k_head)
    delta_k_heads_tiled: bool = True
    # (hp) -> the chunk of chunked attention in the sliding layers (Llama 4's local layers); 0: they slide
    attention_chunk: Callable[[Hparams], int] = lambda hp: 0
    final_softcap: Callable[[Hparams], float] = lambda hp: 0.0
    # sliding-window attention: (hp, n_layer) -> which layers slide (window: attention.sliding_window)
    sliding_layers: Callable[[Hparams, int], list[bool]] | None = None
    default_window: int = 0  # attention.sliding_window when the key is absent (0: no sliding window)
    # (hp, base, freq_scale) -> the sliding layers' (base, freq_scale); default: the same as every layer's
    swa_rope: Callable[[Hparams, float, float], tuple[float, float]] | None = None
    swa_plain_rope: bool = False  # sliding layers rotate without the model's RoPE scaling (olmo2)
    # (hp, il, sliding) -> whether layer il applies RoPE (smollm3, cohere2 skip it on some layers)
    rope_on_layer: Callable[[Hparams, int, bool], bool] = lambda hp, il, sliding: True
    # (hp, tensor names present in layer 0) -> wiring; stablelm is parallel when ffn_norm is absent
    wiring_for: Callable[[Hparams, set[str]], Wiring] | None = None
    rope_scalings: tuple[str, ...] = ("none", "linear", "yarn")
    # YaRN: (hp, freq_scale) -> the attn_factor src/models/<family>.cpp hands ggml_rope_ext where it is not
    # llama_context's (default: the magnitude is mscale(factor) · rope.scaling.attn_factor), and
    # (hp) -> (beta_fast, beta_slow) (default: llama.cpp's 32, 1)
    yarn_attn_factor: Callable[[Hparams, float], float] | None = None
    yarn_betas: Callable[[Hparams], tuple[float, float]] = lambda hp: (32.0, 1.0)
    # (hp, n_layer) -> per layer how it mixes tokens, "attention" or "conv" (default: attention everywhere);
    # a table entry with a `mixer` exists only in the layers that mix that way
    layer_mixers: Callable[[Hparams, int], list[str]] | None = None
    # (hp, n_layer) -> per layer its FFN, "dense" or "moe" (default: one kind in every layer, by the file's
    # tensors); a table entry with an `ffn` exists only in the layers whose FFN is of that kind
    layer_ffns: Callable[[Hparams, int], list[str]] | None = None
    # (hp) -> how many of the block_count layers are multi-token-prediction layers at the end (NextN), which
    # llama.cpp loads but never applies: bound as tensors the model does not read
    mtp_layers: Callable[[Hparams], int] | None = None
    output_norm: str = "output_norm.weight"  # the final norm's tensor (lfm2: token_embd_norm.weight)
    # (alchemist's tap name, llama.cpp's name for that tensor) where src/models/<family>.cpp names its
    # intermediates its own way; a name llama.cpp uses for another tensor must be mapped away from it
    tap_names: tuple[tuple[str, str], ...] = ()
    ffn_norm: str = "ffn_norm.weight"  # the pre-FFN norm's tensor (gpt-oss: post_attention_norm.weight)
    moe: ExpertRouting = ExpertRouting()
    # (hp, ir) -> ir: components beyond the classic block, added to what build_ir made (gemma3n's AltUp)
    # the model's dimensions as the family adjusts them (gemma4: its per-layer inputs' width from the file)
    model_dims: Callable[[Hparams, Dims], Dims] | None = None
    # per layer its dimensions where they differ by layer (gemma4: sliding and global layers' head sizes, KV heads
    # and FFN widths per layer): (hp, the model's dims, il, sliding) -> the layer's Dims; shapes and specs follow
    layer_dims: Callable[[Hparams, Dims, int, bool], Dims] | None = None
    components: Callable[[Hparams, ModelIR], ModelIR] | None = None
    fixture: FixtureSpec = FixtureSpec()
    notes: tuple[str, ...] = field(default=())
    snapshot: SnapshotSpec | None = None  # None: the family reads from GGUF only
