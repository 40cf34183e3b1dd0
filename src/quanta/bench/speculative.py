"""`quanta bench --speculative ngram`: n-gram speculative decoding against plain decoding, A/B in one process.

Three prompt sets of eight chat prompts each: repetitive or grounded output (repeat a list, summarise a given text,
edit a given snippet), prose, and code from scratch. Each prompt is decoded greedily by the same model twice per
repeat, with and without speculation, alternating, each time up to the model's end of turn (as a user's request
ends; at most ``decode_tokens``: what a chat model writes after its end of turn is a made-up next conversation, not
the answer the set is about); greedy speculation is lossless, so both produce the same tokens
(on a GPU up to rounding at near-ties) and the ratio of their decode times is the speed-up. The first set runs one
more repeat first, not timed: it warms both engines up (kernel compiles, and on a GPU the decode graphs of the
verify steps' row counts). Per set: the speed-up of the summed decode times (median over repeats), the drafts'
acceptance rate, the tokens each verify step yields, and the verify step's cost a + b*k in plain steps as the gate
has measured it so far (``quanta.engine.step_cost``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quanta.engine import SamplingParams, StopConditions
from quanta.engine.speculation import SpeculativeConfig

_TEXT = ("The river town grew around a ferry crossing. Merchants built warehouses on the east bank, the mill stood on "
         "the west bank, and a stone bridge replaced the ferry in 1842. The bridge brought rail traffic, and the "
         "population doubled within twenty years.")
_CODE = "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n"
PROMPT_SETS: dict[str, list[str]] = {
    "repetitive": [
        "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, grape, honeydew.",
        f"Summarise this text in two sentences, reusing its wording: {_TEXT}",
        f"Rename the function to average and keep everything else the same:\n{_CODE}",
        f"Add a docstring to this function and return the whole function:\n{_CODE}",
        "Copy this sentence three times: The quick brown fox jumps over the lazy dog.",
        f"Rewrite this text, replacing 'bridge' with 'viaduct': {_TEXT}",
        "Write the numbers from 1 to 40, separated by commas.",
        f"Add type hints to this function and return it:\n{_CODE}",
    ],
    "prose": [
        "Write a short story about a lighthouse keeper.", "Describe a walk through a forest in autumn.",
        "Explain why the sky is blue to a child.", "Write a letter to a friend about a trip to the sea.",
        "Describe your ideal weekend.", "Explain how bread is made.",
        "Write a short essay on the value of libraries.", "Describe a busy market in the morning.",
    ],
    "code": [
        "Write a Python function that checks whether a string is a palindrome.",
        "Write a Python class for a stack with push, pop and peek.",
        "Write a Python function that merges two sorted lists.",
        "Write a Python function that counts the words in a text file.",
        "Write a JavaScript function that debounces another function.",
        "Write a Python function for binary search.", "Write a SQL query that finds duplicate emails in a table.",
        "Write a Python function that flattens a nested list.",
    ],
}


@dataclass(frozen=True)
class SpeculativeBenchConfig:
    model: Path
    device: str = "cpu"
    decode_tokens: int = 128
    repeats: int = 3
    threads: int | None = None
    exact: bool = False


def _decode(llm: Any, prompt: list[int], n: int, stats: list) -> tuple[list[int], float]:
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0), StopConditions(max_tokens=n))
    while engine.has_unfinished():
        engine.step()
    seq = engine.release(rid)
    stats.append(seq.stats)
    return seq.generated_ids, seq.stats.decode_s


def run_speculative(cfg: SpeculativeBenchConfig) -> dict[str, Any]:
    """Measure every prompt set (see the module note); returns the report."""
    from quanta import LLM

    kw = dict(device=cfg.device, threads=cfg.threads, exact=cfg.exact, n_ctx=1024, max_seqs=1)
    plain = LLM(cfg.model, **kw)
    spec = LLM(cfg.model, speculative="ngram", **kw)
    report: dict[str, Any] = {"model": str(cfg.model), "device": cfg.device, "decode_tokens": cfg.decode_tokens,
                              "repeats": cfg.repeats, "speculative": SpeculativeConfig().__dict__, "sets": {}}
    first = next(iter(PROMPT_SETS))  # its first repeat warms both engines up (compiles, graph captures) untimed
    for name, prompts in PROMPT_SETS.items():
        ids = [plain.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
        ratios, same, spec_stats, lengths = [], True, [], []
        for repeat in range(cfg.repeats + (name == first)):
            t_plain = t_spec = 0.0
            for p in ids:
                a, ta = _decode(plain, p, cfg.decode_tokens, [])
                b, tb = _decode(spec, p, cfg.decode_tokens, spec_stats)
                same &= a == b
                lengths.append(len(b))
                t_plain, t_spec = t_plain + ta, t_spec + tb
            if repeat or name != first:
                ratios.append(t_plain / t_spec)
        drafted = sum(s.draft_tokens for s in spec_stats)
        accepted = sum(s.accepted_tokens for s in spec_stats)
        verifies = sum(s.verify_steps for s in spec_stats)
        cost = spec.engine.costs.batches.get(1)  # one sequence at a time
        report["sets"][name] = {"speedup": statistics.median(ratios), "speedup_min": min(ratios),
                                "tokens_per_request": statistics.mean(lengths),
                                "speedup_max": max(ratios), "identical_tokens": same,
                                "acceptance": accepted / drafted if drafted else 0.0,
                                "tokens_per_verify": (accepted + verifies) / verifies if verifies else 0.0,
                                "verify_steps_per_request": verifies / len(spec_stats),
                                "verify_cost": list(cost.fit) if cost else None,
                                "verify_steps_timed": cost.verifies if cost else 0}
    plain.close()
    spec.close()
    return report


def format_speculative(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']} · {report['device']} · greedy, at most {report['decode_tokens']} tokens per "
             f"prompt, {report['repeats']} repeats", "",
             (f"{'prompts':<12}{'tokens':>8}{'speed-up':>10}{'min-max':>14}{'acceptance':>12}{'tok/verify':>12}"
              f"{'same tokens':>13}{'verify cost (timed)':>22}")]
    for name, r in report["sets"].items():
        cost = f"{r['verify_cost'][0]:.2f}+{r['verify_cost'][1]:.2f}k" if r["verify_cost"] else "-"
        lines.append(f"{name:<12}{r['tokens_per_request']:>8.0f}{r['speedup']:>9.2f}x"
                     f"{r['speedup_min']:>8.2f}-{r['speedup_max']:<5.2f}{r['acceptance']:>12.0%}"
                     f"{r['tokens_per_verify']:>12.2f}{str(r['identical_tokens']):>13}"
                     f"{cost + ' (' + str(r['verify_steps_timed']) + ')':>22}")
    lines.append("tokens: generated per request (each ends at the model's end of turn); verify cost: a step "
                 "verifying k drafts, in plain steps, as measured by the end of the set (verify steps timed)")
    return "\n".join(lines)
