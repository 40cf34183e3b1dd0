"""The GPU check harness, run on a CUDA machine: the CUDA tests, GPU against CPU exact mode on synthetic (and a
real) model, and `quanta bench --device cuda` on the three benchmark shapes (docs/PERF.md's GPU table).

Everything goes through quanta's public interface: the `quanta synth` and `quanta bench` verbs (one process each:
a process that has run torch's profiler, as the bench's breakdown does, decodes slower afterwards) and `quanta.LLM`.

    OUT=gpu_out scripts/gpu_check.sh [--only tests,compare,bench,deep] [--real MODEL.gguf]

Log in $OUT/gpu_check.log, every number (the bench's whole --json reports too) in $OUT/gpu_check.json, the
CUDA tests' output in $OUT/gpu_tests.txt; the summary is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# the shapes of docs/PERF.md's GPU table: (synth preset, file type)
BENCH_MODELS = (("tinyllama-1.1b", "Q4_K_M"), ("llama-3.2-1b", "Q4_K_M"), ("qwen2.5-1.5b", "Q4_0"))
# GPU vs CPU exact: one model per architecture and the 4-, 5- and 6-bit layouts; (preset, type, layers or None)
COMPARE_MODELS = (("smollm2-135m", "Q4_1", None), ("qwen2.5-0.5b", "Q4_0", 8), ("gemma3-270m", "Q4_K_M", None),
                  ("llama-3.2-1b", "Q5_K_M", 4))
# section → the bench invocations it makes per model: (flags, label)
BENCH_RUNS = {"bench": [(["-p", "8", "-n", "128", "--depth", "1024", "--repeats", "5"], "decode"),
                        (["-p", "512", "-n", "8", "--repeats", "5"], "prefill")],
              "deep": [(["-p", "8", "-n", "128", "--depth", "4096", "--repeats", "3"], "depth4096")]}
PROSE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a "
         "screw press with movable metal type and an oil-based ink. Within fifty years, presses were running in more "
         "than two hundred cities across Europe, and the cost of a book fell so far that ordinary merchants could own "
         "several. Scholars argue about how quickly literacy followed, but most agree that cheap pamphlets spread new "
         "ideas faster than any earlier technology. Religious reformers, scientists and poets all used the press to "
         "reach readers they would never meet, and governments soon learned to license printers and censor what they "
         "produced.")


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


def quanta_cli(*args: str, timeout_s: int = 600) -> str:
    """One `quanta` command in its own process; its stdout (stderr too when it fails)."""
    p = subprocess.run([sys.executable, "-m", "quanta", *args], capture_output=True, text=True, timeout=timeout_s)
    if p.returncode:
        raise RuntimeError(f"quanta {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr[-4000:]}")
    return p.stdout


def synth(run: Run, preset: str, file_type: str, layers: int | None = None) -> Path:
    """A random-weight model of the preset's real shapes (`quanta synth`), written once per machine."""
    path = run.work / f"{preset}-{file_type}{f'-{layers}l' if layers else ''}.gguf"
    if not path.exists():
        quanta_cli("synth", preset, str(path), "--type", file_type, *(["--layers", str(layers)] if layers else []))
    return path


def gpu_tests(run: Run, path: str = "tests/backends/cuda", timeout_s: int = 540) -> None:
    """The CUDA tests on the GPU (those needing gguf-py skip where it is missing: gpu_check.sh says how to send it)."""
    with run.section(f"pytest {path}"):
        cmd = [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider", "-rfs"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            out = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() + f"\nTIMEOUT after {timeout_s} s"
        (run.out / "gpu_tests.txt").write_text(out)
        last = out.strip().splitlines()[-1] if out.strip() else "no output"
        run.say("  ", last)
        run.summary.append(f"GPU tests: {last}")


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    lg = logits[:-1].astype(np.float64)
    top = lg.max(axis=1)
    log_z = np.log(np.exp(lg - top[:, None]).sum(axis=1)) + top
    return float(np.exp(np.mean(log_z - lg[np.arange(len(ids) - 1), ids[1:]])))


def compare(run: Run, name: str, model: Path | tuple[str, str, int | None], n_tokens: int = 32) -> None:
    """GPU exact mode against CPU exact mode (greedy continuations, teacher-forced logits), and the GPU default
    mode's top-1 and perplexity against CPU exact mode; ``model``: a file, or a synth (preset, type, layers)."""
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
                prompts = [rng.integers(5, min(vocab, 30000), size=n).tolist() for n in (7, 16)]
                tokens[label] = [llm.generate(p, max_tokens=n_tokens, temperature=0.0, ignore_eos=True).token_ids
                                 for p in prompts]
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
        run.summary.append(f"{name:28s} exact: greedy {row['greedy_equal']} equal, top-1 {row['top1']:.3f}, "
                           f"ppl {100 * row['ppl_rel']:.3f}%, max logit diff {row['max_logit_diff']:.1e}; "
                           f"default mode: top-1 {row['top1_fast']:.3f}, ppl {100 * row['ppl_rel_fast']:+.2f}%")


def bench(run: Run, preset: str, file_type: str, runs: list[tuple[list[str], str]]) -> None:
    """`quanta bench --device cuda` with each run's flags; its report (the --json document) kept whole."""
    name = f"{preset} {file_type}"
    for flags, label in runs:
        with run.section(f"quanta bench {name} ({label})"):
            path = synth(run, preset, file_type)
            report_path = run.work / "bench.json"
            table = quanta_cli("bench", "-m", str(path), "--device", "cuda", "--no-cold-start", *flags,
                               "--json", str(report_path))
            run.say(table)
            r = json.loads(report_path.read_text())
            run.results.setdefault("bench", []).append({"model": name, "run": label, "flags": flags, **r})
            line = (f"{name:24s} {label:9s} `quanta bench --device cuda {' '.join(flags)}`: decode "
                    f"{r['decode_tok_s']:,.0f} tok/s ({r['roofline_pct']:.1f}% of {r['bandwidth_gb_s'] / 1e3:.2f} "
                    f"TB/s, {r['bytes_per_token'] / 1e6:.0f} MB/token), prefill-{r['prompt_tokens']} "
                    f"{r['prefill_tok_s']:,.0f} tok/s")
            if "depth_decode_tok_s" in r:
                line += (f", @ depth {r['depth']} {r['depth_decode_tok_s']:,.0f} "
                         f"({100 * r['depth_decode_tok_s'] / r['decode_tok_s']:.1f}%)")
            run.summary.append(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="tests,compare,bench", help="sections: tests, compare, bench, deep "
                    "(the bench at depth 4,096)")
    ap.add_argument("--real", default="", help="a real GGUF to compare too (e.g. SmolLM2)")
    ap.add_argument("--out", type=Path, default=Path("gpu_out"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/quanta_gpu"), help="where synthetic models are kept")
    args = ap.parse_args()
    only = set(args.only.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.work)
    import torch

    run.say(f"torch {torch.__version__}, triton {__import__('triton').__version__}, {torch.cuda.get_device_name()}")
    if "tests" in only:
        gpu_tests(run)
    if "bench" in only or "deep" in only:  # before the CPU-heavy comparisons, for short device budgets
        runs = [r for section, section_runs in BENCH_RUNS.items() if section in only for r in section_runs]
        for preset, file_type in BENCH_MODELS:
            bench(run, preset, file_type, runs)
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
