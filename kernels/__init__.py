"""CUDA kernel sources and their CuPy launchers; each kernel has a NumPy twin in services/engine."""
