"""Pictures without pyplot: a matplotlib Figure drawn off-screen and saved reproducibly.

No global backend is switched (`matplotlib.use` inside a library call would change a notebook user's backend):
a bare Figure renders through the backend its file's extension names (Agg for PNG, the SVG writer for SVG).
Saved files carry no date or software version, so the same picture gives the same bytes.
"""

from __future__ import annotations

from pathlib import Path


def figure(width: float, height: float, **kwargs):
    """A new off-screen Figure of width x height inches."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), **kwargs)


def save(fig, path: str | Path, dpi: int = 120, **kwargs) -> Path:
    """Write fig to path (.png or .svg, by extension), creating the folder; returns the path."""
    import matplotlib

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"Date": None} if path.suffix.lower() == ".svg" else {"Software": None}
    with matplotlib.rc_context({"svg.hashsalt": "alchemist"}):  # SVG ids from a fixed salt, not a random one
        fig.savefig(path, dpi=dpi, metadata=metadata, **kwargs)
    return path
