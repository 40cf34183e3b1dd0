"""The default device, "auto": the GPU where an NVIDIA driver, torch with CUDA and triton are all present, else the
CPU, decided without importing torch on a machine that has no NVIDIA driver."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quanta import backends
from quanta.backends import get_backend, resolve_device


def test_named_devices_are_kept() -> None:
    assert [resolve_device(d) for d in ("cpu", "cuda", "cuda:1")] == ["cpu", "cuda", "cuda:1"]


def test_auto_is_the_cpu_without_an_nvidia_driver_and_imports_no_torch() -> None:
    code = ("import sys, quanta.backends as b\n"
            "b._nvidia_driver = lambda: False\n"
            "print(b.resolve_device('auto'), b.get_backend(threads=1).name, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["cpu", "cpu", "False"]


def test_auto_with_a_driver_needs_torch_with_cuda(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    monkeypatch.setattr(backends, "_nvidia_driver", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"  # a driver, but a CPU build of torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    monkeypatch.setitem(sys.modules, "torch", None)  # torch not installed
    assert resolve_device("auto") == "cpu"


def test_auto_backend_on_this_machine_matches_its_hardware() -> None:
    torch = pytest.importorskip("torch")
    want = "cuda" if backends._nvidia_driver() and torch.cuda.is_available() else "cpu"
    assert get_backend("auto", threads=1).name == want
