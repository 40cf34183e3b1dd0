"""Cold start: kernels load from numba's disk cache without numba's registries or its array-allocation module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quanta.backends.cpu.kernels.isa import host_isas

SRC = Path(__file__).parents[3] / "src"

# A fresh process, as at a cold start: one kernel checked against numpy, then what numba imported for it.
ONE_KERNEL = """
import sys
import numpy as np
import quanta.backends.cpu.backend
from quanta.backends.cpu import ops

x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
w = np.linspace(0.5, 1.5, 64, dtype=np.float32)
out = np.empty_like(x)
ops.rms_norm_rows(x, w, np.float32(1e-6), out)
ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
assert np.allclose(out, ref, rtol=1e-5, atol=1e-6), np.abs(out - ref).max()
print(sum(ops._RMS[0].stats.cache_hits.values()), "numba.np.linalg" in sys.modules)
"""

# A cached kernel loaded without its module for linking, then a new compilation that links (inlines) it.
LINKED = """
import numba
import numpy as np
import quanta.backends.cpu.backend
from quanta.backends.cpu import ops

x = np.random.default_rng(1).standard_normal((3, 96)).astype(np.float32)
w = np.linspace(0.5, 1.5, 96, dtype=np.float32)
out, twice = np.empty_like(x), np.empty_like(x)
ops.rms_norm_rows(x, w, np.float32(1e-6), out, exact=False)
library = next(iter(ops._RMS_FAST.overloads.values())).library
freed = library._shared_module is None


@numba.njit
def norm_twice(x, w, eps, out):
    ops._RMS_FAST(x, w, eps, out)
    ops._RMS_FAST(out, w, eps, out)


norm_twice(x, w, np.float32(1e-6), twice)
ref = np.empty_like(x)
ops.rms_norm_rows(out, w, np.float32(1e-6), ref, exact=False)
assert np.array_equal(twice, ref)
print(sum(ops._RMS_FAST.stats.cache_hits.values()), freed)
"""

# A prefill (8 tokens: the GEMM kernels) and decode steps (the GEMV kernels) of a real model.
GENERATE = """
import sys
from quanta import LLM

llm = LLM(sys.argv[1], threads=2, n_ctx=64)
llm.generate(list(range(1000, 1008)), max_tokens=3, temperature=0.0, ignore_eos=True)
print(" ".join(m for m in ("numba.np.linalg", "numba.np.arrayobj") if m in sys.modules) or "-")
"""


def _fresh_run(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_cached_kernel_loads_without_numbas_registries_and_computes_right():
    _fresh_run(ONE_KERNEL)  # compiles and fills the disk cache when it is cold
    hits, registries_loaded = _fresh_run(ONE_KERNEL).split()
    assert hits == "1"  # loaded from the disk cache...
    assert registries_loaded == "False"  # ...without importing numba's typing/lowering registries (linalg, ...)


def test_a_cached_kernel_keeps_no_llvm_module_and_still_links_into_a_new_compilation():
    """The loader frees a cached kernel's parsed IR (megabytes per GEMV kernel, kept by numba only for linking);
    a later compilation calling the kernel parses its bitcode again and computes the same."""
    _fresh_run(LINKED)  # fills the disk cache when it is cold
    hits, freed = _fresh_run(LINKED).split()
    assert hits == "1" and freed == "True"


@pytest.mark.skipif(not host_isas(), reason="the fp32 fallback kernels still allocate inside numba")
def test_generating_imports_neither_numbas_registries_nor_its_allocation_module(smollm2_path):
    """Each costs 20-90 ms of every cold start: a kernel that calls np.empty, reshape or a checked slice copy
    brings numba.np.arrayobj back (its cached environment is rebuilt by importing the module)."""
    _fresh_run(GENERATE, str(smollm2_path))
    assert _fresh_run(GENERATE, str(smollm2_path)) == "-"


def test_every_cached_kernel_has_its_own_disk_cache_entry():
    """numba names a kernel's cache files after its function and line, not its compile flags: two builds of one
    function (the serial and parallel attention) shared them, and a process loaded the other build and crashed."""
    from numba.core.registry import CPUDispatcher

    import quanta.backends.cpu.backend  # noqa: F401  (imports every kernel module)

    paths: dict[str, CPUDispatcher] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("quanta.backends.cpu"):
            continue
        for attr, value in vars(module).items():
            cache = getattr(value, "_cache", None)
            if isinstance(value, CPUDispatcher) and hasattr(cache, "_cache_file"):
                path = cache._cache_file._index_path
                assert paths.setdefault(path, value) is value, path  # one dispatcher (maybe imported elsewhere)
    assert any("attention_kernel_serial" in p for p in paths)
