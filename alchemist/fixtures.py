"""Tiny random-weight GGUF files for every supported family, written with `gguf.GGUFWriter`.

They load in llama.cpp (an independent oracle) and in alchemist, so every architecture and weight type
can be tested without downloading a model. Shapes are multiples of 256 so that llama.cpp can quantize
them to the K-quant types. `alchemist fixture --arch qwen3 --quant Q4_K -o x.gguf` is the CLI front.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import gguf

from alchemist.tokenizer.tokenizer import BYTE_TO_UNICODE

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")


@dataclass(frozen=True)
class FixtureConfig:
    arch: str
    n_vocab: int = 512
    n_embd: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 64
    n_ff: int = 512
    n_ctx: int = 512
    rms_eps: float = 1e-6
    rope_base: float = 10000.0
    sliding_window: int = 8  # gemma3 only: small, so short tests cross the window
    swa_pattern: int = 2  # gemma3 only: layer 0 local, layer 1 global
    tied_output: bool | None = None  # default: gemma3 and llama tied, qwen untied
    final_logit_softcap: float = 0.0  # gemma3 only: <arch>.final_logit_softcapping when > 0
    seed: int = 0


def _spm_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: specials, 256 byte tokens, then word pieces."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    words = ["the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by"]
    pieces += ["▁" + w for w in words] + words
    i = 0
    while len(tokens) + len(pieces) < n_vocab:
        pieces.append(f"▁w{i}")
        i += 1
    pieces = pieces[: n_vocab - len(tokens)]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def _bpe_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A GPT-2 byte-level BPE vocabulary with a few merges (llama.cpp requires at least one)."""
    # GPT-2's byte -> printable character map, in its own order (the tokenizer's table)
    byte_chars = list(BYTE_TO_UNICODE.values())
    tokens = list(byte_chars)
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    while len(tokens) + len(specials) < n_vocab:
        tokens.append(f"x{len(tokens)}")
    tokens += specials
    types = [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(specials)) + [int(gguf.TokenType.CONTROL)] * len(specials)
    return tokens, types, merges


def write_fixture(path: str | Path, arch: str, weight_type: str = "F32", config: FixtureConfig | None = None) -> Path:
    """Write a random-weight GGUF for `arch` with 2-D weights stored as `weight_type` ("F32" or "F16")."""
    if arch not in FAMILIES:
        raise ValueError(f"unknown fixture architecture {arch!r} (choose from {', '.join(FAMILIES)})")
    if weight_type not in ("F32", "F16"):
        raise ValueError("write_fixture stores F32 or F16; use quantize_fixture for quantized types")
    cfg = config or FixtureConfig(arch=arch)
    rng = np.random.default_rng(cfg.seed)
    tied = cfg.tied_output if cfg.tied_output is not None else arch in ("gemma3", "llama")
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"alchemist tiny {arch} fixture")
    w.add_context_length(cfg.n_ctx)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if weight_type == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", cfg.swa_pattern)
        if cfg.final_logit_softcap:
            w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcap)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)

    if arch in ("gemma3", "llama"):
        tokens, scores, types = _spm_vocab(cfg.n_vocab)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
    else:
        tokens, types, merges = _bpe_vocab(cfg.n_vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(len(tokens) - 3)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_add_bos_token(False)

    wdtype = np.float32 if weight_type == "F32" else np.float16
    d, f, hd = cfg.n_embd, cfg.n_ff, cfg.head_dim
    nq, nkv = cfg.n_head * hd, cfg.n_kv_head * hd

    def mat(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(wdtype)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    embd = rng.standard_normal((cfg.n_vocab, d)) * (0.05 if arch == "gemma3" else 1.0)
    w.add_tensor("token_embd.weight", embd.astype(wdtype))
    w.add_tensor("output_norm.weight", norm(d))
    if not tied:
        # Random output rows give flat logits whose top-2 gaps are as small as llama.cpp's activation-
        # quantization noise. Like a tied model, start from the embedding (the residual stream carries
        # it, so predictions are decisive) and perturb it, so the untied path is still its own tensor.
        out = embd / np.sqrt(d) * 4.0 + 0.5 * rng.standard_normal((cfg.n_vocab, d)) / np.sqrt(d)
        w.add_tensor("output.weight", out.astype(wdtype))
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(d))
        w.add_tensor(p + "attn_q.weight", mat(nq, d))
        w.add_tensor(p + "attn_k.weight", mat(nkv, d))
        w.add_tensor(p + "attn_v.weight", mat(nkv, d))
        if arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", bias(nq))
            w.add_tensor(p + "attn_k.bias", bias(nkv))
            w.add_tensor(p + "attn_v.bias", bias(nkv))
        if arch in ("qwen3", "gemma3"):
            w.add_tensor(p + "attn_q_norm.weight", norm(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm(hd))
        w.add_tensor(p + "attn_output.weight", mat(d, nq))
        w.add_tensor(p + "ffn_norm.weight", norm(d))
        w.add_tensor(p + "ffn_gate.weight", mat(f, d))
        w.add_tensor(p + "ffn_up.weight", mat(f, d))
        w.add_tensor(p + "ffn_down.weight", mat(d, f))
        if arch == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", norm(d))
            w.add_tensor(p + "post_ffw_norm.weight", norm(d))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
