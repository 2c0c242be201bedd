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


class DeviceMemoryError(SpecsplitError):
    """A device (or host) allocation failed while a request ran: the request is stopped, the server goes on.

    The memory plan is meant to make this impossible (services/engine/memory_plan.py); when it happens anyway
    (another process took the GPU's memory, an accounting gap) the verifier answers RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, device: str = ""):
        self.device = device
        super().__init__(message)


_CUDA_OUT_OF_MEMORY = 2     # cudaErrorMemoryAllocation (runtime) and CUDA_ERROR_OUT_OF_MEMORY (driver) alike


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocation failure: DeviceMemoryError, MemoryError (NumPy, pinned host memory), CuPy's
    OutOfMemoryError (its pool), or a CUDA runtime / driver error of status out-of-memory (an allocation outside
    the pool, a graph instantiation, a launch). Duck-typed, so that it works (and is tested) without CuPy."""
    if isinstance(e, (DeviceMemoryError, MemoryError)):
        return True
    name, module = type(e).__name__, type(e).__module__ or ""
    if not module.startswith("cupy"):        # cupy.* and cupy_backends.*
        return False
    if name == "OutOfMemoryError":
        return True
    return name in ("CUDARuntimeError", "CUDADriverError") and getattr(e, "status", None) == _CUDA_OUT_OF_MEMORY
