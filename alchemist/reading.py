"""One entry to a model's facts: a GGUF file, or a Hugging Face snapshot directory (config.json and safetensors)."""

from __future__ import annotations

import os


def read_model(path: str | os.PathLike):
    """GGUFFacts of a GGUF file, or SnapshotFacts of a snapshot directory: the same view for the families."""
    from alchemist.gguf_io import read_gguf
    from alchemist.snapshot import is_snapshot, read_snapshot

    return read_snapshot(path) if is_snapshot(path) else read_gguf(path)
