"""`quanta bench`: prefill/decode speed, roofline and per-op breakdown, optionally against llama.cpp."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from quanta.cli.run import add_constraint_options, output_constraint


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="model path or known name (default: smollm2-135m)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where quanta runs (default auto: cuda where an NVIDIA GPU and torch with CUDA are found)")
    p.add_argument("-p", "--prompt-tokens", type=int, default=512, help="prompt length for prefill/TTFT (512)")
    p.add_argument("-n", "--decode-tokens", type=int, default=128, help="tokens to decode per run (128)")
    p.add_argument("--depth", type=int, default=0, help="also measure decode after this many tokens of context")
    p.add_argument("--repeats", type=int, default=5, help="runs per engine; figures are medians (5)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: available cores)")
    p.add_argument("--vs", choices=("llama.cpp",), default=None, help="measure llama.cpp side by side")
    p.add_argument("--exact", action="store_true", help="quanta's exact fp32 mode instead of the fast mode")
    p.add_argument("--kv-type", choices=("auto", "f32", "f16", "q8"), default="auto",
                   help="how quanta's KV cache stores keys and values (see `quanta run --help`)")
    p.add_argument("--cpu-isa", choices=("avx2", "avx_vnni", "avx512_vnni"), default=None,
                   help="force the CPU backend's int8 kernels onto one instruction set (default: the fastest)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N GPUs of this host (default 1; then no cold start and no per-kernel "
                        "breakdown, which time one process)")
    p.add_argument("--busy-cores", type=int, default=0, metavar="N",
                   help="keep N cores busy with competing processes during the whole run (a shared machine)")
    p.add_argument("--no-cold-start", action="store_true", help="skip the process-start → first-token runs")
    p.add_argument("--empty-kernel-cache", action="store_true",
                   help="also time quanta's cold start with an empty Triton kernel cache, as on a machine's first "
                        "run (--device cuda)")
    p.add_argument("--concurrency", metavar="C,C,...", default=None,
                   help="instead: the batched engine with C concurrent requests each (quanta.bench.serving)")
    p.add_argument("--prefix-tokens", type=int, default=1000, metavar="N",
                   help="with --concurrency: also the TTFT of a request sharing an N-token prefix (0: skip)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="with --concurrency: sample each token at temperature T (top-k 40, top-p 0.95, min-p 0.05, "
                        "as `quanta run`; request i seeded with i) instead of greedy")
    p.add_argument("--speculative", choices=("ngram",), default=None,
                   help="instead: speculative decoding against plain decoding on three prompt sets, A/B "
                        "(quanta.bench.speculative; needs an instruct model)")
    add_constraint_options(p, "with --concurrency, A/B against no constraint: each request's output")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the roofline chart and per-op bars")


def run(args: argparse.Namespace) -> int:
    from quanta import prepare_cpu_runtime
    from quanta.backends import resolve_device
    from quanta.bench.report import format_table, plot
    from quanta.bench.runner import BenchConfig, run_bench
    from quanta.hub import resolve_model

    for name in ("prompt_tokens", "decode_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.depth < 0:
        raise ValueError("--depth must be 0 or more")
    if args.busy_cores < 0:
        raise ValueError("--busy-cores must be 0 or more")
    if not 0 <= args.temperature <= 1e4 or (args.temperature and args.concurrency is None):
        raise ValueError("--temperature takes a number from 0 to 10000 and measures the batched engine: add "
                         "--concurrency")
    if args.empty_kernel_cache and (args.no_cold_start or args.tensor_parallel > 1):
        raise ValueError("--empty-kernel-cache times a cold start: leave out --no-cold-start and --tensor-parallel")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib, which is not installed: run `make bench-deps`")
    prepare_cpu_runtime()  # before the bandwidth probe loads numba's OpenMP layer
    threads = args.threads or len(os.sched_getaffinity(0))
    if output_constraint(args) and args.concurrency is None:
        raise ValueError("--json-schema, --regex and --grammar measure the batched engine: add --concurrency")
    if args.concurrency is not None:
        return _serving(args, threads)
    if args.speculative is not None:
        return _speculative(args, threads)
    cfg = BenchConfig(model=resolve_model(args.model, home=args.home), device=resolve_device(args.device),
                      prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, depth=args.depth,
                      repeats=args.repeats, threads=threads, vs=args.vs, exact=args.exact,
                      cold_start=not args.no_cold_start and args.tensor_parallel == 1,
                      breakdown=args.tensor_parallel == 1, busy_cores=args.busy_cores,
                      cpu_isa=args.cpu_isa, cuda=args.cuda, kv_type=args.kv_type,
                      tensor_parallel=args.tensor_parallel, empty_kernel_cache=args.empty_kernel_cache)
    if args.empty_kernel_cache and cfg.device != "cuda":
        raise ValueError("--empty-kernel-cache times the CUDA backend's kernel compiles: add --device cuda")
    return _report(run_bench(cfg, progress=sys.stderr.isatty()), args, format_table, plot)


def _report(report: dict, args: argparse.Namespace, fmt: Callable, plot: Callable | None) -> int:
    """Print the report's table; write it as JSON (``--json``) and draw its plot (``--plot``) where asked."""
    print(fmt(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot and plot is not None:
        plot(report, args.plot)
    return 0


def _serving(args: argparse.Namespace, threads: int) -> int:
    from quanta.backends import resolve_device
    from quanta.bench.serving import ServingConfig, format_serving, plot_serving, run_serving
    from quanta.hub import resolve_model

    try:
        levels = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        raise ValueError(f"--concurrency takes comma-separated counts (1,4,16,64), not {args.concurrency!r}") from None
    if not levels or min(levels) < 1 or args.prefix_tokens < 0:
        raise ValueError("--concurrency counts must be at least 1, --prefix-tokens 0 or more")
    report = run_serving(ServingConfig(model=resolve_model(args.model, home=args.home), concurrency=levels,
                                       device=resolve_device(args.device),
                                       prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                                       repeats=args.repeats, threads=threads, exact=args.exact,
                                       prefix_tokens=args.prefix_tokens, vs=args.vs, cpu_isa=args.cpu_isa,
                                       cuda=args.cuda, constraint=output_constraint(args) or None,
                                       tensor_parallel=args.tensor_parallel, temperature=args.temperature),
                         progress=sys.stderr.isatty())
    return _report(report, args, format_serving, plot_serving)


def _speculative(args: argparse.Namespace, threads: int) -> int:
    from quanta.backends import resolve_device
    from quanta.bench.speculative import SpeculativeBenchConfig, format_speculative, run_speculative
    from quanta.hub import resolve_model

    report = run_speculative(SpeculativeBenchConfig(model=resolve_model(args.model, home=args.home),
                                                    device=resolve_device(args.device),
                                                    decode_tokens=args.decode_tokens, repeats=args.repeats,
                                                    threads=threads, exact=args.exact))
    return _report(report, args, format_speculative, None)
