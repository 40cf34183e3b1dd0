"""Without a CUDA device the Triton kernels run on CPU tensors under TRITON_INTERPRET=1.

Triton decides at decoration time whether a kernel is interpreted, so the variable is set before triton and the
kernel modules are imported (a copy of ours imported earlier without it is dropped; if another test imported
triton first, run this directory on its own or with TRITON_INTERPRET=1 in the environment).
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # before triton's own import: its library functions (tl.zeros …) are decorated at import time too
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in [m for m in sys.modules if m.startswith("quanta.backends.cuda")]:
        del sys.modules[_name]
pytest.importorskip("triton")


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def few_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode GEMV tiles of many rows each (even, as the rope epilogue needs), so a forward launches few programs:
    the interpreter runs them one by one. On a GPU the tuned tiles stay."""
    if HAS_CUDA:
        return
    from quanta.backends.cuda import q8gemv, qmatmul

    for table in (qmatmul.GEMV_CONFIG, q8gemv.Q8_CONFIG):
        for key in list(table):
            monkeypatch.setitem(table, key, {"BN": 32, "BJ": 8, "num_warps": 1})
