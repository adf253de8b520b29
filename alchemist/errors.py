"""Exceptions with messages a user can act on: each names the file, the field and the problem."""

from __future__ import annotations


class AlchemistError(Exception):
    """Base class for every error alchemist raises on purpose (the CLI prints these without a traceback)."""


class GGUFError(AlchemistError):
    """A GGUF file is malformed, truncated, or claims something that cannot be true."""

    def __init__(self, path: str, field: str, problem: str, offset: int | None = None):
        self.path = str(path)
        self.field = field
        self.problem = problem
        self.offset = offset
        where = f" at byte {offset}" if offset is not None else ""
        super().__init__(f"{self.path}: {field}{where}: {problem}")


class UnsupportedModelError(AlchemistError):
    """The file is a valid GGUF but describes a model alchemist cannot (yet) translate."""


class BackendUnavailableError(AlchemistError):
    """A PyTensor backend was requested whose library is not installed."""


class AuditError(AlchemistError):
    """A generated module fails the audit (alchemist.audit); the message lists the failed checks."""
