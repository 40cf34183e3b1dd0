"""Backends: one per device, each implementing quanta.backends.base.Backend."""

from __future__ import annotations

import os
import shutil

from quanta.backends.base import Backend
from quanta.errors import QuantaError

DEVICES = ("auto", "cpu", "cuda")


def _nvidia_driver() -> bool:
    """Whether an NVIDIA driver is installed (looked up without importing torch, so a CPU machine pays nothing)."""
    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None


def resolve_device(device: str) -> str:
    """``"auto"``: ``"cuda"`` where an NVIDIA GPU, torch with CUDA and triton are all present, else ``"cpu"``;
    any other name as given."""
    if device != "auto":
        return device
    if not _nvidia_driver():
        return "cpu"
    try:
        import torch
        import triton  # noqa: F401 (the CUDA backend's kernels)
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_backend(device: str = "auto", *, threads: int | None = None, exact: bool = False,
                cpu_isa: str | None = None, cuda: dict | None = None) -> Backend:
    """The backend for ``device`` ("auto", "cpu", "cuda" or "cuda:N"; ``resolve_device`` picks for "auto");
    imported lazily (torch only for CUDA). ``cpu_isa`` forces the CPU's int8 kernels (None: the fastest);
    ``cuda``: the CUDA backend's switches (``q8``, ``pdl``, ``compile_ahead``: CUDABackend's arguments)."""
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if not isinstance(device, str):
        raise ValueError(f"device must be a string (one of {', '.join(DEVICES)}, or cuda:N), got {device!r}")
    device = resolve_device(device)
    kind, _, index = device.partition(":")
    if index and not (kind == "cuda" and index.isdigit()):
        raise ValueError(f"unknown device {device!r} (supported: {', '.join(DEVICES)}, or cuda:N with N a GPU index)")
    if kind == "cpu":
        from quanta.backends.cpu.backend import CPUBackend

        return CPUBackend(threads=threads, exact=exact, isa=cpu_isa)
    if kind == "cuda":
        try:
            from quanta.backends.cuda import CUDABackend
        except ImportError as e:
            raise QuantaError(f"the CUDA backend is not available: {e}") from None
        return CUDABackend(device=device, exact=exact, **(cuda or {}))
    raise ValueError(f"unknown device {device!r} (supported: {', '.join(DEVICES)})")
