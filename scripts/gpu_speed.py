"""The speed sections of the GPU run (called by gpu_check.py): the int8 GEMV tile sweep, the batch-1 benchmarks
(decode at depth 0 and 1024, prefill-512, a per-kernel profile), decode against depth, prefill A/B, time to first
token in a fresh process and a prefill profile; the decode variants (A/B and logits) are in gpu_variants.py."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gpu_common import OUT, RESULTS, SUMMARY, WORK, cuda_time, say, section


@section("GEMV tile sweep (sets the config the benchmarks use)")
def tune(widths: tuple[int, ...] = (4, 6, 8)) -> None:
    sys.path.insert(0, "scripts")
    import gpu_tune

    best = {f"{bits}-bit {cls}": cfg for (bits, cls), cfg in gpu_tune.q8(widths).items()}
    RESULTS["q8_gemv_config"] = best
    SUMMARY.append(f"int8 GEMV configs chosen by the sweep: {best}")


def bytes_per_token(model) -> int:
    total = 0
    for layer in model.layers:  # q/k/v and gate/up are Projections: fused (one stacked matrix) or single
        total += sum(p.weight.nbytes for p in layer.qkv + layer.gate_up)
        total += layer.attn_output.nbytes + layer.ffn_down.nbytes
    return total + model.output.nbytes


def launches_per_layer(model) -> dict:
    """How the layers' projections were fused: {"qkv": [names per matmul], "gate_up": [...]} of layer 0, and the
    number of distinct groupings over all layers."""
    shapes = {(tuple(p.names for p in L.qkv), tuple(p.names for p in L.gate_up)) for L in model.layers}
    first = model.layers[0]
    return dict(qkv=[list(p.names) for p in first.qkv], gate_up=[list(p.names) for p in first.gate_up],
                groupings=len(shapes), qkv_matmuls_total=sum(len(L.qkv) for L in model.layers))


@section("benchmarks")
def bench(models: list[tuple[str, Path]], bw: float, n_decode: int = 128) -> None:
    """Decode at depth 0 and 1,024 and prefill-512 of every model first, then the per-kernel profiles: a process
    that has run torch's profiler decodes slower afterwards (GPU run 76: Llama-3.2 1,533 tok/s after
    TinyLlama's profile, 1,804 in the sweep just before)."""
    rows = []
    for name, path in models:
        with _loaded(path, 2048) as (be, model, load_s):
            cache = be.kv_cache(model.kv_shape())
            nbytes = bytes_per_token(model)
            d0 = decode_rate(be, model, cache, 0, n_decode)
            d1k = decode_rate(be, model, cache, 1024, n_decode)
            prompt = np.random.default_rng(0).integers(5, min(model.n_vocab, 30000), size=512).astype(np.int32)
            pf = cuda_time(lambda: be.forward(model, prompt, 0, cache, all_logits=False), reps=5, warmup=2)
            rows.append(dict(model=name, bytes_per_token=nbytes, decode_tok_s=d0,
                             decode_pct_roofline=100 * d0 * nbytes / bw, decode_depth1024_tok_s=d1k,
                             depth_ratio=d1k / d0, prefill512_tok_s=512 / pf, load_s=load_s,
                             fusion=launches_per_layer(model)))
    for row, (name, path) in zip(rows, models):
        with _loaded(path, 2048) as (be, model, _):
            row.update(_kernel_profile(be, model, be.kv_cache(model.kv_shape())))
        say("  ", json.dumps(row))
        RESULTS.setdefault("bench", []).append(row)
        SUMMARY.append(f"{name:26s} decode {row['decode_tok_s']:7.0f} tok/s ({row['decode_pct_roofline']:.1f}% of "
                       f"roofline, {row['bytes_per_token'] / 1e6:.0f} MB/token), @1024 "
                       f"{row['decode_depth1024_tok_s']:7.0f} ({100 * row['depth_ratio']:.0f}%), prefill-512 "
                       f"{row['prefill512_tok_s']:8.0f} tok/s, load {row['load_s']:.1f}s, "
                       f"launches/token {row.get('launches_per_token@100', '?')}, qkv {row['fusion']['qkv']}")


@contextlib.contextmanager
def _loaded(path: Path, n_ctx: int):
    """(backend, model, load seconds) of a GGUF on a fresh CUDA backend; the file closed afterwards."""
    from quanta import gguf
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.models import load_model

    g = gguf.open(path)
    be = CUDABackend("cuda")
    t = time.perf_counter()
    model = load_model(g, be, n_ctx)
    torch.cuda.synchronize()
    try:
        yield be, model, time.perf_counter() - t
    finally:
        g.close()
        torch.cuda.empty_cache()


def _kernel_profile(be, model, cache) -> dict:
    """Per-kernel device time of one eager decode step (torch profiler), near the benchmark's depth and after 1,100
    tokens."""
    try:
        from torch.profiler import ProfilerActivity, profile

        from quanta.bench.profile import kernel_totals

        be.graphs = False
        out: dict = {}
        be.forward(model, np.arange(5, 1105, dtype=np.int32), 0, cache, all_logits=False)  # a filled cache
        for pos in (100, 1100):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    be.forward(model, np.asarray([7], np.int32), pos, cache, all_logits=False)
                torch.cuda.synchronize()
            events = prof.key_averages()
            us = {k: 1e6 * v / 5 for k, v in kernel_totals(events).items()}
            out[f"launches_per_token@{pos}"] = sum(ev.count for ev in events if ev.device_time_total > 0) / 5
            top = sorted(us.items(), key=lambda kv: -kv[1])[:8]
            out[f"kernel_us_per_token@{pos}"] = {k: round(v, 1) for k, v in top}
            out[f"kernel_total_us@{pos}"] = sum(us.values())
        return out
    except Exception as e:  # the profiler is a nice-to-have
        return {"kernel_breakdown_error": repr(e)}


def decode_rate(be, model, cache, depth: int, n_decode: int, seed: int = 0, chained: bool = True) -> float:
    """Greedy decode tok/s after a ``depth``-token prompt: the product's loop (decode graphs chained on the device,
    one step queued ahead of the host; spreads of 0.1-0.5%), or with ``chained=False`` the host-driven loop
    (replay, device argmax, a token read, the next replay: the loop before GPU run 190)."""
    from quanta.backends.base import Backend

    rng = np.random.default_rng(seed)
    prompt = rng.integers(5, min(model.n_vocab, 30000), size=max(depth, 8)).astype(np.int32)
    tok = be.argmax(be.forward(model, prompt, 0, cache, all_logits=False)[0])
    loop = be.greedy_decode if chained else functools.partial(Backend.greedy_decode, be)
    for i, _ in enumerate(loop(model, cache, tok, len(prompt), 8 + n_decode)):
        if i == 7:  # after warm-up (graph captures at the first decode)
            t0 = time.perf_counter()
    rate = n_decode / (time.perf_counter() - t0)
    if not any(type(g).__name__ == "DecodeGraph" for g in be._graphs.values()):  # GPU run 145
        raise RuntimeError("decode ran eagerly: an op installed on the backend instance turns its graphs off")
    return rate


# label: KV cache dtype, decode dots (the default mode's; "f32 cache, IEEE dots": (torch.float32, "ieee") adds the
# exact mode's kernel, as in session 4)
ATTENTION_VARIANTS = {"f16 cache, fp16 dots": (torch.float16, "fp16")}


@section("decode speed against context depth (n_ctx 8192), KV cache / attention variants alternating in one process")
def depth_sweep(models: list[tuple[str, Path]], depths: tuple[int, ...] = (0, 1024, 4096), reps: int = 4) -> None:
    """Medians over ``reps`` repetitions; the depths run in reverse order every other repetition, so that a machine
    drifting during the sweep moves every depth alike (session 8's run 67 drifted 7% within one model)."""
    for name, path in models:
        rates: dict = {}
        with _loaded(path, 8192) as (be, model, _):
            for rep in range(reps):
                for label, (be.kv_dtype, be.decode_dot) in ATTENTION_VARIANTS.items():
                    be._decode_scratch.clear()
                    be._graphs.clear()
                    cache = be.kv_cache(model.kv_shape())
                    for d in depths if rep % 2 == 0 else depths[::-1]:
                        rates.setdefault((label, d), []).append(decode_rate(be, model, cache, d, 128))
                    del cache
        for label in ATTENTION_VARIANTS:
            med = {d: float(np.median(rates[(label, d)])) for d in depths}
            line = f"{name:22s} {label}: " + ", ".join(f"{d}: {r:.0f} ({100 * r / med[depths[0]]:.0f}%)"
                                                      for d, r in med.items())
            say("  ", line, json.dumps({d: [round(x) for x in rates[(label, d)]] for d in depths}))
            SUMMARY.append(line)


def _words_copies(on: bool):
    def apply(be) -> None:
        be._copies.words = on
    return apply


def _dequantize_from(rows: int | None):
    """Prefill GEMMs dequantize from ``rows`` activation rows up (None: as shipped)."""
    from quanta.backends.cuda import gemm

    shipped = gemm.DEQUANT_MIN_ROWS

    def apply(be) -> None:
        gemm.DEQUANT_MIN_ROWS = shipped if rows is None else rows
    return apply


# session 15's tiles for the dequantized weight on the GEMM kernel's pointer-based dense path (GPU runs 124-126)
POINTER_DENSE_TILES = {
    "huge": {"BM": 128, "BN": 256, "BK": 64, "SWAP": False, "num_warps": 8, "num_stages": 3},
    "large": {"BM": 64, "BN": 128, "BK": 64, "SWAP": False, "num_warps": 4, "num_stages": 4},
    "medium": {"BM": 64, "BN": 64, "BK": 64, "SWAP": False, "num_warps": 4, "num_stages": 4},
}


def _dense_on(tma: bool):
    """The dequantized weight multiplied by dense_gemm's TMA kernel (as shipped) or by the pointer-based path."""
    from quanta.backends.cuda import dense_gemm, gemm
    from quanta.backends.cuda.repack import PackedWeight

    def pointer_dense(xw, wd, ep, tiles=None) -> None:
        dense = PackedWeight("BF16", wd.shape[0], wd.shape[1], "dense", wd)
        gemm.gemm(xw, dense, ep, False, POINTER_DENSE_TILES[gemm.row_class(xw.shape[0])], xw=xw)

    def apply(be) -> None:
        gemm.dense_gemm = dense_gemm.dense_gemm if tma else pointer_dense
    return apply


# prefill variants (prefill_ab), the shipped one first: what each does to the backend
PREFILL_COPIES = {"producers' copies": _words_copies(True), "each GEMM's own copy": _words_copies(False)}
PREFILL_DEQUANT = {"dequantized": _dequantize_from(None), "fused GEMM": _dequantize_from(1 << 30)}
PREFILL_DENSE = {"TMA dense GEMM": _dense_on(True), "pointer dense GEMM": _dense_on(False)}


@section("prefill variants, alternating in one process")
def prefill_ab(models: list[tuple[str, Path]], variants: dict, lengths: tuple[int, ...] = (512,),
               reps: int = 3) -> None:
    """Prefill tok/s (graph replay, medians) of each variant, and how far its logits are from the first's."""
    for name, path in models:
        rates: dict = {}
        logits: dict = {}
        with _loaded(path, 2048) as (be, model, _):
            cache = be.kv_cache(model.kv_shape())
            for n in lengths:
                prompt = np.random.default_rng(n).integers(5, min(model.n_vocab, 30000), size=n).astype(np.int32)
                for _ in range(reps):
                    for label, apply in variants.items():
                        apply(be)
                        be._drop_prefill_graphs()
                        be._prefill_uses.clear()
                        pf = cuda_time(lambda p=prompt, c=cache: be.forward(model, p, 0, c, all_logits=False),
                                       reps=5, warmup=2)
                        rates.setdefault((n, label), []).append(n / pf)
                        logits[(n, label)] = be.to_host(be.forward(model, prompt, 0, cache, all_logits=False))
            next(iter(variants.values()))(be)
        for n in lengths:
            first = next(iter(variants))
            med = {label: float(np.median(rates[(n, label)])) for label in variants}
            diff = {label: float(np.abs(logits[(n, label)] - logits[(n, first)]).max()
                                 / np.abs(logits[(n, first)]).max()) for label in variants}
            line = f"{name:22s} prefill-{n}: " + ", ".join(
                f"{label} {med[label]:.0f} tok/s ({100 * (med[label] / med[first] - 1):+.1f}%, logits {diff[label]:.1e})"
                for label in variants)
            say("  ", line, json.dumps({f"{n} {label}": [round(x) for x in rates[(n, label)]] for label in variants}))
            SUMMARY.append(line)


TTFT_CODE = """
import cProfile, pstats, sys, time
t0 = time.perf_counter()
prof = cProfile.Profile()
prof.enable()
import torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
from quanta import LLM
llm = LLM(sys.argv[1], device="cuda", n_ctx=2048)
torch.cuda.synchronize()
t2 = time.perf_counter()
llm.generate([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=1, temperature=0.0, ignore_eos=True)
t3 = time.perf_counter()
prof.disable()
llm.generate([1, 2, 3, 4, 5, 6, 7, 9], max_tokens=1, temperature=0.0, ignore_eos=True)
t4 = time.perf_counter()
print(f"TTFT {t3 - t0:.3f} torch+cuda_init {t1 - t0:.3f} LLM() {t2 - t1:.3f} first_generate {t3 - t2:.3f} "
      f"second_generate {t4 - t3:.3f}")
pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(45)
"""


@section("time to first token (fresh process, LLM API)")
def first_token(path: Path) -> None:
    labels = ["cold (fresh triton cache)", "warm (triton cache)"]
    if os.environ.get("TTFT_PYCACHE"):  # the image's torch ships no .pyc: cache them as an installed torch would
        labels = ["warm (triton cache, pycache being filled)", "warm (triton cache + pycache)"]
    for label in labels:
        env = {**os.environ, "PYTHONPATH": "src"}
        if os.environ.get("TTFT_PYCACHE"):
            env["PYTHONPYCACHEPREFIX"] = str(WORK / "pycache")
            env.pop("PYTHONDONTWRITEBYTECODE", None)  # set on that image: an installed torch has its .pyc
        if label.startswith("cold"):
            env["TRITON_CACHE_DIR"] = str(WORK / "triton_cold_cache")
            subprocess.run(["rm", "-rf", env["TRITON_CACHE_DIR"]])
        p = subprocess.run([sys.executable, "-c", TTFT_CODE, str(path)], capture_output=True, text=True, env=env,
                           timeout=300)
        line = [x for x in p.stdout.splitlines() if x.startswith("TTFT")]
        val = float(line[0].split()[1]) if line else float("nan")
        (OUT / f"ttft_{labels.index(label)}.txt").write_text(p.stdout + "\n" + p.stderr[-20000:])
        say("  ", line[0] if line else p.stderr[-3000:])
        RESULTS[f"ttft {label}"] = line[0] if line else None
        SUMMARY.append(f"LLM(...) to first token, {path.stem}, {label}: {val:.2f}s ({line[0] if line else '?'})")


@section("prefill-512 per-kernel profile (TinyLlama)")
def prefill_profile(path: Path) -> None:
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with _loaded(path, 2048) as (be, model, _):
        cache = be.kv_cache(model.kv_shape())
        prompt = np.random.default_rng(0).integers(5, 30000, size=512).astype(np.int32)
        be.forward(model, prompt, 0, cache, all_logits=False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            be.forward(model, prompt, 0, cache, all_logits=False)
            torch.cuda.synchronize()
        agg: dict[str, float] = {}
        for ev in prof.key_averages():
            if ev.device_time_total > 0:
                agg[ev.key] = agg.get(ev.key, 0.0) + ev.device_time_total
        top = sorted(agg.items(), key=lambda kv: -kv[1])[:10]
        say("   prefill-512 kernel us: " + json.dumps({k[:40]: round(v) for k, v in top}))
        prof_host = cProfile.Profile()  # where the host time of a prefill goes (is it launch-bound?)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof_host.enable()
        for _ in range(3):
            be.forward(model, prompt, 0, cache, all_logits=False)
        prof_host.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof_host, stream=buf).sort_stats("tottime").print_stats(25)
    say(f"   prefill-512 wall {(time.perf_counter() - t0) / 3 * 1e3:.1f} ms (profiled); host profile:\n" +
        buf.getvalue()[:6000])
    RESULTS["prefill_kernel_us"] = {k: round(v, 1) for k, v in top}
    SUMMARY.append("prefill-512 kernels (us): " + ", ".join(f"{k[:24]} {v:.0f}" for k, v in top[:6]))
