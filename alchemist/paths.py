"""Where alchemist keeps what it can rebuild: assembled models, generated modules, rewritten graphs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_subdir(name: str) -> Path:
    """$ALCHEMIST_CACHE/<name> (default ~/.cache/alchemist/<name>), created if missing."""
    base = os.environ.get("ALCHEMIST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "alchemist")
    path = Path(base) / name
    path.mkdir(parents=True, exist_ok=True)
    return path
