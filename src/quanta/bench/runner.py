"""`quanta bench`: prefill and decode speed against the memory roofline, side by side with llama.cpp.

Engines alternate run by run inside one invocation (this kind of machine is noisy: only ratios measured together
count). Every figure is the median over ``repeats`` with its min and max.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from quanta import gguf
from quanta.bench.engines import LlamaCppEngine, QuantaEngine, RunTimes, require_llama_cpp
from quanta.bench.roofline import kv_bytes_per_token, weight_bytes_per_token


@dataclass(frozen=True)
class BenchConfig:
    model: Path
    device: str = "cpu"
    prompt_tokens: int = 512
    decode_tokens: int = 128
    depth: int = 0
    repeats: int = 5
    threads: int = 2
    vs: str | None = None
    exact: bool = False
    cold_start: bool = True
    breakdown: bool = True
    busy_cores: int = 0  # competing busy processes during the whole run (contention.py)
    cpu_isa: str | None = None  # the CPU backend's int8 instruction set (None: the fastest the CPU has)
    cuda: dict | None = None  # the CUDA backend's switches (q8, pdl), from the CLI's environment
    kv_type: str = "auto"  # how the KV pool stores K and V (EngineConfig.kv_dtype)
    tensor_parallel: int = 1  # GPUs the model is split over (quanta.parallel)
    empty_kernel_cache: bool = False  # also quanta's cold start with an empty Triton cache (a new machine's first run)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    """Random ids from the middle of the vocabulary (no specials), the same for both engines."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(min(1000, vocab // 4), vocab - vocab // 8, n)]


def _model_shape(path: Path) -> dict[str, int]:
    from quanta.models import ModelConfig

    with gguf.open(path) as f:
        embd = f.tensors.get("token_embd.weight")
        c = ModelConfig.from_metadata(f.metadata, embd.shape[0] if embd is not None else 0)
        return {"weights": weight_bytes_per_token(f), "layers": c.n_layers, "kv_heads": c.n_kv_heads,
                "head_dim": c.head_dim, "vocab": len(f.metadata["tokenizer.ggml.tokens"]),
                "file_bytes": f.file_size, "n_ctx_train": c.n_ctx_train}


_COLD_QUANTA = """
import sys
from quanta import LLM
llm = LLM(sys.argv[1], device=sys.argv[2], threads=int(sys.argv[3]), n_ctx=256)
llm.generate([int(t) for t in sys.argv[4].split(',')], max_tokens=1, temperature=0.0, ignore_eos=True)
print('FIRST', flush=True)
llm.generate([int(t) for t in sys.argv[4].split(',')], max_tokens=32, temperature=0.0, ignore_eos=True)
print('RSS', [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0], flush=True)
"""

_COLD_LLAMA = """
import sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=int(sys.argv[3]), verbose=False)
llm.eval([int(t) for t in sys.argv[4].split(',')])
print('FIRST', flush=True)
for _ in range(32):
    llm.eval([5])
print('RSS', [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0], flush=True)
"""


def cold_start(engine: str, cfg: BenchConfig, prompt: list[int],
               env: dict[str, str] | None = None) -> tuple[float, int]:
    """Seconds from process start to the first token (caches warm), and the process's peak RSS in bytes
    (VmHWM: unlike ru_maxrss it is not inherited from the forking parent)."""
    code = _COLD_QUANTA if engine == "quanta" else _COLD_LLAMA
    args = [sys.executable, "-c", code, str(cfg.model), cfg.device, str(cfg.threads), ",".join(map(str, prompt))]
    t = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first, rss = float("nan"), 0
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("FIRST"):
            first = time.perf_counter() - t
        elif line.startswith("RSS"):
            rss = int(line.split()[1])
    if proc.wait() != 0:
        raise RuntimeError(f"cold-start run of {engine} failed:\n{proc.stderr.read() if proc.stderr else ''}")
    return first, rss


def cold_starts(engines: list[str], cfg: BenchConfig, prompt: list[int]) -> dict[str, dict[str, Any]]:
    """Per engine: the median and spread of ``cfg.repeats`` cold starts (engines alternating), and the peak RSS.

    Warm caches for every engine alike: one untimed run each first (page cache, numba's cache), and Python's
    bytecode cache in a private folder (PYTHONPYCACHEPREFIX), so that PYTHONDONTWRITEBYTECODE does not make a
    source checkout recompile every module at every start while installed packages load theirs."""
    with tempfile.TemporaryDirectory(prefix="quanta-bench-pyc-") as pycache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env.setdefault("PYTHONPYCACHEPREFIX", pycache)
        for engine in engines:
            cold_start(engine, cfg, prompt, env)
        runs: dict[str, list[tuple[float, int]]] = {e: [] for e in engines}
        for _ in range(cfg.repeats):
            for engine in engines:
                runs[engine].append(cold_start(engine, cfg, prompt, env))
        empty = [_empty_cache_start(cfg, prompt, env) for _ in range(cfg.repeats if cfg.empty_kernel_cache else 0)]
    out = {}
    for engine, r in runs.items():
        spread = _spread([t for t, _ in r])
        out[engine] = {"cold_start_s": spread["median"], "cold_start_s_spread": spread,
                       "peak_rss_bytes": max(rss for _, rss in r)}
    if empty:
        spread = _spread(empty)
        out["quanta"].update(cold_start_empty_cache_s=spread["median"], cold_start_empty_cache_s_spread=spread)
    return out


def _empty_cache_start(cfg: BenchConfig, prompt: list[int], env: dict[str, str]) -> float:
    """quanta's cold start (bytecode and page cache warm) with a Triton kernel cache of its own, empty: every
    kernel compiles, as on a machine's first run."""
    with tempfile.TemporaryDirectory(prefix="quanta-bench-triton-") as kernels:
        return cold_start("quanta", cfg, prompt, {**env, "TRITON_CACHE_DIR": kernels})[0]


def _summarise(runs: list[RunTimes], deep: list[RunTimes], shape: dict[str, int], cfg: BenchConfig,
               bandwidth: float, kv_itemsize: float) -> dict[str, Any]:
    prefill = _spread([r.prefill_tok_s for r in runs])
    decode = _spread([r.decode_tok_s for r in runs])
    ttft = _spread([r.ttft_s * 1e3 for r in runs])
    bytes_per_token = shape["weights"] + kv_bytes_per_token(
        shape["layers"], shape["kv_heads"], shape["head_dim"], cfg.prompt_tokens + cfg.decode_tokens // 2,
        kv_itemsize)
    achieved = decode["median"] * bytes_per_token
    out: dict[str, Any] = {
        "prefill_tok_s": prefill["median"], "prefill_tok_s_spread": prefill,
        "decode_tok_s": decode["median"], "decode_tok_s_spread": decode,
        "decode_ms_per_token": 1e3 / decode["median"],
        "ttft_ms": ttft["median"], "ttft_ms_spread": ttft,
        "bytes_per_token": bytes_per_token,
        "achieved_gb_s": achieved / 1e9,
        "roofline_pct": 100.0 * achieved / bandwidth,
    }
    if deep:
        d = _spread([r.decode_tok_s for r in deep])
        out.update({"depth_decode_tok_s": d["median"], "depth_decode_tok_s_spread": d})
    return out


def run_bench(cfg: BenchConfig, *, progress: bool = True) -> dict[str, Any]:
    """Measure quanta (and the baseline with ``cfg.vs``) and return the report (the --json document), with
    ``cfg.busy_cores`` competing processes running throughout."""
    from quanta.bench.contention import busy_cores

    with busy_cores(cfg.busy_cores):
        return {**_run_bench(cfg, progress=progress), "busy_cores": cfg.busy_cores, "cpu_isa": cfg.cpu_isa}


def _run_bench(cfg: BenchConfig, *, progress: bool) -> dict[str, Any]:
    shape = _model_shape(cfg.model)
    prompt = _prompt(shape["vocab"], cfg.prompt_tokens)
    deep_prompt = _prompt(shape["vocab"], cfg.depth, seed=1) if cfg.depth else []
    n_ctx = max(cfg.prompt_tokens, cfg.depth) + cfg.decode_tokens + 8
    if n_ctx > shape["n_ctx_train"]:
        raise ValueError(f"the prompt (-p / --depth) and the decoded tokens (-n) need a context of {n_ctx:,} tokens, "
                         f"more than the {shape['n_ctx_train']:,} the model was trained for")
    read_bandwidth = _bandwidth_probe(cfg)
    if cfg.vs:
        require_llama_cpp()  # before quanta loads: a missing peer is the first thing said
    engines: dict[str, Any] = {"quanta": QuantaEngine(str(cfg.model), device=cfg.device, threads=cfg.threads,
                                                      n_ctx=n_ctx, exact=cfg.exact, cpu_isa=cfg.cpu_isa,
                                                      cuda=cfg.cuda, kv_type=cfg.kv_type,
                                                      tensor_parallel=cfg.tensor_parallel)}
    if cfg.vs:
        engines["llama.cpp"] = LlamaCppEngine(cfg.model, threads=cfg.threads, n_ctx=n_ctx)
    runs: dict[str, list[RunTimes]] = {k: [] for k in engines}
    deep: dict[str, list[RunTimes]] = {k: [] for k in engines}
    steps = cfg.repeats * len(engines) * (2 if cfg.depth else 1)
    with tqdm(total=steps, desc="bench", disable=not progress, leave=False) as bar:
        for name, engine in engines.items():  # warm-up: compile, page in the weights; twice, because the GPU
            for _ in range(2):  # captures a prompt length's graph at its second use
                engine.run(prompt, 4)
        samples = []
        for _ in range(cfg.repeats):
            samples.append(read_bandwidth())
            for name, engine in engines.items():
                runs[name].append(engine.run(prompt, cfg.decode_tokens))
                bar.update()
                if cfg.depth:
                    deep[name].append(engine.run(deep_prompt, cfg.decode_tokens))
                    bar.update()
    del read_bandwidth  # the CPU probe's 512 MB, before the breakdown and the cold starts
    kv_itemsize = engines["quanta"].kv_bytes_per_value()
    bandwidth_gb_s = _spread([b / 1e9 for b in samples])
    bandwidth = bandwidth_gb_s["median"] * 1e9
    report = {"model": str(cfg.model), "device": cfg.device, "threads": cfg.threads, "kv_type": cfg.kv_type,
              "prompt_tokens": cfg.prompt_tokens, "decode_tokens": cfg.decode_tokens, "depth": cfg.depth,
              "repeats": cfg.repeats, "bandwidth_gb_s": bandwidth_gb_s["median"],
              "bandwidth_gb_s_spread": bandwidth_gb_s, "file_bytes": shape["file_bytes"],
              **_summarise(runs["quanta"], deep["quanta"], shape, cfg, bandwidth, kv_itemsize)}
    if cfg.device == "cuda":
        import torch

        report["device_name"] = torch.cuda.get_device_name()
    if cfg.breakdown:
        report["breakdown"] = _breakdown(engines["quanta"], prompt, cfg)
        report["breakdown_of"] = "CUDA kernels, device time, eager" if cfg.device == "cuda" else "ops, host time"
    cold = cold_starts(list(engines), cfg, prompt[:8]) if cfg.cold_start else {}
    report.update(cold.get("quanta", {}))
    if cfg.vs:
        base = _summarise(runs["llama.cpp"], deep["llama.cpp"], shape, cfg, bandwidth, 2)  # its default f16 cache
        base.update(cold.get("llama.cpp", {}))
        report["baseline"] = {"engine": "llama.cpp", **base}
        report["decode_ratio"] = report["decode_tok_s"] / base["decode_tok_s"]
        report["prefill_ratio"] = report["prefill_tok_s"] / base["prefill_tok_s"]
        report["baseline"].update(decode_ratio=report["decode_ratio"], prefill_ratio=report["prefill_ratio"])
        if cfg.depth:
            report["depth_decode_ratio"] = report["depth_decode_tok_s"] / base["depth_decode_tok_s"]
        if cfg.cold_start:
            report["cold_start_ratio"] = report["cold_start_s"] / base["cold_start_s"]
    return report


def _bandwidth_probe(cfg: BenchConfig) -> Callable[[], float]:
    """What samples the read bandwidth (bytes/s) before each repeat: on the CPU a fresh best-of-5 each time (a
    shared machine's moves by tens of percent within minutes), on a GPU the one measurement taken now."""
    from quanta.bench import roofline

    if cfg.device == "cuda":
        measured = roofline.cuda_read_bandwidth()
        return lambda: measured
    return roofline.CPUReadProbe(cfg.threads).sample


def _breakdown(engine: QuantaEngine, prompt: list[int], cfg: BenchConfig) -> dict[str, dict[str, float]]:
    """Time per op (CPU: host timers, Python glue as "other") or per CUDA kernel (device time of an eager run):
    ms per prompt for prefill, ms per token for decode (a decode run minus its prefill)."""
    from quanta.bench.profile import kernel_timers, op_timers

    llm = engine.llm
    on_gpu = cfg.device == "cuda"

    def timed(p: list[int], n: int) -> tuple[dict[str, float], float]:
        llm.engine.reset_prefix_cache()
        with kernel_timers(llm.backend) if on_gpu else op_timers(llm.backend) as totals:
            t = time.perf_counter()
            llm.generate(p, max_tokens=n + 1, temperature=0.0, ignore_eos=True)
            total = time.perf_counter() - t
        return dict(totals), total

    def per_op(totals: dict[str, float], total: float, per: int) -> dict[str, float]:
        ops = {k: 1e3 * v / per for k, v in sorted(totals.items(), key=lambda kv: -kv[1]) if 1e3 * v / per >= 5e-4}
        if not on_gpu:  # kernels run asynchronously: the wall time minus their sum means nothing
            ops["other (python, sampling)"] = max(0.0, 1e3 * total / per - sum(ops.values()))
        return ops

    n = min(cfg.decode_tokens, 32)
    # not timed: the short context's kernels (the CPU's serial decode attention) may be new to this process, and
    # their first call loads them (~0.8 s that went into SmolLM2's decode breakdown as attention)
    llm.generate(prompt[:8], max_tokens=n + 1, temperature=0.0, ignore_eos=True)
    prefill, prefill_total = timed(prompt, 0)
    short, short_total = timed(prompt[:8], 0)
    full, full_total = timed(prompt[:8], n)
    decode = {k: full.get(k, 0.0) - short.get(k, 0.0) for k in full}
    return {"prefill": per_op(prefill, prefill_total, 1), "decode": per_op(decode, full_total - short_total, n)}
