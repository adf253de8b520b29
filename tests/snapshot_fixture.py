"""Hugging Face snapshots for the tests, written from a GGUF fixture by undoing what convert_hf_to_gguf does: GGUF
keys back to config.json keys, GGUF names back to Hugging Face names (gguf-py's TensorNameMap, read backwards),
llama's q/k rows back to rotate-half order, each tensor stored as F32, F16 or BF16 in one or more safetensors
files (with model.safetensors.index.json when sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from alchemist.arch import FAMILIES
from alchemist.gguf_io import read_gguf
from alchemist.snapshot.facts import COMMON_CONFIG


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """tensors: name -> (dtype, array of the bytes to store: float32, float16, or uint16 bits for BF16)."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (as torch and MLX round)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# transformers' own names, where gguf-py's map lists other models' names for the same GGUF tensor first
TRANSFORMERS_NAMES = ("embed_tokens", "norm", "lm_head", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                      "mlp.down_proj", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm", "mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj",
                      "mlp.experts.down_proj")  # fmt: skip


def _hf_names(arch: str, n_layer: int) -> dict[str, str]:
    """GGUF name (without .weight/.bias) -> the Hugging Face name (transformers') that maps to it."""
    model_arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    candidates: dict[str, list[str]] = {}
    for hf, (_, name) in gguf.get_tensor_name_map(model_arch, n_layer).mapping.items():
        top = ("model.embed", "model.norm", "model.layers.", "model.per_layer", "model.altup")
        if hf.startswith(top) and ".layers.layers." not in hf or hf == "lm_head":
            candidates.setdefault(name, []).append(hf)

    def rank(hf: str) -> int:
        tail = hf.split(".", 3)[-1] if hf.startswith("model.layers.") else hf.removeprefix("model.")
        return 0 if tail in TRANSFORMERS_NAMES else 1

    return {name: min(hfs, key=rank) for name, hfs in candidates.items()}


def write_tokenizer(facts, out: Path, chat_template: str | None = None) -> None:
    """tokenizer.json (built with the tokenizers library from the GGUF's vocabulary: a byte-level BPE with its
    merges, or a SentencePiece-style unigram over its pieces with byte fallback) and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    meta = facts.metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    control = [i for i, t in enumerate(types) if t == int(gguf.TokenType.CONTROL)]
    if meta["tokenizer.ggml.model"] == "gpt2":
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
        tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
    else:
        scores = [float(x) for x in meta["tokenizer.ggml.scores"]]
        unk = next((i for i, t in enumerate(types) if t == int(gguf.TokenType.UNKNOWN)), 0)
        tk = Tokenizer(models.Unigram(list(zip(tokens, scores)), unk_id=unk, byte_fallback=True))
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(" ", 1, 0)])  # fmt: skip
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    tk.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}
    for key, field in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id")):
        if field in meta:
            config[key] = tokens[int(meta[field])]
    if chat_template:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def snapshot_from_gguf(gguf_path, out_dir, dtype: str = "F32", shards: int = 1, tokenizer: bool = False,
                       chat_template: str | None = None, per_expert: bool = False) -> Path:  # fmt: skip
    """per_expert: experts one tensor each (transformers' mlp.experts.N.*), not MLX's stacked switch_mlp."""
    facts = read_gguf(gguf_path)
    family = FAMILIES[facts.architecture]
    arch, spec = family.name, family.snapshot
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = facts.metadata
    config = {"model_type": spec.model_types[0], "tie_word_embeddings": "output.weight" not in facts.tensors,
              "vocab_size": facts.tensors["token_embd.weight"].shape[0]}  # fmt: skip
    for keys, key in (*COMMON_CONFIG, *(((k,), g) for k, g in spec.config)):
        if f"{arch}.{key}" in meta and keys[0] not in config:
            value = meta[f"{arch}.{key}"]
            config[keys[0]] = value.item() if hasattr(value, "item") else value
    if spec.norm_plus_one:  # Gemma: transformers' (and mlx-lm's) scale is query_pre_attn_scalar ** -0.5
        config["query_pre_attn_scalar"] = config["head_dim"]
    for key, value, _ in spec.requires:  # what llama.cpp's family computes (mlx-lm wants them said)
        config[key] = value
    if "num_local_experts" in config:  # transformers' qwen3_moe (and mlx-lm) say num_experts
        config["num_experts"] = config.pop("num_local_experts")
    config.setdefault("intermediate_size", config.get("moe_intermediate_size"))
    for key, gguf_key, value in spec.flags:  # a bool array back to the per-layer names (gemma3n's layer types)
        config[key] = [value if f else "full_attention" for f in meta[f"{arch}.{gguf_key}"]]
    if spec.text_config:  # multimodal: the text model's keys in their own object, beside the model type
        n = int(meta[f"{arch}.block_count"])
        config.update({key: value(config) if callable(value) else value for key, value, _ in spec.requires})
        config.update(model_type="gemma3n_text", altup_coef_clip=None, vocab_size_per_layer_input=config["vocab_size"],
                      num_kv_shared_layers=max(0, n - 20), rope_theta=config.get("rope_theta", 10000.0))  # fmt: skip
        config.update({key: value(config) if callable(value) else value for key, value, _ in spec.requires})
        config = {"model_type": spec.model_types[0], spec.text_config: config}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    config = config.get(spec.text_config, config)
    n_layer = int(meta[f"{arch}.block_count"])
    hf = _hf_names(arch, n_layer)
    heads = {"attn_q": config["num_attention_heads"],
             "attn_k": config.get("num_key_value_heads", config["num_attention_heads"])}  # fmt: skip
    tensors = {}
    for name, info in facts.tensors.items():
        base, suffix = name.rsplit(".", 1)
        values = facts.tensor_bytes(name).view(np.float32).reshape(info.shape)
        kind = base.split(".")[-1]
        if spec.permute_qk and kind in heads:  # undo permute(W, n_head): adjacent pairs back to rotate-half
            n = heads[kind]
            values = (
                values.reshape(n, values.shape[0] // n // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
            )
        if spec.norm_plus_one and name.endswith("norm.weight"):  # Hugging Face stores Gemma's w, GGUF 1 + w
            values = values - np.float32(1.0)
        stored = {"F32": values, "F16": values.astype(np.float16), "BF16": bf16_bits(values)}[dtype]
        hf_name = hf[base]
        if per_expert and ".mlp.experts." in hf_name:  # transformers' form: one tensor per expert
            prefix, kind = hf_name.rsplit(".mlp.experts.", 1)
            for e in range(stored.shape[0]):
                tensors[f"{prefix}.mlp.experts.{e}.{kind}.{suffix}"] = (dtype, np.ascontiguousarray(stored[e]))
            continue
        full = f"{hf_name}.{suffix}"
        for new, old in reversed(spec.renames):  # back to the stored form (MLX's switch_mlp, gemma3n's prefix)
            full = full.replace(old, new, 1)
        if hf_name.endswith("_projections"):  # gemma3n's AltUp projections: one tensor each in every snapshot
            for j in range(stored.shape[0]):
                tensors[f"{full.removesuffix('.' + suffix)}.{j}.{suffix}"] = (dtype, np.ascontiguousarray(stored[j]))
            continue
        tensors[full] = (dtype, stored)
    names = list(tensors)
    parts = [names[i::shards] for i in range(shards)]
    files = (
        ["model.safetensors"]
        if shards == 1
        else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    )
    for file, part in zip(files, parts):
        write_safetensors(out / file, {n: tensors[n] for n in part})
    if tokenizer:
        write_tokenizer(facts, out, chat_template)
    if shards > 1:
        weight_map = {n: f for f, part in zip(files, parts) for n in part}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def mlx_quantized(snapshot, out_dir, bits: int | None = 4, group_size: int | None = 32, overrides=None,
                  mode: str = "affine") -> Path:  # fmt: skip
    """The snapshot quantized by mlx-lm's own quantizer (affine; `overrides`: {module path suffix: {"bits",
    "group_size"}}), saved as mlx-lm saves it: the packed weights with their scales and biases, and config.json's
    `quantization`."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    overrides = overrides or {}

    def predicate(path, module):
        return next((v for suffix, v in overrides.items() if path.endswith(suffix)), True)

    model, config = load_model(Path(snapshot))
    model, config = quantize_model(
        model, config, group_size=group_size, bits=bits, mode=mode, quant_predicate=predicate
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


# small configs of mlx-lm's own model classes (config.json as transformers writes it for these model types)
MLX_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=320, rope_theta=10000.0,
                  max_position_embeddings=256, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, vocab_size=320,
                  rope_theta=1000000.0, max_position_embeddings=256, tie_word_embeddings=True),
    # gemma3n's text model in its multimodal config, at llama.cpp's constants (AltUp, LAuReL, per-layer widths)
    "gemma3n": dict(model_type="gemma3n", text_config=dict(
        model_type="gemma3n_text", hidden_size=128, num_hidden_layers=5, intermediate_size=[256] * 5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, vocab_size=320,
        vocab_size_per_layer_input=320, num_kv_shared_layers=0, sliding_window=4, max_position_embeddings=256,
        rope_local_base_freq=10000.0, rope_theta=1000000.0, final_logit_softcapping=30.0,
        layer_types=["sliding_attention"] * 4 + ["full_attention"], activation_sparsity_pattern=[0.95] * 5,
        hidden_size_per_layer_input=256, altup_num_inputs=4, altup_coef_clip=120.0, altup_correct_scale=True,
        altup_active_idx=0, laurel_rank=64)),
}  # fmt: skip


def mlx_random_snapshot(model_type: str, out_dir, seed: int = 0) -> Path:
    """A random-weight snapshot written by mlx-lm's own model class for `model_type` (no GGUF involved): the
    weights as mlx-lm initializes them (norms at 1; embeddings and projections scaled up, for decisive logits)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import save_config, save_model

    config = MLX_CONFIGS[model_type]
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    params = [(k, v * 4.0 if v.ndim == 2 else v) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(dict(config), out / "config.json")
    return out
