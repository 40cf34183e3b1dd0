"""`quanta bench --concurrency 1,4,16,64`: the batched engine (quanta.engine.LLMEngine) under concurrent requests.

For each concurrency c, c requests with different random prompts of the same length arrive at once and decode
``decode_tokens`` tokens each past end-of-generation, greedily (or sampled at ``temperature`` with the run defaults,
request i seeded with i); the engine steps until all finish. Per c, medians over the repeats: prefill tok/s (prompt
tokens over the time to the last request's first token), aggregate decode tok/s (tokens produced after that moment
over the time after it: every sequence decoding together), per-sequence decode tok/s (the median request's tokens
after its first over the time from its first to its last), and TTFT percentiles over every request of every repeat
(arrival to first token, queueing included). Then the prefix cache: a request whose prompt shares ``prefix_tokens``
tokens with a finished one gets its first token in what fraction of the first one's time. The same prompts on every
engine and run; warm-up runs first (kernels compiled, a CUDA graph captured per batch-size bucket).
``vs="llama.cpp"``: the same bursts through llama.cpp's own parallel decoding (llama_batched.py) after quanta's, on
the CPU. ``constraint`` (one of generate's constraint keywords): each burst runs free, then with every request's
output under that constraint (a request ends early where its grammar is complete); the figures are the constrained
bursts', with the free ones' decode beside them: the masks' cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quanta.bench.engines import require_llama_cpp
from quanta.bench.llama_batched import LlamaCppBatched
from quanta.engine import SamplingParams, StopConditions

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class ServingConfig:
    model: Path
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    device: str = "cpu"
    prompt_tokens: int = 128
    decode_tokens: int = 128
    repeats: int = 3
    threads: int | None = None
    exact: bool = False
    prefix_tokens: int = 1000  # 0: no prefix-cache measurement
    vs: str | None = None  # "llama.cpp": the same bursts through llama.cpp's batched decoding
    cpu_isa: str | None = None
    cuda: dict | None = None  # the CUDA backend's switches, from the CLI's environment
    constraint: dict[str, Any] | None = None  # e.g. {"regex": "..."}: A/B of constrained against free bursts
    tensor_parallel: int = 1  # GPUs the model is split over (quanta.parallel)
    temperature: float = 0.0  # > 0: each token sampled (top-k, top-p, min-p as SamplingParams' defaults)


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """Random ids from the middle of the vocabulary (no specials); every prompt different from its first token."""
    rng = np.random.default_rng(seed)
    lo, hi = min(1000, vocab // 4), vocab - vocab // 8
    return [[int(t) for t in rng.integers(lo, hi, length)] for _ in range(n)]


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def run_burst(engine: Any, prompts: list[list[int]], decode_tokens: int,
              constraint: Callable[[], Any] | None = None, temperature: float = 0.0) -> dict[str, Any]:
    """All ``prompts`` added at once, stepped to the end: the burst's figures and each request's TTFT;
    ``constraint`` makes each request's Constraint; ``temperature`` > 0 samples (request i with seed i)."""
    stop = StopConditions(max_tokens=decode_tokens, ignore_eos=True)
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    params = [SamplingParams(temperature=temperature, seed=i) if temperature else GREEDY for i in range(len(prompts))]
    ids = [engine.add_request(p, sp, stop, constraint() if constraint else None) for p, sp in zip(prompts, params)]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    counts = {i: 0 for i in ids}
    after_all_first = 0  # tokens produced in steps after every request had its first
    t_all_first = None
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            if not o.new_token_ids:
                continue
            counts[o.request_id] += len(o.new_token_ids)
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            if t_all_first is not None:
                after_all_first += len(o.new_token_ids)
        if t_all_first is None and len(first) == len(ids):
            t_all_first = now
    t_end = time.perf_counter()
    for i in ids:
        engine.release(i)
    assert t_all_first is not None and all(c == decode_tokens or constraint and 0 < c < decode_tokens
                                           for c in counts.values()), counts
    per_seq = [(counts[i] - 1) / (last[i] - first[i]) for i in ids if counts[i] > 1 and last[i] > first[i]]
    return {"prefill_tok_s": sum(map(len, prompts)) / (t_all_first - t0),
            "decode_tok_s": after_all_first / (t_end - t_all_first) if t_end > t_all_first else float("nan"),
            "per_seq_decode_tok_s": statistics.median(per_seq) if per_seq else float("nan"),
            "total_s": t_end - t0, "steps": steps, "ttft_s": [first[i] - t0 for i in ids],
            "tokens_per_seq": sum(counts.values()) / len(ids)}


def constrained_burst(engine: Any, constraint: dict[str, Any],
                      temperature: float = 0.0) -> Callable[[list[list[int]], int], dict[str, Any]]:
    """A burst run free, then under ``constraint``: the constrained figures, and the free decode as
    ``free_decode_tok_s`` / ``free_per_seq_decode_tok_s``."""
    from quanta.engine.constraint import Constraint, Grammar, ll_tokenizer

    grammar = Grammar.from_keywords(constraint)
    vocabulary = ll_tokenizer(engine.tokenizer, engine.model.n_vocab)

    def burst(prompts: list[list[int]], n: int) -> dict[str, Any]:
        free = run_burst(engine, prompts, n, temperature=temperature)
        bound = run_burst(engine, prompts, n, lambda: Constraint(grammar, vocabulary), temperature)
        return bound | {f"free_{k}": free[k] for k in ("decode_tok_s", "per_seq_decode_tok_s")}
    return burst


def _ttft(engine: Any, prompt: list[int]) -> tuple[float, int]:
    """One request alone: seconds to its first token, and its prompt tokens served from the prefix cache. It
    decodes a second token (a request's prompt blocks join the cache once a step of it has completed)."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, GREEDY, StopConditions(max_tokens=2, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        if any(o.new_token_ids for o in engine.step()) and first is None:
            first = time.perf_counter() - t0
    seq = engine.release(rid)
    assert first is not None, "the request produced no token"
    return first, seq.stats.cached_tokens


def prefix_cache_ttft(engine: Any, vocab: int, prefix_tokens: int) -> dict[str, Any]:
    """TTFT of a request (prefix + 16 tokens) on an empty cache, then of a second one sharing the prefix (after a
    warm-up request of the same length, so neither pays for compiling)."""
    shared = _prompts(vocab, 1, prefix_tokens, seed=7)[0]
    warm, *tails = _prompts(vocab, 3, 16, seed=8)
    _ttft(engine, _prompts(vocab, 1, prefix_tokens, seed=9)[0] + warm)
    engine.reset_prefix_cache()
    (t_first, c_first), (t_shared, c_shared) = (_ttft(engine, shared + tail) for tail in tails)
    return {"prefix_tokens": prefix_tokens, "first_ttft_ms": 1e3 * t_first, "shared_ttft_ms": 1e3 * t_shared,
            "ratio": t_shared / t_first, "cached_tokens": [c_first, c_shared]}


def _measure(burst: Any, cfg: ServingConfig, vocab: int, name: str, progress: bool) -> list[dict[str, Any]]:
    """Warm-up bursts, then ``cfg.repeats`` bursts per concurrency through ``burst(prompts, decode_tokens)``."""
    for c in sorted(cfg.concurrency):  # warm-up: compiles, and captures the graphs of each batch size
        burst(_prompts(vocab, c, cfg.prompt_tokens, seed=100 + c), min(cfg.decode_tokens, 8))
    rows = []
    for c in cfg.concurrency:
        bursts = []
        for r in range(cfg.repeats):
            bursts.append(burst(_prompts(vocab, c, cfg.prompt_tokens, seed=1000 * r + c), cfg.decode_tokens))
            if progress:
                print(f"{name}, concurrency {c}, repeat {r + 1}: {bursts[-1]['decode_tok_s']:,.0f} decode tok/s",
                      flush=True)
        ttft = [t for b in bursts for t in b["ttft_s"]]
        row: dict[str, Any] = {"concurrency": c}
        for key in ("prefill_tok_s", "decode_tok_s", "per_seq_decode_tok_s", "total_s", "tokens_per_seq",
                    "free_decode_tok_s", "free_per_seq_decode_tok_s"):
            if key not in bursts[0]:
                continue
            values = [b[key] for b in bursts]
            row[key] = statistics.median(values)
            row[f"{key}_spread"] = {"min": min(values), "max": max(values)}
        row["steps"] = bursts[0]["steps"]
        row.update({f"ttft_ms_p{q}": 1e3 * _percentile(ttft, q) for q in (50, 90, 99)})
        rows.append(row)
    return rows


def run_serving(cfg: ServingConfig, *, progress: bool = False) -> dict[str, Any]:
    """Measure every concurrency of ``cfg``; returns the report (the --json document)."""
    from quanta import LLM

    if cfg.vs is not None:
        if cfg.constraint or cfg.temperature:
            raise ValueError("--vs llama.cpp runs its bursts free and greedy: measure a constraint or a temperature "
                             "without --vs")
        if cfg.device != "cpu":
            raise ValueError("--concurrency --vs llama.cpp compares on the CPU (the llama.cpp here is a CPU build)")
        require_llama_cpp()  # before quanta loads: a missing peer is the first thing said
    top = max(cfg.concurrency)
    n_ctx = max(cfg.prompt_tokens + cfg.decode_tokens, cfg.prefix_tokens + 17) + 16
    llm = LLM(cfg.model, device=cfg.device, threads=cfg.threads, exact=cfg.exact, cpu_isa=cfg.cpu_isa, cuda=cfg.cuda,
              n_ctx=n_ctx, max_seqs=top, tensor_parallel=cfg.tensor_parallel)
    engine, vocab = llm.engine, llm.config.vocab_size
    report: dict[str, Any] = {"model": str(cfg.model), "device": cfg.device, "config": asdict(cfg) | {
        "model": str(cfg.model)}, "n_ctx": n_ctx, "kv_blocks": engine.runner.n_blocks,
        "block_size": engine.config.block_size}
    report["config"]["concurrency"] = list(cfg.concurrency)
    if cfg.device == "cuda":
        import torch

        report["device_name"] = torch.cuda.get_device_name()
    burst = (constrained_burst(engine, cfg.constraint, cfg.temperature) if cfg.constraint
             else lambda prompts, n: run_burst(engine, prompts, n, temperature=cfg.temperature))
    report["runs"] = _measure(burst, cfg, vocab, "quanta", progress)
    if cfg.prefix_tokens:
        report["prefix_cache"] = prefix_cache_ttft(engine, vocab, cfg.prefix_tokens)
    llm.close()
    if cfg.vs is not None:
        peer = LlamaCppBatched(cfg.model, threads=cfg.threads or 1, max_seqs=top,
                               n_ctx_per_seq=cfg.prompt_tokens + cfg.decode_tokens + 16)
        try:
            report["peer"] = {"name": peer.name, "runs": _measure(peer.run_burst, cfg, vocab, peer.name, progress)}
        finally:
            peer.close()
    return report


def format_serving(report: dict[str, Any]) -> str:
    where = f"{report['device']} ({report['device_name']})" if "device_name" in report else report["device"]
    c = report["config"]
    sampling = f"sampled at temperature {c['temperature']:g}" if c.get("temperature") else "greedy"
    lines = [f"model {report['model']} · {where} · p={c['prompt_tokens']} n={c['decode_tokens']} {sampling} · "
             f"{c['repeats']} repeats · median · KV pool {report['kv_blocks']:,} blocks of {report['block_size']}",
             "",
             f"{'concurrency':>11} {'decode tok/s':>13} {'per seq':>9} {'prefill tok/s':>14} "
             f"{'TTFT p50 ms':>12} {'p90':>9} {'p99':>9} {'steps':>6}"]
    for r in report["runs"]:
        lines.append(f"{r['concurrency']:>11} {r['decode_tok_s']:>13,.0f} {r['per_seq_decode_tok_s']:>9,.1f} "
                     f"{r['prefill_tok_s']:>14,.0f} {r['ttft_ms_p50']:>12,.1f} {r['ttft_ms_p90']:>9,.1f} "
                     f"{r['ttft_ms_p99']:>9,.1f} {r['steps']:>6}")
    if c.get("constraint"):
        (kind, value), = c["constraint"].items()
        lines += ["", f"under the {kind} constraint ({str(value)[:60]}), against the same bursts free:",
                  f"{'concurrency':>11} {'tokens/seq':>11} {'decode tok/s':>13} {'free':>9} {'ratio':>7} "
                  f"{'per seq':>9} {'free':>9} {'ratio':>7}"]
        for r in report["runs"]:
            lines.append(f"{r['concurrency']:>11} {r['tokens_per_seq']:>11.1f} {r['decode_tok_s']:>13,.0f} "
                         f"{r['free_decode_tok_s']:>9,.0f} {r['decode_tok_s'] / r['free_decode_tok_s']:>7.3f} "
                         f"{r['per_seq_decode_tok_s']:>9,.1f} {r['free_per_seq_decode_tok_s']:>9,.1f} "
                         f"{r['per_seq_decode_tok_s'] / r['free_per_seq_decode_tok_s']:>7.3f}")
    if "peer" in report:
        name = report["peer"]["name"]
        lines += ["", f"{name}, the same bursts through its batched decoding:",
                  f"{'concurrency':>11} {'decode tok/s':>13} {'per seq':>9} {'prefill tok/s':>14} "
                  f"{'TTFT p50 ms':>12} {'quanta/' + name + ' decode':>24}"]
        for r, mine in zip(report["peer"]["runs"], report["runs"]):
            lines.append(f"{r['concurrency']:>11} {r['decode_tok_s']:>13,.0f} {r['per_seq_decode_tok_s']:>9,.1f} "
                         f"{r['prefill_tok_s']:>14,.0f} {r['ttft_ms_p50']:>12,.1f} "
                         f"{mine['decode_tok_s'] / r['decode_tok_s']:>23.2f}x")
    if "prefix_cache" in report:
        p = report["prefix_cache"]
        lines += ["", f"prefix cache: TTFT {p['first_ttft_ms']:.1f} ms → {p['shared_ttft_ms']:.1f} ms sharing a "
                      f"{p['prefix_tokens']:,}-token prefix ({100 * p['ratio']:.1f}%)"]
    return "\n".join(lines)


def plot_serving(report: dict[str, Any], path: str | Path) -> None:
    """Aggregate and per-sequence decode tok/s, and TTFT p50/p99, against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    cs = [r["concurrency"] for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(cs, [r["decode_tok_s"] for r in runs], "o-", label="aggregate")
    ax1.plot(cs, [r["per_seq_decode_tok_s"] for r in runs], "s--", label="per sequence")
    if "peer" in report:
        peer = report["peer"]
        ax1.plot(cs, [r["decode_tok_s"] for r in peer["runs"]], "^:", label=f"{peer['name']} aggregate")
    ax1.set(xscale="log", yscale="log", xlabel="concurrent sequences", ylabel="decode tok/s", title="decode")
    ax1.legend()
    for q in (50, 99):
        ax2.plot(cs, [r[f"ttft_ms_p{q}"] for r in runs], "o-", label=f"p{q}")
    ax2.set(xscale="log", yscale="log", xlabel="concurrent sequences", ylabel="ms", title="time to first token")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
