"""Every Triton kernel specialization that forwards of real model shapes launch compiles for Hopper (sm_90), on a
machine without a GPU (hopper_compile.py): prefill, decode batches of each matmul path, a verify step, the greedy
and sampled picks, in fast and exact mode, with the fp16 and the int8 KV cache, for llama, qwen2 and gemma3. The
kernels are recorded under the interpreter without running (so the shapes can be a real model's: one layer of it)
and compiled by Triton's own compiler in a process without the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from batches import placement
from hopper_compile import recording

from quanta import gguf
from quanta.backends.base import SamplingRows
from quanta.models import load_model
from quanta.synth import get_preset, synthesize

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every test compiles its kernels")

BLOCK = 16
# (preset, quant type, KV dtype, exact): each matmul format family, each architecture, both modes and KV types
MODELS = [("tinyllama-1.1b", "Q4_K_M", "auto", False), ("qwen2.5-0.5b", "Q4_0", "q8", False),
          ("llama-3.2-1b", "Q5_K_M", "auto", False), ("qwen2.5-1.5b", "Q6_K", "auto", False),
          ("tinyllama-1.1b", "Q8_0", "auto", False), ("tinyllama-1.1b", "Q4_K_M", "auto", True),
          ("gemma3-270m", "Q4_K_M", "auto", False), ("llama-2-7b", "Q4_K_M", "auto", False),
          ("smollm2-135m", "Q4_1", "q8", False), ("smollm2-135m", "F16", "auto", False)]


def _sampling_rows(n: int, top_k: tuple[int, ...]) -> SamplingRows:
    """Greedy, top-k, top-p alone and uncut rows (``top_k`` per row, cyclic), with a bias and a penalty."""
    f32 = lambda *v: np.resize(np.asarray(v, np.float32), n)  # noqa: E731
    return SamplingRows(f32(0.0, 0.8, 1.0, 0.7), np.resize(np.asarray(top_k, np.int32), n), f32(1, 0.95, 0.9, 1),
                        f32(0, 0.05, 0, 0), np.linspace(0.1, 0.9, n), f32(1, 1.1), f32(0, 0.5), f32(0, 0.2),
                        np.full(2, n - 1, np.int32), np.asarray([3, 9], np.int32), np.asarray([1.5, -2.0], np.float32),
                        np.asarray([0, 2], np.float32))


def _forwards(path: Path, kv: str, exact: bool) -> None:
    """A model's forwards and picks, launched (recorded) and not run."""
    from quanta.backends.cuda.backend import CUDABackend

    be = CUDABackend("cpu", exact=exact, graphs=False)
    model = load_model(gguf.open(path), be, 4096)
    tables = [list(range(j * 64, j * 64 + 64)) for j in range(40)]
    cache = be.kv_cache(model.kv_shape(40 * 64, BLOCK), kv)
    steps = [[(0, 0, 7), (1, 0, 600)],  # prefill chunks
             *[[(j, 600, 1) for j in range(n)] for n in (1, 3, 12, 40)],  # decode batches: each matmul path
             [(0, 607, 5), (1, 600, 5)],  # a verify step: 1 + 4 drafts each
             [(0, 700, 300), (1, 601, 1)]]  # a prefill chunk after a cached prefix, beside a decode row
    for step in steps:
        meta = placement([(tables[j], first, n) for j, first, n in step], BLOCK)
        ids = np.zeros(len(meta.positions), np.int32)
        logits = model.forward(be.from_host(ids), be.metadata(meta), cache, None)
        be.argmax_rows(logits)
        if logits.shape[0] <= 3:  # (the draws' kernels do not depend on the rows; their torch ops on the CPU are slow)
            # cut rows all of top-k 40 are drawn by two kernels, all of 200 by torch.topk and one, mixed by torch ops
            for top_k in ((0, 40, 0, 0), (40,), (200,)):
                be.sample_rows(logits, _sampling_rows(logits.shape[0], top_k))
    _unfused_ops(be, model, cache, meta)


def _unfused_ops(be, model, cache, meta) -> None:
    """The ops a forward of these models leaves to other paths: tokens fed from the step before, activations
    quantized alone, the rope alone, keys and values stored by the attention."""
    from quanta.backends.cuda import q8gemv

    c = model.config
    n = len(meta.positions)
    dev = be.metadata(meta)
    be.feed_tokens(np.zeros(n, np.int32), torch.zeros(n, dtype=torch.int32), np.arange(n, dtype=np.int32))
    q8gemv.quantize(torch.zeros(n, c.d_model))
    table = be.rope_table(np.ones(c.head_dim // 2, np.float32), 4096)
    q = be.rope(torch.zeros(n, c.n_heads, c.head_dim), dev.positions, table, neox=False)
    kv = torch.zeros(n, c.n_kv_heads, c.head_dim)
    be.attention(q, kv, kv, cache[0], dev, scale=0.125)


def test_every_forward_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    specs: dict[str, dict] = {}
    for preset, quant, kv, exact in MODELS:
        path = tmp_path / f"{preset}-{quant}.gguf"
        if not path.exists():
            synthesize(replace(get_preset(preset), n_layers=1), path, quant, progress=False)
        with recording(specs):
            _forwards(path, kv, exact)
    launched = {(s["module"], s["kernel"]) for s in specs.values()}
    assert launched == _all_kernels(), "add a workload that launches the others"
    records = tmp_path / "launches.json"
    records.write_text(json.dumps(list(specs.values())))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("hopper_compile.py")), str(records)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"{len(specs)} of {len(specs)} specializations compiled" in done.stdout


def _all_kernels() -> set[tuple[str, str]]:
    """Every Triton kernel of the CUDA backend (its launched functions are named ``*_kernel``)."""
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction

    import quanta.backends.cuda as package

    out = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        out |= {(module.__name__, name) for name, f in vars(module).items()
                if isinstance(f, InterpretedFunction) and name.endswith("_kernel")
                and f.fn.__module__ == module.__name__}
    return out
