"""One run on the GPU machine: kernel checks, GPU-vs-CPU-exact token and logit comparisons, CUDA-graph vs eager,
and the batch-1 benchmarks (decode at depth 0 and 1024, prefill-512, time to first token), with the card's
measured read bandwidth for the roofline. Full log in $OUT/gpu_check.log, numbers in $OUT/gpu_check.json; the
summary table is printed last.

Usage (repo root, on the GPU machine): PYTHONPATH=src python3 scripts/gpu_check.py [--quick] [--only NAME,...]
(sections: tests, attntests, kernels, depth, tune, tune6, logits, loops, ab, copies, dequant, dense,
benchfirst, compare, bench, ttft, prefillprof, compare2, synthcompare)
(the speed sections live in gpu_speed.py, the decode variants and loops in gpu_variants.py, the shared helpers in
gpu_common.py)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gpu_common import BENCH_PRESETS, OUT, RESULTS, SUMMARY, WORK, bandwidth, random_raw, say, section, synth
from gpu_speed import (PREFILL_COPIES, PREFILL_DENSE, PREFILL_DEQUANT, bench, depth_sweep, first_token, prefill_ab,
                       prefill_profile, tune)
from gpu_variants import loop_compare, variants_ab, variants_logits


@section("pytest tests/backends/cuda on the GPU (tests needing gguf-py skip where it is missing)")
def gpu_tests(timeout_s: int = 540, path: str = "tests/backends/cuda") -> None:
    cmd = [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider", "-rfs"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        out = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() + f"\nTIMEOUT after {timeout_s} s"
    (OUT / "gpu_tests.txt").write_text(out)
    last = out.strip().splitlines()[-1] if out.strip() else "no output"
    say("  ", last)
    SUMMARY.append(f"GPU tests: {last}")


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
    from quanta.backends.cuda.q8gemv import quantize
    from quanta.backends.cuda.qmatmul import gemv_class

    for t in ("Q4_K", "Q6_K", "Q4_0"):  # the int8 GEMV in every tile class of Q8_CONFIG (n=1000 above is "small")
        for n, k in ((2048, 2048), (2048, 5632), (16384, 2048)):
            w = repack(torch.from_numpy(random_raw(t, n, k, rng)).cuda(), t, (n, k))
            x = torch.randn(1, k, device="cuda")
            xq = quantize(x)
            xd = (xq.q.view(1, k // 32, 8, 4).transpose(2, 3).reshape(1, k // 32, 32).double()
                  * xq.d.double()[..., None]).reshape(1, k)
            y = torch.full((1, n), float("nan"), device="cuda")
            qmatmul(x, w, out=y, xq=xq)
            ref = xd @ dequantize_packed(w).double().T
            worst[f"{t} {gemv_class(n, k)} int8"] = ((y.double() - ref).norm() / ref.norm()).item()
    # the fast GEMM's bf16 operands (8-bit mantissas) cost ~2.3e-3 here; IEEE dots and the GEMVs 1e-7
    bad = {k: v for k, v in worst.items() if not (v < (4e-3 if ("m=77" in k or "m=300" in k) and "ieee" not in k
                                                       else 1e-5))}
    for k, v in worst.items():
        say(f"  {k:22s} rel err {v:.2e}")
    RESULTS["kernel_errors"] = worst
    SUMMARY.append(f"qmatmul/embed, 13 formats on GPU: {'all within tolerance' if not bad else 'BAD: ' + str(bad)}")


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="kernels,compare,tune,bench,ttft,prefillprof,compare2")
    ap.add_argument("--quick", action="store_true", help="GEMV-only kernel checks, tiny models only in compare")
    ap.add_argument("--real", default="", help="a real GGUF to compare too (e.g. SmolLM2)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    say(f"torch {torch.__version__}, triton {__import__('triton').__version__}, {torch.cuda.get_device_name()}")
    bw = bandwidth() or 4.3e12
    if "tests" in only:
        gpu_tests()
    if "attntests" in only:  # the attention tests alone (quick)
        gpu_tests(path="tests/backends/cuda/test_attention.py")
    if "kernels" in only:
        kernel_checks((1,) if args.quick else (1, 3, 77))
    if "depth" in only:
        depth_sweep([(f"{p} {t}", synth(p, t)) for p, t in BENCH_PRESETS])
    if "tune" in only:  # the int8 GEMV's tiles (set in this process for what follows)
        tune()
    if "tune6" in only:  # the same, for the 4-bit codes with high bits (Q6_K) only
        tune((6,))
    if "logits" in only:  # decode variants' greedy logits against the first's
        variants_logits([(f"{p} {t}", synth(p, t)) for p, t in BENCH_PRESETS])
    if "loops" in only:  # the product's generate loop, the host-driven loop and back-to-back replays
        loop_compare([(f"{p} {t}", synth(p, t)) for p, t in BENCH_PRESETS])
    if "ab" in only:  # decode variants (gpu_variants.VARIANTS), alternating in one process
        variants_ab([(f"{p} {t}", synth(p, t)) for p, t in BENCH_PRESETS + (("llama-3.2-1b", "Q5_K_M"),)])
    if "copies" in only:  # prefill: the producers' bf16 operand for the GEMM against each GEMM's own copy
        prefill_ab([(f"{p} {t}", synth(p, t)) for p, t in BENCH_PRESETS + (("llama-3.2-1b", "Q8_0"),
                                                                             ("qwen2.5-1.5b", "Q8_0"))],
                   PREFILL_COPIES)
    if "dequant" in only:  # prefill: dequantized weights multiplied dense against the fused GEMM
        prefill_ab([(f"{p} {t}", synth(p, t)) for p, t in BENCH_PRESETS + (("llama-3.2-1b", "Q6_K"),)],
                   PREFILL_DEQUANT, lengths=(64, 128, 512, 2048))
    if "dense" in only:  # prefill: the dequantized weights through the TMA kernel against the pointer-based path
        prefill_ab([(f"{p} {t}", synth(p, t)) for p, t in BENCH_PRESETS], PREFILL_DENSE, lengths=(64, 512, 2048))
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
