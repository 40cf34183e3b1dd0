"""Compile the Triton kernels a workload launches for Hopper (sm_90, the H100/H200 of the GPU machines) on a machine
without a GPU: Triton's own compiler and the ptxas it ships, as the first launch on the GPU would.

The interpreter (``TRITON_INTERPRET=1``) checks what a kernel computes but never compiles it, so a kernel that the
compiler rejects (an operation it does not lower, a layout it cannot make, too much shared memory) passes every
interpreted test. :func:`recording` notes each interpreted launch's specialization (argument types, constexpr
values, launch options) without running it; ``python hopper_compile.py RECORDS.json``, run without the
interpreter, compiles each one.
What the interpreter launches differently from a GPU is set as the GPU would: ``PDL`` on (with ``launch_pdl``), the
interpreter's ``UPCAST`` off. The local Triton may be newer than the GPU machine's (3.9 against 3.6 on
2026-12-07, when the records compiled on both: docs/PERF.md, session 62).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg")
ON_THE_GPU = {"PDL": True, "UPCAST": False}  # constexprs the interpreted backend sets otherwise than a GPU's
SHARED_MEMORY = 232_448  # bytes of shared memory one program may use on sm_90


@contextlib.contextmanager
def recording(into: dict[str, dict[str, Any]]) -> Iterator[None]:
    """Each distinct interpreted launch in the block goes into ``into`` (keyed by its JSON) and does not run: its
    outputs keep whatever they held, so the block may size kernels as a large model does at no cost."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import mangle_type

    run = InterpretedFunction.run

    def record(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
        signature, constants = {}, {}
        for name, p in params.items():
            value = bound.get(name, p.default)
            if "constexpr" in str(p.annotation) or value is None:  # (annotations may be strings)
                signature[name], constants[name] = "constexpr", value
            else:
                signature[name] = mangle_type(value)
        spec = {"module": self.fn.__module__, "kernel": self.fn.__name__, "signature": signature,
                "constants": constants, "options": {k: kwargs[k] for k in OPTIONS if k in kwargs}}
        into.setdefault(json.dumps(spec, sort_keys=True, default=str), spec)
        return None  # (what the interpreter's run returns for a warm-up)

    InterpretedFunction.run = record
    try:
        yield
    finally:
        InterpretedFunction.run = run


def compile_for_hopper(spec: dict[str, Any]) -> str | None:
    """Compile one recorded specialization for sm_90; None if it compiled and fits, else what went wrong."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    constants = {k: ON_THE_GPU.get(k, v) for k, v in spec["constants"].items()}
    options = dict(spec["options"])
    if "PDL" in constants:
        options["launch_pdl"] = True
    try:
        compiled = triton.compile(ASTSource(kernel, spec["signature"], constants), target=GPUTarget("cuda", 90, 32),
                                  options=options)
    except Exception as e:  # noqa: BLE001 - reported with the specialization
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[-1] if lines else ''}"
    if compiled.metadata.shared > SHARED_MEMORY:
        return f"needs {compiled.metadata.shared} bytes of shared memory (sm_90: {SHARED_MEMORY})"
    return None


def main(path: str) -> int:
    specs = json.loads(Path(path).read_text())
    failed = 0
    for module in {spec["module"] for spec in specs}:  # imported before the threads share them
        importlib.import_module(module)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # (Triton's passes and ptxas leave the GIL)
        errors = list(pool.map(compile_for_hopper, specs))
    for spec, error in zip(specs, errors):
        label = f"{spec['module'].rsplit('.', 1)[-1]}.{spec['kernel']} {spec['constants']} {spec['options']}"
        if error:
            failed += 1
            print(f"FAILED {label}: {error}")
    print(f"{len(specs) - failed} of {len(specs)} specializations compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
