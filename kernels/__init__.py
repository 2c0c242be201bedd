"""CUDA kernel sources and their CuPy launchers; each kernel has a NumPy twin in services/engine."""

from .loader import KernelCompileError, KernelUnavailableError, available, unavailable_reason

__all__ = ["KernelCompileError", "KernelUnavailableError", "available", "unavailable_reason"]
