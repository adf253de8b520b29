"""alchemist's version, recorded in every generated module's provenance (a leaf: the package imports it)."""

__version__ = "0.1.0"  # pyproject.toml reads it from here
