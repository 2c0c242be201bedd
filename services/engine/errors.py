"""Error types the engine raises; each carries a message meant for the person who passed the input."""

from __future__ import annotations


class SpecsplitError(Exception):
    """Base class for every error specsplit reports to a user."""


class ModelFormatError(SpecsplitError):
    """A model file is not what it claims to be: wrong magic, truncated, corrupt, missing tensor."""

    def __init__(self, path: str, expected: str, found: str, offset: int | None = None):
        self.path = str(path)
        self.expected = expected
        self.found = found
        self.offset = offset
        where = f" at byte offset {offset}" if offset is not None else ""
        super().__init__(f"{self.path}{where}: expected {expected}, found {found}")


class UnsupportedModelError(SpecsplitError):
    """The file is well formed but describes something specsplit cannot run (architecture, quant type)."""


class DrafterMismatchError(SpecsplitError):
    """The drafter does not fit the target (hidden size, vocabulary, layer ids)."""


class ContextOverflowError(SpecsplitError):
    """A request needs more context than the model or the cache was given."""

    def __init__(self, needed: int, available: int):
        self.needed = needed
        self.available = available
        super().__init__(f"request needs {needed} tokens of context but only {available} are available")


class InvalidRequestError(SpecsplitError):
    """A request field has a bad value."""

    def __init__(self, message: str, param: str | None = None):
        self.param = param
        super().__init__(message)
