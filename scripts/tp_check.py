"""The tensor-parallel check, run on a CUDA machine (issue 39): what the machine's GPUs allow of it.

On every machine: TP=1 through the tensor-parallel path (the group, NCCL collectives captured in the CUDA graphs)
against the plain engine, greedy tokens and decode tok/s at 1 and 64 sequences; two ranks sharing GPU 0 through
gloo (no graphs) in exact mode against exact TP=1, greedy tokens; and TinyLlama's teacher-forced logits, fast TP=2
(gloo) against fast and exact TP=1. With two GPUs or more also, through `quanta.LLM(tensor_parallel=2)` and
`quanta bench --tensor-parallel`: TP=2 against TP=1 on Llama-2-7B and -13B (synth Q4_K_M), exact greedy tokens,
batch-1 decode and prefill, and the aggregate at 64 sequences.

    OUT=out PYTHONPATH=src python3 scripts/tp_check.py [--only one,gloo,logits,multi]

Log in $OUT/gpu_check.log, every number in $OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import Run, bandwidth, quanta_cli, synth  # noqa: E402

MODELS = (("tinyllama-1.1b", "Q4_K_M"), ("llama-2-7b", "Q4_K_M"))
MULTI_MODELS = (("llama-2-7b", "Q4_K_M"), ("llama-2-13b", "Q4_K_M"))


def prompts(k: int, length: int = 32, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1000, 30000, length)] for _ in range(k)]


def greedy(engine: Any, batch: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt, and the decode tok/s after the first step."""
    from quanta.engine import SamplingParams, StopConditions

    ids = [engine.add_request(p, SamplingParams(temperature=0.0), StopConditions(max_tokens=n, ignore_eos=True))
           for p in batch]
    out: dict[int, list[int]] = {i: [] for i in ids}
    first = None
    while engine.has_unfinished():
        for r in engine.step():
            out[r.request_id].extend(r.new_token_ids)
        first = first or time.perf_counter()
    return [out[i] for i in ids], len(batch) * (n - 1) / (time.perf_counter() - first)


def _engine(model: Any, backend: Any, path: Path, config: Any) -> Any:
    from quanta import gguf
    from quanta.engine import LLMEngine
    from quanta.tokenizer import load_tokenizer

    return LLMEngine(model, backend, load_tokenizer(gguf.open(path)), config, model.n_ctx)


def plain(path: Path, exact: bool, graphs: bool = True, max_seqs: int = 64) -> Any:
    from quanta import gguf
    from quanta.backends.cuda import CUDABackend
    from quanta.engine.config import EngineConfig
    from quanta.models import load_model

    be = CUDABackend("cuda", exact=exact, graphs=graphs)
    return _engine(load_model(gguf.open(path), be, 512), be, path, EngineConfig(max_seqs=max_seqs))


def grouped(path: Path, devices: tuple[str, ...], collectives: str, exact: bool, max_seqs: int = 64) -> tuple:
    from quanta.engine.config import EngineConfig
    from quanta.parallel.launch import GroupSpec, LeadRank

    lead = LeadRank(GroupSpec(str(path), devices, 512, {"exact": exact}, collectives))
    return lead, _engine(lead.model, lead.backend, path, lead.engine_config(EngineConfig(max_seqs=max_seqs)))


def one_rank(run: Run, preset: str, ftype: str) -> None:
    import torch

    path, res = synth(run, preset, ftype), run.results.setdefault(f"{preset}-{ftype}", {})
    one, many = prompts(1), prompts(64, seed=1)
    with run.section(f"{preset} {ftype}: plain vs TP=1 through the group (NCCL, graphs)"):
        speeds = {}
        for name in ("plain", "tp1"):
            lead, e = grouped(path, ("cuda:0",), "nccl", exact=False) if name == "tp1" else (None, plain(path, False))
            try:
                greedy(e, one, 8), greedy(e, many, 8)  # compile, capture
                (t1, s1), (t64, s64) = greedy(e, one, 64), greedy(e, many, 64)
                graphs = e.runner.graphs
                live = sum(g is not None for g in graphs._graphs.values())
                speeds[name] = (t1, s1, t64, s64)
                run.say(f"   {name}: batch 1 {s1:,.0f} tok/s, batch 64 {s64:,.0f} tok/s; graphs {live} of "
                        f"{graphs.captures} recorded")
            finally:
                del e
                if lead is not None:
                    lead.close()
                torch.cuda.empty_cache()
        (a1, p1, a64, p64), (b1, q1, b64, q64) = speeds["plain"], speeds["tp1"]
        same = sum(x == y for x, y in zip(a64, b64))
        run.say(f"   tokens identical: batch 1 {a1 == b1}, batch 64 {same}/64; TP=1 / plain {q1 / p1:.3f} (batch 1), "
                f"{q64 / p64:.3f} (batch 64)")
        res.update(plain_b1=p1, plain_b64=p64, tp1_b1=q1, tp1_b64=q64, same_b64=same)


def gloo_exact(run: Run, preset: str, ftype: str) -> None:
    import torch

    path, few = synth(run, preset, ftype), prompts(4, seed=2)
    with run.section(f"{preset} {ftype}: exact TP=2 sharing GPU 0 (gloo) vs exact TP=1"):
        e = plain(path, exact=True, graphs=False, max_seqs=4)
        want, _ = greedy(e, few, 24)
        del e
        torch.cuda.empty_cache()
        lead, e = grouped(path, ("cuda:0", "cuda:0"), "gloo", exact=True, max_seqs=4)
        try:
            got, speed = greedy(e, few, 24)
        finally:
            del e
            lead.close()
            torch.cuda.empty_cache()
        same = sum(x == y for x, y in zip(want, got))
        run.say(f"   exact greedy, 4 prompts x 24 tokens: identical {same}/4 ({speed:.0f} tok/s through gloo)")
        run.results.setdefault(f"{preset}-{ftype}", {})["exact_tp2_gloo_same"] = same


def _scores(engine: Any, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced logits as one prefill chunk, and as decode rows (a token per forward)."""
    from quanta.engine.block_manager import BlockTable

    table = BlockTable()
    assert engine.blocks.grow(table, len(ids))
    try:
        return engine.runner.score(ids, table.blocks, len(ids)), engine.runner.score(ids, table.blocks, 1)
    finally:
        engine.blocks.free(table)


def logits(run: Run, preset: str = "tinyllama-1.1b", ftype: str = "Q4_K_M") -> None:
    import torch

    path, ids = synth(run, preset, ftype), prompts(1, 128, seed=5)[0]
    with run.section(f"{preset} {ftype}: teacher-forced logits, fast TP=2 (gloo) vs fast TP=1 vs exact TP=1"):
        out = {}
        for name, exact in (("exact1", True), ("fast1", False), ("fast2", False)):
            lead, e = (grouped(path, ("cuda:0", "cuda:0"), "gloo", exact, max_seqs=4) if name == "fast2"
                       else (None, plain(path, exact, graphs=False, max_seqs=4)))
            try:
                out[name] = _scores(e, ids)
            finally:
                del e
                if lead is not None:
                    lead.close()
                torch.cuda.empty_cache()
        for a, b in (("fast2", "fast1"), ("fast1", "exact1"), ("fast2", "exact1")):
            for k, how in enumerate(("prefill", "decode")):
                x, y = out[a][k], out[b][k]
                rel = float(np.abs(x - y).max() / np.abs(y).max())
                top1 = float((x.argmax(1) == y.argmax(1)).mean())
                run.say(f"   {how} {a} vs {b}: max |diff| / max |logit| {rel:.2e}, top-1 agreement {top1:.1%}")
                run.results[f"{preset}-{how}-{a}-{b}"] = {"rel": rel, "top1": top1}


def multi(run: Run, world: int) -> None:
    """TP=``world`` against TP=1 through the public interface (needs ``world`` GPUs)."""
    from quanta import LLM

    for preset, ftype in MULTI_MODELS:
        path, res = synth(run, preset, ftype), run.results.setdefault(f"{preset}-{ftype}-tp{world}", {})
        with run.section(f"{preset} {ftype}: exact greedy tokens, TP={world} vs TP=1"):
            texts = [p[:16] for p in prompts(4, seed=3)]
            tokens = {}
            for tp in (1, world):
                with LLM(str(path), device="cuda", exact=True, n_ctx=256, tensor_parallel=tp) as llm:
                    tokens[tp] = [r.token_ids for r in llm.generate(texts, max_tokens=32, temperature=0.0,
                                                                     ignore_eos=True)]
            same = sum(x == y for x, y in zip(tokens[1], tokens[world]))
            run.say(f"   identical {same}/4")
            res["exact_same"] = same
        for tp in (1, world):
            with run.section(f"{preset} {ftype}: quanta bench, TP={tp}"):
                for args, key in ((["-p", "512", "-n", "128", "--repeats", "3", "--no-cold-start"], "bench"),
                                  (["--concurrency", "1,64", "--prefix-tokens", "0", "--repeats", "2"], "serving")):
                    report = run.out / f"{preset}-tp{tp}-{key}.json"
                    print(quanta_cli("bench", "-m", str(path), "--device", "cuda", "--tensor-parallel", str(tp),
                                     *args, "--json", str(report)))
                    res[f"tp{tp}_{key}"] = json.loads(report.read_text())


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="one,gloo,logits,multi")
    only = ap.parse_args().only.split(",")
    out = Path(os.environ.get("OUT", "tp_out"))
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, Path("/tmp/quanta-tp-check"))
    run.work.mkdir(exist_ok=True)
    with run.section("bandwidth"):
        bandwidth(run)
    for preset, ftype in MODELS:
        if "one" in only:
            one_rank(run, preset, ftype)
        if "gloo" in only:
            gloo_exact(run, preset, ftype)
    if "logits" in only:
        logits(run)
    gpus = torch.cuda.device_count()
    if "multi" in only:
        if gpus >= 2:
            multi(run, 2)
        else:
            run.say(f"== TP=2 across GPUs: skipped, this machine has {gpus} GPU")
    run.save()
    print("\n".join(run.summary))


if __name__ == "__main__":
    main()
