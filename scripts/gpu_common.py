"""Shared by the GPU-machine scripts (gpu_check.py, gpu_speed.py, gpu_tune.py): the $OUT log and JSON, sections that
log their failure instead of stopping the run, CUDA-event timing, the card's read bandwidth, random GGUF blocks and
the synthetic benchmark models."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import numpy as np
import torch

OUT = Path(os.environ.get("OUT", "gpu_out"))
OUT.mkdir(parents=True, exist_ok=True)
WORK = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/quanta_gpu"))
WORK.mkdir(parents=True, exist_ok=True)
LOG = open(OUT / "gpu_check.log", "a")
RESULTS: dict = {}
SUMMARY: list[str] = []


def say(*a: object) -> None:
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    print(msg, file=LOG, flush=True)


def section(name: str):
    def deco(fn):
        def run(*a, **k):
            t = time.perf_counter()
            say(f"== {name}")
            try:
                return fn(*a, **k)
            except Exception:
                say(traceback.format_exc())
                SUMMARY.append(f"{name}: FAILED (see log)")
            finally:
                say(f"-- {name}: {time.perf_counter() - t:.1f}s")
                (OUT / "gpu_check.json").write_text(json.dumps({**RESULTS, "summary": SUMMARY}, indent=1, default=str))
        return run
    return deco


def cuda_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return float(np.median(times))


@section("bandwidth")
def bandwidth() -> float:
    from quanta.bench.roofline import cuda_read_bandwidth

    bw = cuda_read_bandwidth(size_gb=4.0, repeats=10)
    torch.cuda.empty_cache()
    RESULTS["bandwidth_GBs"] = bw / 1e9
    SUMMARY.append(f"read bandwidth (4 GiB fp32 sum): {bw / 1e12:.2f} TB/s")
    return bw


def random_raw(t: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    from quanta.quant.formats import FORMATS

    fmt = FORMATS[t]
    if t in ("F32", "F16", "BF16"):
        x = rng.standard_normal(n * k).astype(np.float32)
        if t == "F32":
            return x.view(np.uint8)
        if t == "F16":
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nb = n * k // fmt.block_size
    raw = rng.integers(0, 256, size=(nb, fmt.type_size), dtype=np.uint8)
    for f in fmt.fields:
        if f.dtype == "<f2" and f.count == 1:
            o = fmt.offset(f.name)
            raw[:, o:o + 2] = (rng.uniform(-1, 1, nb) * 0.01).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def synth(preset: str, ftype: str) -> Path:
    from quanta.synth import get_preset, synthesize

    path = WORK / f"{preset}-{ftype}.gguf"
    if not path.exists():
        t = time.perf_counter()
        synthesize(get_preset(preset), path, ftype, progress=False)
        say(f"  synth {preset} {ftype}: {path.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - t:.1f}s")
    return path


BENCH_N_CTX = 1024 + 128 + 8  # the n_ctx of the bench (`-n 128 --depth 1024`: depth + decode + 8)
BENCH_PRESETS = (("tinyllama-1.1b", "Q4_K_M"), ("llama-3.2-1b", "Q4_K_M"), ("qwen2.5-1.5b", "Q4_0"))
