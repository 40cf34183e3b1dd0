"""The CUDA backend: Triton kernels on torch CUDA tensors (see backend.py)."""

from quanta.backends.cuda.backend import CUDABackend

__all__ = ["CUDABackend"]
