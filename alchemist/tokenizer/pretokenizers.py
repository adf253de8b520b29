"""What llama.cpp does for each `tokenizer.ggml.pre` value of a byte-level BPE ("gpt2") vocabulary.

`llama_vocab::impl::load` maps the pre name to a pre type and sets a few flags (ignore_merges, clean_spaces,
add_bos, a null BOS); `llm_tokenizer_bpe` maps the pre type to a list of regexes (`_llama_regexes.py`, a
mechanical transcription). llama.cpp applies the regexes in order, each one splitting every piece the
previous ones produced and keeping matches and gaps alike: Hugging Face's `Split(regex, "isolated")`.

One adaptation: llama.cpp runs regexes without a hand-written splitter through std::regex on a
"category-collapsed" copy of the text, where `\\p{Lu}`, `\\p{Ll}`, `\\p{Lt}`, `\\p{Lm}` and `\\p{Lo}` all become
"any letter" (and match ASCII letters of either case). `llama_regex()` rewrites them to `\\p{L}` so that
Oniguruma (inside `tokenizers`) does what llama.cpp does rather than what the original tokenizer.json meant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from alchemist.tokenizer._llama_regexes import LLAMA_CPP_REGEXES


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's behaviour for one pre type of a BPE vocabulary."""

    name: str  # the tokenizer.ggml.pre value
    pre_type: str  # llama.cpp LLAMA_VOCAB_PRE_TYPE_* in lower case
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    clean_spaces: bool = True  # llama.cpp's default for BPE vocabularies
    add_bos: bool | None = None  # None: the BPE default (False) unless the GGUF says otherwise
    bos_is_null: bool = False  # chatglm/glm4: no BOS unless the GGUF sets one


_SUBCATEGORY = re.compile(r"\\p\{L[ultmo]\}")


def llama_regex(expr: str) -> str:
    """The regex as llama.cpp effectively runs it (letter subcategories collapse to \\p{L})."""
    return _SUBCATEGORY.sub(r"\\p{L}", expr)


# pre name -> (pre type, flags). Transcribed from the if/else chain in llama_vocab::impl::load.
_NO_CLEAN = {"clean_spaces": False}
_PRE_NAMES: dict[str, tuple[str, dict]] = {
    "default": ("default", {}),
    "minicpm5": ("minicpm5", {"ignore_merges": True}),
    **{
        n: ("llama3", {"ignore_merges": True, "add_bos": True})
        for n in (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        )
    },
    "deepseek-llm": ("deepseek_llm", _NO_CLEAN),
    "deepseek-coder": ("deepseek_coder", _NO_CLEAN),
    "deepseek-v3": ("deepseek3_llm", _NO_CLEAN),
    "spark2_5": ("spark2_5", _NO_CLEAN),
    "youtu": ("youtu", {"clean_spaces": False, "ignore_merges": True}),
    "falcon": ("falcon", {}),
    "mpt": ("mpt", {}),
    "starcoder": ("starcoder", {}),
    **{
        n: ("gpt2", {})
        for n in (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "exaone4",
        )
    },
    "jais-2": ("jais2", {}),
    "refact": ("refact", {}),
    "command-r": ("command_r", _NO_CLEAN),
    **{n: ("qwen2", _NO_CLEAN) for n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2")},
    "qwen35": ("qwen35", _NO_CLEAN),
    "stablelm2": ("stablelm2", {}),
    "olmo": ("olmo", {}),
    "dbrx": ("dbrx", {}),
    "smaug-bpe": ("smaug", {}),
    "poro-chat": ("poro", _NO_CLEAN),
    "chatglm-bpe": ("chatglm4", {"bos_is_null": True}),
    "glm4": ("chatglm4", {"bos_is_null": True, "ignore_merges": True}),
    "glm5": ("chatglm4", {"bos_is_null": True, "ignore_merges": True}),
    "viking": ("viking", _NO_CLEAN),
    "jais": ("jais", {}),
    "tekken": ("tekken", {"clean_spaces": False, "ignore_merges": True, "add_bos": True}),
    "smollm": ("smollm", _NO_CLEAN),
    "codeshell": ("codeshell", {}),
    "bloom": ("bloom", {}),
    "gpt3-finnish": ("gpt3_finnish", {}),
    "exaone": ("exaone", {}),
    "exaone-moe": ("exaone_moe", {}),
    "chameleon": ("chameleon", {"add_bos": True, "clean_spaces": False}),
    "minerva-7b": ("minerva", {}),
    "megrez": ("qwen2", {}),
    **{n: ("gpt4o", _NO_CLEAN) for n in ("gpt-4o", "llama4", "kanana2", "talkie")},
    "granite-embed-multi-97m": ("granite_emb_multi", {"clean_spaces": False, "ignore_merges": True}),
    "trillion": ("trillion", _NO_CLEAN),
    "granite-docling": ("granite_docling", _NO_CLEAN),
    **{n: ("bailingmoe", _NO_CLEAN) for n in ("bailingmoe", "bailingmoe2", "llada-moe")},
    "seed-coder": ("seed_coder", _NO_CLEAN),
    "hunyuan": ("hunyuan", _NO_CLEAN),
    "hunyuan-dense": ("hunyuan_dense", _NO_CLEAN),
    "hy_v4": ("hy_v4", _NO_CLEAN),
    "joyai-llm": ("joyai_llm", _NO_CLEAN),
    "ufakzeka": ("ufakzeka", _NO_CLEAN),
    "grok-2": ("grok_2", _NO_CLEAN),
    "minimax-m2": ("minimax_m2", _NO_CLEAN),
    "solar-open": ("solar_open", _NO_CLEAN),
    "mellum2": ("mellum2", {}),
}

SUPPORTED_PRE = tuple(sorted(n for n, (t, _) in _PRE_NAMES.items() if t in LLAMA_CPP_REGEXES))


def pre_tokenizer_for(pre: str | None) -> PreTokenizer | None:
    """llama.cpp's behaviour for a `tokenizer.ggml.pre` value, or None when alchemist does not support it.

    A missing or empty value is llama.cpp's 'default' (it warns that quality will be degraded)."""
    name = pre or "default"
    entry = _PRE_NAMES.get(name)
    if entry is None or entry[0] not in LLAMA_CPP_REGEXES:
        return None
    pre_type, flags = entry
    return PreTokenizer(name, pre_type, tuple(llama_regex(r) for r in LLAMA_CPP_REGEXES[pre_type]), **flags)
