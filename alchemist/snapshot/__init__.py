"""Hugging Face snapshot directories (config.json and safetensors) as a second input beside GGUF files."""

from alchemist.snapshot.facts import SnapshotFacts, is_snapshot, read_snapshot
from alchemist.snapshot.safetensors import SnapshotError, read_safetensors

__all__ = ["SnapshotError", "SnapshotFacts", "is_snapshot", "read_safetensors", "read_snapshot"]
