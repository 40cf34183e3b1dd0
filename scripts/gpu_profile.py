"""Nsight Compute profile of quanta's decode steps on a CUDA machine: per kernel, its time, DRAM bytes and
throughput, occupancy, issue-slot use and where its warps stall (issue 38: what bounds each kernel).

    PYTHONPATH=src python3 scripts/gpu_profile.py --model llama-2-7b:Q4_K_M:8 --out $OUT  # preset:type[:layers]
                                                                      # (synthesized), or a GGUF path
    PYTHONPATH=src python3 scripts/gpu_profile.py --model smollm2-135m:Q4_1 --seqs 4 --out $OUT  # 4 rows a step

The model decodes greedily in a process of its own under `ncu --profile-from-start off --clock-control none`;
the profiler is on for ``--steps`` decode steps after ``--warm`` (graphs captured, caches warm). ncu replays each
kernel alone, so a kernel's time here has no PDL overlap with its neighbours. Writes the raw CSV (ncu_raw.csv)
and a table summed by kernel name (profile.txt), printed too.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats", "MemoryWorkloadAnalysis")
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio")
COLUMNS = {"time_us": "gpu__time_duration.sum", "dram_tb_s": "dram__bytes.sum.per_second",
           "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
           "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
           "issue_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "grid": "launch__grid_size", "block": "launch__block_size", "regs": "launch__registers_per_thread"}


def target(model: str, warm: int, steps: int, seqs: int) -> None:
    """The profiled process: greedy decode of ``seqs`` sequences together, the profiler on for ``steps`` steps after
    ``warm``."""
    import torch

    from quanta import LLM
    from quanta.engine.sampler import SamplingParams
    from quanta.engine.stop import StopConditions

    llm = LLM(model, device="cuda", n_ctx=512, max_seqs=seqs)
    prompts = [list(range(1000 + 10 * s, 1008 + 10 * s)) for s in range(seqs)]
    llm.generate(prompts, max_tokens=warm + steps, temperature=0, ignore_eos=True)  # graphs captured
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0), StopConditions(max_tokens=warm + steps + 1,
                                                                                 ignore_eos=True))
    for i in range(warm + steps + 1):
        if i == warm:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        elif i == warm + steps:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        engine.step()
    llm.close()


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def summarize(raw_csv: str, steps: int) -> str:
    """Per kernel name: launches, time per step, DRAM MB per step and GB/s, the medians of the ratios, top stalls
    (``steps``: the decode steps profiled, where no embedding kernel counts them)."""
    rows = list(csv.reader(io.StringIO(raw_csv[raw_csv.index('"ID"'):])))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    scale = {"dram_tb_s": {"Gbyte/s": 1e-3, "Tbyte/s": 1.0}, "time_us": {"nsecond": 1e-3, "usecond": 1.0,
                                                                         "msecond": 1e3}}
    kernels: dict[str, list[dict[str, float]]] = defaultdict(list)
    for r in data:
        name = r[col["Kernel Name"]].split("(")[0]
        v = {}
        for key, metric in COLUMNS.items():
            if metric in col:
                v[key] = _number(r[col[metric]]) * scale.get(key, {}).get(units[col[metric]], 1.0)
        v["dram_mb"] = v.get("dram_tb_s", 0.0) * v.get("time_us", 0.0)  # TB/s x us = MB
        v["stalls"] = {m.group(1): _number(r[i]) for i, h in enumerate(header) if (m := STALL.fullmatch(h))}
        kernels[name].append(v)
    steps = len(kernels.get("_embed_kernel", [])) or steps  # one embedding per decode step
    total = sum(v.get("time_us", 0) for vs in kernels.values() for v in vs) / steps
    lines = [f"{steps} decode steps, {sum(map(len, kernels.values()))} kernels, {total:.1f} us per step of kernel "
             "time (each kernel replayed alone)",
             f"{'kernel':<34}{'n/step':>7}{'us/step':>9}{'share':>7}{'MB/step':>9}{'GB/s':>7}{'dram%':>6}"
             f"{'occ%':>6}{'issue%':>7}{'regs':>5}{'grid':>7}{'blk':>5}  top stalls (cycles per issue)"]
    for name, vs in sorted(kernels.items(), key=lambda kv: -sum(v.get("time_us", 0) for v in kv[1])):
        def med(key: str) -> float:
            xs = sorted(v.get(key, float("nan")) for v in vs)
            return xs[len(xs) // 2]
        t = sum(v.get("time_us", 0) for v in vs) / steps
        mb = sum(v.get("dram_mb", 0) for v in vs) / steps
        stalls: dict[str, float] = defaultdict(float)
        for v in vs:
            for k, x in v["stalls"].items():
                stalls[k] += x / len(vs)
        top = ", ".join(f"{k} {x:.1f}" for k, x in sorted(stalls.items(), key=lambda kx: -kx[1])[:4])
        lines.append(f"{name[:33]:<34}{len(vs) / steps:>7.1f}{t:>9.1f}{t / total:>7.1%}{mb:>9.1f}"
                     f"{mb / t * 1e3 if t else 0:>7.0f}{med('dram_pct'):>6.0f}{med('occupancy_pct'):>6.0f}"
                     f"{med('issue_pct'):>7.0f}{med('regs'):>5.0f}{med('grid'):>7.0f}{med('block'):>5.0f}  {top}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b:Q4_K_M",
                    help="a GGUF path, or preset:type[:layers] for `quanta synth`")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    ap.add_argument("--warm", type=int, default=8, help="decode steps before the profiler starts")
    ap.add_argument("--steps", type=int, default=2, help="decode steps profiled")
    ap.add_argument("--seqs", type=int, default=1, help="sequences decoded together (rows of each step)")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.target:
        return target(args.model, args.warm, args.steps, args.seqs)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not Path(model).exists():
        preset, file_type, *layers = model.split(":")
        model = f"/tmp/quanta_gpu/{preset}-{file_type}{'-' + layers[0] + 'l' if layers else ''}.gguf"
        if not Path(model).exists():
            Path(model).parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "quanta", "synth", preset, model, "--type", file_type,
                            *(["--layers", layers[0]] if layers else [])], check=True)
    report = Path("/tmp/quanta_gpu/decode")
    sections = [a for s in SECTIONS for a in ("--section", s)]
    subprocess.run(["ncu", "--profile-from-start", "off", "--clock-control", "none", *sections, "-f", "-o",
                    str(report), sys.executable, __file__, "--target", "--model", model, "--warm", str(args.warm),
                    "--steps", str(args.steps), "--seqs", str(args.seqs)], check=True)
    raw = subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--page", "raw", "--csv"], check=True,
                         capture_output=True, text=True).stdout
    (args.out / "ncu_raw.csv").write_text(raw)
    table = summarize(raw, args.steps)
    (args.out / "profile.txt").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
