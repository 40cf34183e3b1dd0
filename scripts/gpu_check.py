"""The GPU check harness, run on a CUDA machine: the CUDA tests, GPU against CPU exact mode on synthetic (and a
real) model, and the benchmarks: the batched engine at several concurrencies (`quanta bench --concurrency`), the
single-request bench, the cold starts (warm caches, an empty kernel cache), the old code's single-stream decode
side by side (``--old DIR``: a source tree of an older commit), the decode matmul routes per batch size, the
captured decode graphs' GPU time per batch size, and the int8 KV cache against the fp16 one.

Everything but the two timing sections (``kernels``, ``graphs``) goes through quanta's public interface: the
`quanta synth` and `quanta bench` verbs (one process each) and `quanta.LLM`.

    OUT=gpu_out scripts/gpu_check.sh [--only tests,serving,bench,start,old,kernels,graphs,kvq8,compare] [--real M.gguf]

Log in $OUT/gpu_check.log, every number (the benches' --json reports too) in $OUT/gpu_check.json, the CUDA tests'
output in $OUT/gpu_tests.txt; the summary is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SERVING_MODEL = ("tinyllama-1.1b", "Q4_K_M")
CONCURRENCY = "1,4,16,64,256"
# GPU vs CPU exact: one model per architecture and the 4-, 5- and 6-bit layouts; (preset, type, layers or None)
COMPARE_MODELS = (("smollm2-135m", "Q4_1", None), ("gemma3-270m", "Q4_K_M", None), ("llama-3.2-1b", "Q5_K_M", 4))
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KV_DEPTHS = (1024, 8192, 32768)  # issue 36's depths for the int8 KV cache (Llama-3.2-1B: 128k trained context)
# prose for the int8 KV cache's fidelity on a real model: a carried copy (gpu_check.sh), or Debian's GPL-3
TEXTS = (Path("gpu_parts/text.txt"), Path("/usr/share/common-licenses/GPL-3"))
PROSE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a "
         "screw press with movable metal type and an oil-based ink. Within fifty years, presses were running in more "
         "than two hundred cities across Europe, and the cost of a book fell so far that ordinary merchants could own "
         "several. Scholars argue about how quickly literacy followed, but most agree that cheap pamphlets spread new "
         "ideas faster than any earlier technology.")


@dataclass
class Run:
    """One harness run: where its files go, what it measured, and the summary lines printed at the end."""

    out: Path
    work: Path
    results: dict[str, Any] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)

    def say(self, *parts: object) -> None:
        msg = " ".join(str(p) for p in parts)
        print(msg, flush=True)
        with open(self.out / "gpu_check.log", "a") as log:
            print(msg, file=log)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Logs a failing section's traceback and goes on with the next one; saves the results after each."""
        t = time.perf_counter()
        self.say(f"== {name}")
        try:
            yield
        except Exception:
            self.say(traceback.format_exc())
            self.summary.append(f"{name}: FAILED (see log)")
        finally:
            self.say(f"-- {name}: {time.perf_counter() - t:.1f}s")
            self.save()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps({**self.results, "summary": self.summary}, indent=1))


def quanta_cli(*args: str, timeout_s: int = 600, src: str = "src") -> str:
    """One `quanta` command in its own process (from the source tree ``src``); its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}  # src first
    p = subprocess.run([sys.executable, "-m", "quanta", *args], capture_output=True, text=True, timeout=timeout_s,
                       env=env)
    if p.returncode:
        raise RuntimeError(f"quanta {' '.join(args)} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p.stdout


def synth(run: Run, preset: str, file_type: str, layers: int | None = None) -> Path:
    """A random-weight model of the preset's real shapes (`quanta synth`), written once per machine."""
    path = run.work / f"{preset}-{file_type}{f'-{layers}l' if layers else ''}.gguf"
    if not path.exists():
        quanta_cli("synth", preset, str(path), "--type", file_type, *(["--layers", str(layers)] if layers else []))
    return path


def gpu_tests(run: Run, path: str = "tests/backends/cuda", timeout_s: int = 420) -> None:
    """The CUDA tests on the GPU, 8 processes (their kernels compile in parallel)."""
    with run.section(f"pytest {path}"):
        cmd = [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider", "-rfs", "-n", "8"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            out = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() + f"\nTIMEOUT after {timeout_s} s"
        (run.out / "gpu_tests.txt").write_text(out)
        results = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
        last = results[-1] if results else (out.strip().splitlines() or ["no output"])[-1]
        run.say("  ", last)
        run.summary.append(f"GPU tests: {last}")


def bandwidth(run: Run) -> float:
    from quanta.bench.roofline import cuda_read_bandwidth

    bw = cuda_read_bandwidth()
    run.results.setdefault("bandwidth_gb_s", []).append(bw / 1e9)
    run.say(f"   read bandwidth {bw / 1e12:.2f} TB/s (4 GiB fp32 sum, median of 10)")
    return bw


def serving(run: Run) -> None:
    """`quanta bench --concurrency` on TinyLlama: 128-token prompts, 128 new tokens each."""
    with run.section("quanta bench --concurrency"):
        path = synth(run, *SERVING_MODEL)
        report_path = run.out / "serving.json"
        flags = ["--concurrency", CONCURRENCY, "-p", "128", "-n", "128", "--repeats", "2", "--prefix-tokens", "1000"]
        table = quanta_cli("bench", "-m", str(path), "--device", "cuda", *flags, "--json", str(report_path),
                           "--plot", str(run.out / "serving.png"))
        run.say(table)
        r = json.loads(report_path.read_text())
        run.results["serving"] = r
        for row in r["runs"]:
            run.summary.append(f"serving {row['concurrency']:>3}: decode {row['decode_tok_s']:>9,.0f} tok/s "
                               f"(per seq {row['per_seq_decode_tok_s']:,.0f}), prefill {row['prefill_tok_s']:,.0f}, "
                               f"TTFT p50/p90/p99 {row['ttft_ms_p50']:.0f}/{row['ttft_ms_p90']:.0f}/"
                               f"{row['ttft_ms_p99']:.0f} ms")
        p = r.get("prefix_cache")
        if p:
            run.summary.append(f"prefix cache: TTFT {p['first_ttft_ms']:.1f} -> {p['shared_ttft_ms']:.1f} ms "
                               f"({100 * p['ratio']:.1f}%) sharing {p['prefix_tokens']} tokens")


def single(run: Run, label: str, src: str) -> None:
    """`quanta bench --device cuda -p 128 -n 128` (one request) from the source tree ``src``."""
    with run.section(f"quanta bench, one request ({label})"):
        path = synth(run, *SERVING_MODEL)
        report_path = run.out / f"bench_{label}.json"
        table = quanta_cli("bench", "-m", str(path), "--device", "cuda", "-p", "128", "-n", "128", "--repeats", "3",
                           "--no-cold-start", "--json", str(report_path), src=src)
        run.say(table)
        r = json.loads(report_path.read_text())
        run.results[f"bench_{label}"] = {k: v for k, v in r.items() if k != "breakdown"} | {
            "breakdown": r.get("breakdown")}
        run.summary.append(f"one request ({label}): decode {r['decode_tok_s']:,.0f} tok/s "
                           f"({r['roofline_pct']:.1f}% of {r['bandwidth_gb_s'] / 1e3:.2f} TB/s), prefill-128 "
                           f"{r['prefill_tok_s']:,.0f} tok/s, TTFT {r['ttft_ms']:.1f} ms")


def _matmul_step_ms(weights: list, m: int, fn: Any, scratch: Any = None) -> float:
    """GPU ms of one decode step's matmuls (``weights``: (weight, count) pairs) through ``fn(w, x, xq, ep)``, m
    rows, captured in one graph and replayed (median of 10); the lm head too large for ``scratch`` takes the
    plain GEMM."""
    import torch

    from quanta.backends.cuda import gemm, q8gemv
    from quanta.backends.cuda.qmatmul import _Epilogue

    x = torch.randn(m, 5632, device="cuda")
    calls = []
    for w, count in weights:
        f = fn
        if scratch is not None and w.n * w.k > scratch.numel():
            f = lambda w, xs, xq, ep: gemm.gemm(xs, w, ep, False)  # noqa: E731
        xs = x[:, :w.k].contiguous()
        calls += [(f, w, xs, q8gemv.quantize(xs), _Epilogue(torch.empty(m, w.n, device="cuda"), None, None, None,
                                                            w.n))] * count
    for f, w, xs, xq, ep in calls[:len(weights) * 22:22] + calls[-1:]:
        f(w, xs, xq, ep)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f, w, xs, xq, ep in calls:
            f(w, xs, xq, ep)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def kernels(run: Run) -> None:
    """Decode matmul GPU time per step of TinyLlama's shapes (22 layers and the lm head) by route and row count
    (``_matmul_step_ms``: a single small matmul timed alone measures Python's launch overhead, not the kernel). The
    split-K GEMM's tile sweep of GPU run 208 is in git history (6bf7c0c)."""
    import torch

    from quanta.backends.cuda import gemm, q8gemv
    from quanta.backends.cuda.repack import repack
    from quanta.synth.random_weights import random_tensor

    with run.section("decode matmul routes"):
        rng = np.random.default_rng(0)
        shapes = [(2304, 2048, "Q4_K", 22), (256, 2048, "Q6_K", 22), (2048, 2048, "Q4_K", 22),
                  (11264, 2048, "Q4_K", 22), (2048, 5632, "Q6_K", 22), (32000, 2048, "Q6_K", 1)]
        weights = [(repack(torch.from_numpy(random_tensor(t, (n, k), rng)).cuda(), t, (n, k)), count)
                   for n, k, t, count in shapes]
        scratch = torch.empty(11264 * 2048, dtype=torch.bfloat16, device="cuda")
        table: dict[str, dict[int, float]] = {}
        for m in ROWS:
            routes = {"gemm": (lambda w, xs, xq, ep: gemm.gemm(xs, w, ep, False), None),
                      "dequant": (lambda w, xs, xq, ep: gemm.gemm(xs, w, ep, False, scratch=scratch), scratch)}
            if m <= 16:
                routes["gemv_q8"] = (lambda w, xs, xq, ep: q8gemv.gemv_q8(xq, w, ep, True), None)
            for name, (fn, scratch_of) in routes.items():
                table.setdefault(name, {})[m] = _matmul_step_ms(weights, m, fn, scratch_of)
            run.say(f"   rows {m:>3}: " + ", ".join(f"{k} {v[m]:.3f} ms" for k, v in table.items() if m in v))
        run.results["matmul_ms_per_step"] = table


def graph_times(run: Run) -> None:
    """GPU time of one captured decode step per batch size (replays timed with events), next to the engine's
    whole step: what the host adds."""
    import torch

    from quanta import LLM
    from quanta.bench.serving import run_burst

    with run.section("decode graphs: GPU time per step"):
        path = synth(run, *SERVING_MODEL)
        llm = LLM(path, device="cuda", n_ctx=272, max_seqs=64)
        vocab = llm.config.vocab_size
        rng = np.random.default_rng(0)
        rows = {}
        for c in (1, 4, 8, 16, 32, 64):
            prompts = [rng.integers(1000, vocab - 4000, 128).tolist() for _ in range(c)]
            run_burst(llm.engine, prompts, 8)  # captures the bucket
            burst = run_burst(llm.engine, prompts, 128)
            replay = llm.engine.runner.graphs.replay_of(c)
            times = []
            for _ in range(30):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            gpu_ms = float(np.median(times))
            step_ms = 1e3 * c / burst["decode_tok_s"]
            rows[c] = {"gpu_ms": gpu_ms, "step_ms": step_ms, "host_ms": step_ms - gpu_ms,
                       "gpu_tok_s": 1e3 * c / gpu_ms, "engine_tok_s": burst["decode_tok_s"]}
            run.say(f"   {c:>3} sequences: replay {gpu_ms:.3f} ms, engine step {step_ms:.3f} ms "
                    f"(host {step_ms - gpu_ms:.3f} ms); GPU-only {1e3 * c / gpu_ms:,.0f} tok/s")
        free = llm.backend.free_memory()
        per_seq = llm.backend.kv_nbytes(llm.model.kv_shape(2048 // 16, 16))
        rows["pool"] = {"free_after_pool_gib": free / 2**30, "kv_bytes_per_2k_seq": per_seq}
        run.results["graphs"] = rows
        run.summary.append("decode step GPU / engine ms: " + ", ".join(
            f"{c}: {r['gpu_ms']:.3f}/{r['step_ms']:.3f}" for c, r in rows.items() if c != "pool"))
        llm.close()


def kv_int8(run: Run, real: str) -> None:
    """The int8 KV pool against the fp16 one in one run: decode tok/s of one request at depths (Llama-3.2-1B, 128
    tokens after a prompt that long; median of 3), the tokens 1 GiB of pool holds, and with ``real`` (a real model)
    the int8 cache's perplexity and teacher-forced top-1 agreement against the float cache's over 2 x 1,024 tokens
    of prose (as tests/engine/test_kv_q8.py on the CPU), in both modes."""
    from quanta import LLM

    with run.section("int8 KV cache against fp16"):
        path = synth(run, "llama-3.2-1b", "Q4_K_M")
        rows: dict[str, dict] = {}
        for kv in ("f16", "q8"):
            rng = np.random.default_rng(0)
            with LLM(path, device="cuda", n_ctx=KV_DEPTHS[-1] + 256, max_seqs=1, kv_dtype=kv) as llm:
                row = rows[kv] = {}
                for depth in (8, *KV_DEPTHS):
                    prompt = rng.integers(1000, llm.config.vocab_size - 4000, depth).tolist()
                    llm.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)  # compiles, fills the cache
                    row[depth] = float(np.median([llm.generate(prompt, max_tokens=128, temperature=0.0,
                                                               ignore_eos=True).stats.decode_tok_s for _ in range(3)]))
            with LLM(path, device="cuda", n_ctx=4096, kv_dtype=kv, kv_memory=2**30) as llm:
                row["tokens_per_gib"] = llm.engine.runner.n_blocks * llm.engine.runner.block_size
            run.say(f"   {kv}: " + ", ".join(f"{k} {v:,.0f}" for k, v in row.items()))
        text = next((t for t in TEXTS if t.exists()), None)
        if real and text:  # the default mode against its fp16 cache, exact mode against its fp32 one
            for mode, base in (("default", "f16"), ("exact", "f32")):
                logits, ids = {}, []
                for kv in (base, "q8"):
                    with LLM(real, device="cuda", n_ctx=1024, max_seqs=1, kv_dtype=kv, exact=mode == "exact") as llm:
                        ids = llm.tokenize(" ".join(text.read_text().split()))[:2048]
                        logits[kv] = [llm.logits(ids[w:w + 1024]) for w in (0, 1024)]
                ppl = {kv: float(np.exp(np.mean([np.log(perplexity(lg, ids[w * 1024:(w + 1) * 1024]))
                                                 for w, lg in enumerate(parts)]))) for kv, parts in logits.items()}
                top1 = float(np.mean(np.concatenate(logits[base]).argmax(1) == np.concatenate(logits["q8"]).argmax(1)))
                rows[f"real_{mode}"] = r = {"base": base, "ppl_base": ppl[base], "ppl_q8": ppl["q8"], "top1": top1}
                run.say("  ", json.dumps(r))
                run.summary.append(f"int8 KV on {Path(real).stem} ({mode} mode, {len(ids)} tokens): top-1 {top1:.4f} "
                                   f"of {base}'s, perplexity {r['ppl_q8']:.3f} against {r['ppl_base']:.3f} "
                                   f"({100 * (r['ppl_q8'] / r['ppl_base'] - 1):+.2f}%)")
        run.results["kv_int8"] = rows
        f16, q8 = rows["f16"], rows["q8"]
        run.summary.append("int8 KV decode tok/s (fp16): " + ", ".join(
            f"depth {d}: {q8[d]:,.0f} ({f16[d]:,.0f}, {q8[d] / f16[d]:.2f}x)" for d in (8, *KV_DEPTHS))
            + f"; tokens per GiB {q8['tokens_per_gib']:,} ({f16['tokens_per_gib']:,})")


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    lg = logits[:-1].astype(np.float64)
    top = lg.max(axis=1)
    log_z = np.log(np.exp(lg - top[:, None]).sum(axis=1)) + top
    return float(np.exp(np.mean(log_z - lg[np.arange(len(ids) - 1), ids[1:]])))


def compare(run: Run, name: str, model: Path | tuple[str, str, int | None], n_tokens: int = 32) -> None:
    """GPU exact mode against CPU exact mode (greedy continuations of a batch of prompts, teacher-forced logits),
    and the GPU default mode's top-1 and perplexity against CPU exact mode; ``model``: a file, or a synth."""
    from quanta import LLM

    with run.section(f"GPU vs CPU exact: {name}"):
        t0 = time.perf_counter()
        path = model if isinstance(model, Path) else synth(run, *model)
        modes = {"cpu": dict(device="cpu", exact=True), "cuda": dict(device="cuda", exact=True),
                 "cuda-fast": dict(device="cuda")}
        tokens, logits = {}, {}
        for label, kwargs in modes.items():
            with LLM(path, n_ctx=512, **kwargs) as llm:
                rng = np.random.default_rng(1)
                vocab = llm.config.vocab_size
                if name.startswith("real"):  # real prose, where perplexity means something
                    text = llm.tokenize(PROSE)[:200]
                else:
                    text = rng.integers(5, min(vocab, 30000), size=64).tolist()
                prompts = [rng.integers(5, min(vocab, 30000), size=n).tolist() for n in (7, 16, 3, 40)]
                results = llm.generate(prompts, max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
                tokens[label] = [r.token_ids for r in results]
                logits[label] = llm.logits(text)
        cpu, gpu, fast = logits["cpu"], logits["cuda"], logits["cuda-fast"]
        same = sum(a == b for a, b in zip(tokens["cpu"], tokens["cuda"]))
        p_cpu = perplexity(cpu, text)
        row = dict(model=name, greedy_equal=f"{same}/{len(prompts)}",
                   top1=float(np.mean(cpu.argmax(1) == gpu.argmax(1))),
                   ppl_rel=abs(perplexity(gpu, text) / p_cpu - 1),
                   max_logit_diff=float(np.abs(cpu - gpu).max() / np.abs(cpu).max()),
                   top1_fast=float(np.mean(cpu.argmax(1) == fast.argmax(1))),
                   ppl_rel_fast=perplexity(fast, text) / p_cpu - 1, seconds=time.perf_counter() - t0)
        run.say("  ", json.dumps(row))
        run.results.setdefault("compare", []).append(row)
        run.summary.append(f"{name:28s} exact: greedy {row['greedy_equal']} equal (batched), top-1 "
                           f"{row['top1']:.3f}, ppl {100 * row['ppl_rel']:.3f}%, max logit diff "
                           f"{row['max_logit_diff']:.1e}; default mode: top-1 {row['top1_fast']:.3f}, ppl "
                           f"{100 * row['ppl_rel_fast']:+.2f}%")


def start(run: Run, model: tuple[str, str] = SERVING_MODEL, empty_cache: bool = True) -> None:
    """`quanta bench --device cuda --empty-kernel-cache`: process start to first token with warm caches and with an
    empty Triton cache (issue 38's 2.5 s and 10 s on TinyLlama; 4 s warm on the 7B)."""
    name = f"{model[0]} {model[1]}"
    with run.section(f"quanta bench, cold starts, {name}"):
        path = synth(run, *model)
        report_path = run.out / f"start-{model[0]}.json"
        table = quanta_cli("bench", "-m", str(path), "--device", "cuda", "-p", "8", "-n", "16", "--repeats", "3",
                           *(["--empty-kernel-cache"] if empty_cache else []), "--json", str(report_path))
        run.say(table)
        r = json.loads(report_path.read_text())
        run.results[f"start {name}"] = {k: v for k, v in r.items() if k.startswith("cold_start")}
        empty = f", {r['cold_start_empty_cache_s']:.2f} s with an empty kernel cache" if empty_cache else ""
        run.summary.append(f"{name} cold start to first token: {r['cold_start_s']:.2f} s warm{empty}")


def speculative(run: Run, real: str) -> None:
    """`quanta bench --speculative ngram` on the real model (issue 36: random weights never repeat)."""
    if not real:
        run.summary.append("speculative: skipped (needs --real)")
        return
    with run.section("quanta bench --speculative ngram"):
        report_path = run.out / "speculative.json"
        run.say(quanta_cli("bench", "-m", real, "--device", "cuda", "--speculative", "ngram", "-n", "128",
                           "--repeats", "3", "--json", str(report_path)))
        for name, r in json.loads(report_path.read_text())["sets"].items():
            run.summary.append(f"speculative {name}: {r['speedup']:.2f}x ({r['speedup_min']:.2f}-"
                               f"{r['speedup_max']:.2f}), acceptance {r['acceptance']:.0%}, "
                               f"{r['tokens_per_verify']:.2f} tokens per verify, same tokens {r['identical_tokens']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="tests,serving,bench,start,old,kernels,graphs,kvq8,compare",
                    help="sections: tests, serving, bench, start, start7b, old, kernels, graphs, kvq8, speculative, "
                         "compare")
    ap.add_argument("--real", default="", help="a real GGUF to compare too (e.g. SmolLM2)")
    ap.add_argument("--old", default="", help="the src/ folder of an older commit, for `old`")
    ap.add_argument("--out", type=Path, default=Path("gpu_out"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/quanta_gpu"), help="where synthetic models are kept")
    args = ap.parse_args()
    only = set(args.only.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.work)
    import torch

    run.say(f"torch {torch.__version__}, triton {__import__('triton').__version__}, {torch.cuda.get_device_name()}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    bandwidth(run)
    if "old" in only and args.old:  # the old code first: one request on an idle machine, as the new one below
        single(run, "old", args.old)
    if "bench" in only:
        single(run, "new", "src")
    if "start" in only:
        start(run)
    if "start7b" in only:
        start(run, ("llama-2-7b", "Q4_K_M"), empty_cache=False)
    if "speculative" in only:
        speculative(run, args.real)
    if "serving" in only:
        serving(run)
    if "graphs" in only:
        graph_times(run)
    if "kernels" in only:
        kernels(run)
    if "kvq8" in only:
        kv_int8(run, args.real)
    bandwidth(run)
    if "tests" in only:
        gpu_tests(run)
    if "compare" in only:
        for preset, file_type, layers in COMPARE_MODELS:
            compare(run, f"{preset} {file_type}" + (f" ({layers} layers)" if layers else ""),
                    (preset, file_type, layers))
        if args.real:
            compare(run, "real " + Path(args.real).stem, Path(args.real))
    run.save()
    run.say("\n==== SUMMARY ====")
    for line in run.summary:
        run.say(line)


if __name__ == "__main__":
    main()
