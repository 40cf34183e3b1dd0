"""One run on the GPU machine: kernel checks, GPU-vs-CPU-exact token and logit comparisons, CUDA-graph vs eager,
and the batch-1 benchmarks (decode at depth 0 and 1024, prefill-512, time to first token), with the card's
measured read bandwidth for the roofline. Full log in $OUT/gpu_check.log, numbers in $OUT/gpu_check.json; the
summary table is printed last.

Usage (repo root, on the GPU machine): PYTHONPATH=src python3 scripts/gpu_check.py [--quick] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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


@section("kernels vs torch float64 on the GPU")
def kernel_checks(rows: tuple[int, ...] = (1, 3, 77)) -> None:
    from quanta.backends.cuda.qmatmul import qmatmul
    from quanta.backends.cuda.repack import dequantize_packed, fuse, repack
    from quanta.backends.cuda.embed import embed

    rng = np.random.default_rng(0)
    worst = {}
    for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"):
        n, k = 1000, 2304
        w = repack(torch.from_numpy(random_raw(t, n, k, rng)).cuda(), t, (n, k))
        wd = dequantize_packed(w).double()
        for m in rows:
            x = torch.randn(m, k, device="cuda")
            res = torch.randn(m, n, device="cuda")
            ref = x.double() @ wd.T + res.double()
            for exact in (False, True):
                if m <= 4 and exact:
                    continue
                y = torch.full((m, n), float("nan"), device="cuda")
                qmatmul(x, w, out=y, residual=res, exact=exact)
                err = ((y.double() - ref).norm() / ref.norm()).item()
                key = f"{t} m={m}{' ieee' if exact else ''}"
                worst[key] = err
        # fused split-output matmul (Q|K|V-like: three stacked matrices, biases on two) against the same reference
        parts = [w] + [repack(torch.from_numpy(random_raw(t, 256, k, rng)).cuda(), t, (256, k)) for _ in range(2)]
        biases = [torch.randn(p.n, device="cuda") for p in parts]
        biases[1] = None
        fused = fuse(parts, biases)
        for m in rows:
            x = torch.randn(m, k, device="cuda")
            outs = [torch.full((m, p.n), float("nan"), device="cuda") for p in parts]
            qmatmul(x, fused.packed, bias=fused.bias, outs=outs)
            err = 0.0
            for p, b, y in zip(parts, biases, outs):
                ref = x.double() @ dequantize_packed(p).double().T + (0 if b is None else b.double())
                err = max(err, ((y.double() - ref).norm() / ref.norm()).item())
            worst[f"{t} m={m} fused"] = err
        if w.kind != "dense":  # the int8-activation GEMV: against the float64 matmul of the dequantized int8 x
            from quanta.backends.cuda.q8gemv import quantize

            for m in (1, 3):
                x = torch.randn(m, k, device="cuda")
                xq = quantize(x)
                xd = (xq.q.view(m, k // 32, 8, 4).transpose(2, 3).reshape(m, k // 32, 32).double()
                      * xq.d.double()[..., None]).reshape(m, k)
                y = torch.full((m, n), float("nan"), device="cuda")
                qmatmul(x, w, out=y, xq=xq)
                ref = xd @ wd.T
                worst[f"{t} m={m} int8"] = ((y.double() - ref).norm() / ref.norm()).item()
        if rows == (1,):  # quick: the GEMV only
            continue
        ids = torch.tensor([0, 999, 17], dtype=torch.int32, device="cuda")
        e = embed(w, ids)
        worst[f"{t} embed"] = ((e.double() - wd[ids.long()]).abs().max() / wd.abs().max()).item()
    bad = {k: v for k, v in worst.items() if not (v < (2e-3 if ("m=77" in k or "m=300" in k) and "ieee" not in k
                                                       else 1e-5))}
    for k, v in worst.items():
        say(f"  {k:22s} rel err {v:.2e}")
    RESULTS["kernel_errors"] = worst
    SUMMARY.append(f"qmatmul/embed, 13 formats on GPU: {'all within tolerance' if not bad else 'BAD: ' + str(bad)}")


def synth(preset: str, ftype: str) -> Path:
    from quanta.synth import get_preset, synthesize

    path = WORK / f"{preset}-{ftype}.gguf"
    if not path.exists():
        t = time.perf_counter()
        synthesize(get_preset(preset), path, ftype, progress=False)
        say(f"  synth {preset} {ftype}: {path.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - t:.1f}s")
    return path


def tiny_models() -> list[tuple[str, Path]]:
    sys.path.insert(0, "tests/backends/cuda")
    from tiny_models import write_tiny_model

    mixed = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "ffn_gate": "Q4_0", "ffn_up": "Q5_1",
             "ffn_down": "Q4_1", "attn_output": "Q5_0"}
    qk_fused = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
                "ffn_down": "Q6_K"}  # as in Q4_K_M files: q|k and gate|up fused, v alone
    out = []
    for name, arch, types in (("llama", "llama", mixed), ("llama-qkfused", "llama", qk_fused),
                              ("qwen2", "qwen2", {"token_embd": "Q8_0"}), ("gemma3", "gemma3", {"token_embd": "F16"})):
        p = write_tiny_model(WORK / f"tiny-{name}.gguf", arch, types=types, d_model=256, d_ff=512, vocab=512,
                             n_layers=3)
        out.append((f"tiny-{name}", p))
    return out


def greedy(be, model, cache, prompt: list[int], n: int) -> list[int]:
    logits = be.forward(model, np.asarray(prompt, np.int32), 0, cache, all_logits=False)
    tok, pos, out = be.argmax(logits[0]), len(prompt), []
    for _ in range(n):
        out.append(tok)
        logits = be.forward(model, np.asarray([tok], np.int32), pos, cache, all_logits=False)
        tok = be.argmax(logits[0])
        pos += 1
    return out


def teacher_forced(be, model, cache, ids: list[int]) -> np.ndarray:
    return be.to_host(be.forward(model, np.asarray(ids, np.int32), 0, cache, all_logits=True)).copy()


def teacher_forced_decode(be, model, cache, ids: list[int]) -> np.ndarray:
    """The same logits as :func:`teacher_forced`, one token per forward: the decode path (GEMV, graph)."""
    return np.concatenate([be.to_host(be.forward(model, np.asarray([t], np.int32), i, cache, all_logits=False))
                           for i, t in enumerate(ids)])


def ppl(logits: np.ndarray, ids: list[int]) -> float:
    lg = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
    return float(np.exp(np.mean(lse - lg[np.arange(len(ids) - 1), ids[1:]])))


PROSE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a "
         "screw press with movable metal type and an oil-based ink. Within fifty years, presses were running in more "
         "than two hundred cities across Europe, and the cost of a book fell so far that ordinary merchants could own "
         "several. Scholars argue about how quickly literacy followed, but most agree that cheap pamphlets spread new "
         "ideas faster than any earlier technology. Religious reformers, scientists and poets all used the press to "
         "reach readers they would never meet, and governments soon learned to license printers and censor what they "
         "produced. By the eighteenth century newspapers appeared weekly and then daily, carrying shipping news, "
         "prices and political arguments to coffee houses where people read them aloud and debated every line.")


@section("GPU vs CPU exact: greedy tokens, teacher-forced logits, graph vs eager")
def compare(models: list[tuple[str, Path]], n_tokens: int = 32) -> None:
    from quanta import gguf
    from quanta.backends.cpu.backend import CPUBackend
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.models import load_model

    rows = []
    for name, path in models:
        t0 = time.perf_counter()
        g = gguf.open(path)
        rng = np.random.default_rng(1)
        vocab = g.tensors["token_embd.weight"].shape[0]
        prompts = [list(rng.integers(5, min(vocab, 30000), size=L)) for L in (7, 16)]
        text = list(rng.integers(5, min(vocab, 30000), size=64))
        if name.startswith("real-"):  # a real model: teacher-force real prose (perplexity means something there)
            from quanta.tokenizer import load_tokenizer

            text = load_tokenizer(g).encode(PROSE)[:200]
        res = {}
        for label, be in (("cpu", CPUBackend(exact=True)), ("cuda", CUDABackend("cuda", exact=True)),
                          ("cuda-eager", CUDABackend("cuda", exact=True, graphs=False)),
                          ("cuda-fast", CUDABackend("cuda"))):
            model = load_model(g, be, 256)
            toks = []
            for p in prompts if label != "cuda-fast" else []:
                cache = be.kv_cache(model.kv_shape())
                toks.append(greedy(be, model, cache, [int(x) for x in p], n_tokens))
            lg = None
            if label != "cuda-eager":
                cache = be.kv_cache(model.kv_shape())
                lg = teacher_forced(be, model, cache, [int(x) for x in text])
            if label == "cuda-fast":  # default mode through the decode path: the int8-activation GEMV
                cache = be.kv_cache(model.kv_shape())
                res["cuda-fast-decode"] = ([], teacher_forced_decode(be, model, cache, [int(x) for x in text]))
            res[label] = (toks, lg)
            del model
        cpu, gpu, eager = res["cpu"], res["cuda"], res["cuda-eager"]
        same = sum(a == b for a, b in zip(cpu[0], gpu[0]))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(cpu[0], gpu[0])]
        top1 = float(np.mean(cpu[1].argmax(1) == gpu[1].argmax(1)))
        p_cpu, p_gpu = ppl(cpu[1], text), ppl(gpu[1], text)
        maxdiff = float(np.abs(cpu[1] - gpu[1]).max())
        graph_ok = gpu[0] == eager[0]
        fast = res["cuda-fast"][1]  # default mode: bf16 prefill GEMM, against the CPU's exact logits
        top1_fast = float(np.mean(cpu[1].argmax(1) == fast.argmax(1)))
        ppl_fast = ppl(fast, text)
        dec = res["cuda-fast-decode"][1]
        top1_dec, ppl_dec = float(np.mean(cpu[1].argmax(1) == dec.argmax(1))), ppl(dec, text)
        row = dict(model=name, prompts_equal=f"{same}/{len(prompts)}", first_diff=first_diff, top1=top1,
                   ppl_cpu=p_cpu, ppl_gpu=p_gpu, ppl_rel=abs(p_gpu - p_cpu) / p_cpu, max_logit_diff=maxdiff,
                   graph_equals_eager=graph_ok, top1_fast=top1_fast, ppl_fast=ppl_fast,
                   ppl_rel_fast=abs(ppl_fast - p_cpu) / p_cpu, top1_fast_decode=top1_dec, ppl_fast_decode=ppl_dec,
                   ppl_rel_fast_decode=abs(ppl_dec - p_cpu) / p_cpu, seconds=time.perf_counter() - t0)
        say("  ", json.dumps(row))
        rows.append(row)
        SUMMARY.append(f"{name:26s} tokens {same}/{len(prompts)} equal (first diff {first_diff}), top-1 {top1:.3f}, "
                       f"ppl {p_cpu:.3f}/{p_gpu:.3f} ({100 * row['ppl_rel']:.3f}%), graph==eager {graph_ok}; "
                       f"fast: top-1 {top1_fast:.3f}, ppl {100 * row['ppl_rel_fast']:.3f}%; fast decode (int8 GEMV): "
                       f"top-1 {top1_dec:.3f}, ppl {ppl_dec:.3f} ({100 * row['ppl_rel_fast_decode']:.3f}%)")
        g.close()
    RESULTS.setdefault("compare", []).extend(rows)


@section("GEMV tile sweep (sets the config the benchmarks use)")
def tune() -> None:
    sys.path.insert(0, "scripts")
    import gpu_tune

    best = {f"{bits}-bit {cls}": cfg for (bits, cls), cfg in gpu_tune.q8().items()}
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
    from quanta import gguf
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.models import load_model

    for name, path in models:
        g = gguf.open(path)
        be = CUDABackend("cuda")
        t = time.perf_counter()
        model = load_model(g, be, 2048)
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t
        cache = be.kv_cache(model.kv_shape())
        nbytes = bytes_per_token(model)
        rng = np.random.default_rng(0)
        vocab = model.n_vocab

        d0 = decode_rate(be, model, cache, 0, n_decode)
        d1k = decode_rate(be, model, cache, 1024, n_decode)
        prompt512 = rng.integers(5, min(vocab, 30000), size=512).astype(np.int32)
        pf = cuda_time(lambda: be.forward(model, prompt512, 0, cache, all_logits=False), reps=5, warmup=2)
        roof = bw / nbytes
        row = dict(model=name, bytes_per_token=nbytes, decode_tok_s=d0, decode_pct_roofline=100 * d0 / roof,
                   decode_depth1024_tok_s=d1k, depth_ratio=d1k / d0, prefill512_tok_s=512 / pf, load_s=load_s,
                   fusion=launches_per_layer(model))
        # per-kernel breakdown of one eager decode step, near the benchmark's depth and after 1,100 tokens
        try:
            from torch.profiler import ProfilerActivity, profile

            be.graphs = False
            for pos in (100, 1100):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        be.forward(model, np.asarray([7], np.int32), pos, cache, all_logits=False)
                    torch.cuda.synchronize()
                agg: dict[str, float] = {}
                launches = 0
                for ev in prof.key_averages():
                    if ev.device_time_total > 0:
                        agg[ev.key] = agg.get(ev.key, 0.0) + ev.device_time_total / 5
                        launches += ev.count
                row[f"launches_per_token@{pos}"] = launches / 5
                row[f"kernel_us_per_token@{pos}"] = {k: round(v, 1) for k, v in
                                                     sorted(agg.items(), key=lambda kv: -kv[1])[:12]}
                row[f"kernel_total_us@{pos}"] = sum(agg.values())
            be.graphs = True
        except Exception as e:  # the profiler is a nice-to-have
            row["kernel_breakdown_error"] = repr(e)
        say("  ", json.dumps(row))
        RESULTS.setdefault("bench", []).append(row)
        SUMMARY.append(f"{name:26s} decode {d0:7.0f} tok/s ({row['decode_pct_roofline']:.1f}% of roofline, "
                       f"{nbytes / 1e6:.0f} MB/token), @1024 {d1k:7.0f} ({100 * d1k / d0:.0f}%), "
                       f"prefill-512 {512 / pf:8.0f} tok/s, load {load_s:.1f}s, "
                       f"launches/token {row.get('launches_per_token@100', '?')}, qkv {row['fusion']['qkv']}")
        del model, cache, be
        g.close()
        torch.cuda.empty_cache()


def decode_rate(be, model, cache, depth: int, n_decode: int, seed: int = 0) -> float:
    """Greedy decode tok/s of the real loop (graph replay, device argmax, one host read per token) after a
    ``depth``-token prompt."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(5, min(model.n_vocab, 30000), size=max(depth, 8)).astype(np.int32)
    tok, pos = be.argmax(be.forward(model, prompt, 0, cache, all_logits=False)[0]), len(prompt)
    for i in range(8 + n_decode):
        if i == 8:  # after warm-up (graph capture at the first decode)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        tok = be.argmax(be.forward(model, np.asarray([tok], np.int32), pos, cache, all_logits=False)[0])
        pos += 1
    return n_decode / (time.perf_counter() - t0)


@section("decode speed against context depth (n_ctx 8192)")
def depth_sweep(models: list[tuple[str, Path]], depths: tuple[int, ...] = (0, 1024, 4096)) -> None:
    from quanta import gguf
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.models import load_model

    for name, path in models:
        g = gguf.open(path)
        be = CUDABackend("cuda")
        model = load_model(g, be, 8192)
        cache = be.kv_cache(model.kv_shape())
        rates = {d: decode_rate(be, model, cache, d, 128) for d in depths}
        line = f"{name:22s} decode by depth: " + ", ".join(f"{d}: {r:.0f} ({100 * r / rates[depths[0]]:.0f}%)"
                                                          for d, r in rates.items())
        say("  ", line)
        SUMMARY.append(line)
        del model, cache, be
        g.close()
        torch.cuda.empty_cache()


VARIANTS = {"float GEMV": False, "int8 GEMV": True}  # decode variants compared in one process: int8 activations?


@section("decode variants (float / int8-activation GEMV), alternating in one process")
def variants_ab(models: list[tuple[str, Path]], reps: int = 2) -> None:
    from quanta import gguf
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.models import load_model

    for name, path in models:
        g = gguf.open(path)
        be = CUDABackend("cuda")
        model = load_model(g, be, 2048)
        cache = be.kv_cache(model.kv_shape())
        rates: dict = {}
        for _ in range(reps):
            for depth in (0, 1024):
                for label, on in VARIANTS.items():
                    be.q8 = on
                    be._graphs.clear()
                    rates.setdefault((depth, label), []).append(decode_rate(be, model, cache, depth, 64))
        be.q8 = True
        med = {k: float(np.median(v)) for k, v in rates.items()}
        line = f"{name:22s} decode " + ", ".join(f"{lab} {med[(0, lab)]:.0f}" for lab in VARIANTS) + \
            " | @1024 " + ", ".join(f"{med[(1024, lab)]:.0f}" for lab in VARIANTS)
        say("  ", line, json.dumps({f"{d} {lab}": [round(x) for x in v] for (d, lab), v in rates.items()}))
        SUMMARY.append(line)
        del model, cache, be
        g.close()
        torch.cuda.empty_cache()


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
    from torch.profiler import ProfilerActivity, profile

    from quanta import gguf
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.models import load_model

    g = gguf.open(path)
    be = CUDABackend("cuda")
    model = load_model(g, be, 2048)
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
    import cProfile
    import io
    import pstats

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
    g.close()


BENCH_PRESETS = (("tinyllama-1.1b", "Q4_K_M"), ("llama-3.2-1b", "Q4_K_M"), ("qwen2.5-1.5b", "Q4_0"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="kernels,compare,tune,bench,ttft,prefillprof,compare2")
    ap.add_argument("--quick", action="store_true", help="GEMV-only kernel checks, tiny models only in compare")
    ap.add_argument("--real", default="", help="a real GGUF to compare too (e.g. SmolLM2)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    say(f"torch {torch.__version__}, triton {__import__('triton').__version__}, {torch.cuda.get_device_name()}")
    bw = bandwidth() or 4.3e12
    if "kernels" in only:
        kernel_checks((1,) if args.quick else (1, 3, 77))
    if "depth" in only:
        depth_sweep([(f"{p} {t}", synth(p, t)) for p, t in BENCH_PRESETS])
    if "tune" in only:  # the int8 GEMV's tiles (set in this process for what follows)
        tune()
    if "ab" in only:  # float / int8 GEMV, alternating in one process
        variants_ab([(f"{p} {t}", synth(p, t)) for p, t in BENCH_PRESETS])
    if "benchfirst" in only:  # short device budgets: the benchmark before the (CPU-heavy) comparisons
        bench([(f"{p} {t}", synth(p, t)) for p, t in BENCH_PRESETS], bw)
    if "compare" in only:  # tiny models of three architectures and synthetic SmolLM2 against the CPU exact mode
        models = tiny_models()
        if args.real:
            models.append(("real-" + Path(args.real).stem, Path(args.real)))
        if not args.quick:
            models.append(("smollm2-135m Q4_1", synth("smollm2-135m", "Q4_1")))
        compare(models)
    bench_models = []
    if "bench" in only:
        for preset, ft in BENCH_PRESETS:
            bench_models.append((f"{preset} {ft}", synth(preset, ft)))
    if "bench" in only:
        bench(bench_models, bw)
    if "ttft" in only:
        first_token(bench_models[0][1] if bench_models else synth(*BENCH_PRESETS[0]))
    if "prefillprof" in only and bench_models:
        prefill_profile(bench_models[0][1])
    if "compare2" in only:  # gemma3 (head dim 256, window, soft-cap) at 270M
        compare([("gemma3-270m Q4_K_M", synth("gemma3-270m", "Q4_K_M"))])
    if "synthcompare" in only:  # the big presets against the CPU exact mode (slow on the CPU side)
        compare(bench_models or [(f"{p} {t}", synth(p, t)) for p, t in (("tinyllama-1.1b", "Q4_K_M"),)])
    (OUT / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    say("\n==== SUMMARY ====")
    for line in SUMMARY:
        say(line)


if __name__ == "__main__":
    main()
