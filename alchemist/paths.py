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


def remember(path: Path, data: str | bytes) -> bool:
    """Write a cache file atomically (a temporary file, then a rename, so readers never see half of it).

    Returns False instead of raising when the cache cannot be written (read-only or full disk): a cache
    that cannot be kept only costs recomputing next time."""
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True
