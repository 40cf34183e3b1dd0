"""Backends: one per device, each implementing quanta.backends.base.Backend."""

from __future__ import annotations

from quanta.backends.base import Backend
from quanta.errors import QuantaError

DEVICES = ("cpu", "cuda")


def get_backend(device: str = "cpu", *, threads: int | None = None, exact: bool = False) -> Backend:
    """The backend for ``device`` ("cpu", "cuda" or "cuda:N"); imported lazily (torch only for CUDA)."""
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    kind = str(device).split(":")[0]
    if kind == "cpu":
        from quanta.backends.cpu.backend import CPUBackend

        return CPUBackend(threads=threads, exact=exact)
    if kind == "cuda":
        try:
            from quanta.backends.cuda import CUDABackend
        except ImportError as e:
            raise QuantaError(f"the CUDA backend is not available: {e}") from None
        return CUDABackend(device=str(device), exact=exact)
    raise ValueError(f"unknown device {device!r} (supported: {', '.join(DEVICES)})")
