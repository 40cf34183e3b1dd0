"""How much fidelity the GPU default mode's numerics cost, measured teacher-forced on the CPU.

The GPU default mode rounds the input of every matmul to int8 with one fp32 scale per 32 values (llama.cpp's q8_1:
``d = max|x| / 127``, ``q = round(x / d)`` half away from zero; cuda/q8gemv.py ``quantize``) and stores the KV
cache in float16. Both are emulated here around the CPU backend's exact mode (fp32 everywhere, the reference):
the activations are rounded to int8 and back before the exact matmul, K and V to float16 and back before they are
cached. Each variant scores the same token ids (a long Debian-shipped prose text, cut into independent windows)
and is compared with exact mode: top-1 agreement (argmax equal), perplexity and its change, mean KL(exact ‖ variant)
and, where the argmax differs, the median gap between exact mode's two best log-probabilities (flips are near-ties).
Also scored: the CPU fast mode as it is and llama.cpp (llama-cpp-python, CPU, its defaults: q8 activations, f16 KV;
`make bench-deps` installs it, `--skip llama.cpp` leaves it out).

Uncertainty (±): one standard error over 64-token blocks of the paired per-token differences (blocks absorb the
correlation between neighbouring tokens); a 95 % interval is about ±2 of them. Int8 rounding is chaotic: any tiny
change upstream flips other roundings downstream, so two int8 runs differ from each other about as much as each
differs from exact; only these statistics, not token-by-token outputs, carry over to the GPU.

    .venv/bin/python scripts/fidelity.py [--tokens 8192] [--window 512] [--text PATH]

The whole GPL-3 (~7,100 tokens, 13 windows) takes ~9 minutes on 2 cores. The emulation wraps two ops of the CPU
backend (``matmul``, ``attention``) on the instance; everything else is ``quanta.LLM``.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from quanta import LLM, load_tokenizer
from quanta.hub import resolve_model

BLOCK = 64  # tokens per block for the standard errors
MATRIX_CLASS = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "attn_output": "attn_out",
                "ffn_gate": "gate_up", "ffn_up": "gate_up", "ffn_down": "down"}
CLASSES = ("qkv", "attn_out", "gate_up", "down", "lm_head")


def matrix_class(weight_name: str) -> str:
    """'blk.3.ffn_up.weight' → 'gate_up'; the embedding / output matrix → 'lm_head'."""
    parts = weight_name.split(".")
    return MATRIX_CLASS[parts[2]] if parts[0] == "blk" else "lm_head"


def q8_roundtrip(x: np.ndarray, *, block: int = 32, half_even: bool = False) -> np.ndarray:
    """x rounded to int8 with one scale per ``block`` consecutive values of a row, and back to float32."""
    b = x.reshape(x.shape[0], -1, block)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.maximum(amax, np.float32(1e-30)), np.float32(0))
    t = b * inv
    q = np.rint(t) if half_even else np.trunc(t + np.copysign(np.float32(0.5), t))
    return (q * (amax / np.float32(127))).astype(np.float32).reshape(x.shape)


@dataclass(frozen=True)
class Emulation:
    """Which GPU default-mode roundings to apply on top of exact mode."""

    q8: frozenset[str] = frozenset()  # matrix classes whose input is rounded to int8
    kv_f16: bool = False
    half_even: bool = False
    block: int = 32


def emulate(backend: Any, e: Emulation) -> None:
    """Gives an exact-mode CPU backend the roundings of ``e``: its matmul and attention wrapped on the instance."""
    matmul, attention = backend.matmul, backend.attention

    def rounded_matmul(x: np.ndarray, w: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        if matrix_class(w.name) in e.q8:
            x = q8_roundtrip(x, block=e.block, half_even=e.half_even)
        return matmul(x, w, *args, **kwargs)

    def f16_kv_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        # what the cache would hold: the new tokens' K/V are read back from it too
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
        return attention(q, k, v, *args, **kwargs)

    if e.q8:
        backend.matmul = rounded_matmul
    if e.kv_f16:
        backend.attention = f16_kv_attention


ALL = frozenset(CLASSES)
VARIANTS: dict[str, Emulation | None] = {  # None: not an emulation (scored by its own engine)
    "exact (reference)": Emulation(),
    "int8 x, all matmuls": Emulation(q8=ALL),
    **{f"int8 x, all but {c}": Emulation(q8=ALL - {c}) for c in CLASSES},
    **{f"int8 x, only {c}": Emulation(q8=frozenset({c})) for c in CLASSES},
    "fp16 KV only": Emulation(kv_f16=True),
    "int8 x all + fp16 KV (planned default)": Emulation(q8=ALL, kv_f16=True),
    "  same, round half to even": Emulation(q8=ALL, kv_f16=True, half_even=True),
    "  same, scale per 16": Emulation(q8=ALL, kv_f16=True, block=16),
    "  same, lm head in fp32": Emulation(q8=ALL - {"lm_head"}, kv_f16=True),
    "CPU fast mode (exact=False)": None,
    "llama.cpp CPU (llama-cpp-python)": None,
}


@dataclass
class Scores:
    """Per-token statistics of one variant over all windows."""

    nll: list[np.ndarray] = field(default_factory=list)  # -log p(next token)
    top1: list[np.ndarray] = field(default_factory=list)  # argmax of the logits
    kl: list[np.ndarray] = field(default_factory=list)  # KL(exact ‖ variant) of the next-token distributions
    margin: list[np.ndarray] = field(default_factory=list)  # exact mode's top-1 minus top-2 log-probability
    seconds: float = 0.0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
    return z


def quanta_scorer(path: Path, n_ctx: int, threads: int | None, emulation: Emulation | None
                  ) -> Callable[[np.ndarray], np.ndarray]:
    """Teacher-forced logits of a window: exact mode with ``emulation``'s roundings, or (None) the fast mode."""
    llm = LLM(path, device="cpu", n_ctx=n_ctx, threads=threads, exact=emulation is not None)
    if emulation is not None:
        emulate(llm.backend, emulation)
    return llm.logits


def llama_cpp_scorer(path: Path, n_ctx: int, threads: int) -> Callable[[np.ndarray], np.ndarray]:
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def score(ids: np.ndarray) -> np.ndarray:
        llm.reset()
        llm.eval(ids.tolist())
        return np.array(llm.scores[:len(ids)], np.float32)
    return score


def prose(path: Path) -> str:
    """The text with each paragraph's lines joined (license files are indented and hard-wrapped)."""
    paragraphs = re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def block_se(per_token: np.ndarray) -> float:
    """Standard error of the mean of a per-token series from the means of its BLOCK-token blocks."""
    n = len(per_token) // BLOCK
    means = per_token[:n * BLOCK].reshape(n, BLOCK).mean(axis=1)
    return float(means.std(ddof=1) / np.sqrt(n))


def report(names: list[str], scores: dict[str, Scores]) -> None:
    ref = scores[names[0]]
    ref_nll, ref_top, margin = np.concatenate(ref.nll), np.concatenate(ref.top1), np.concatenate(ref.margin)
    print(f"{'variant':42s} {'top-1':>15s} {'ppl':>7s} {'Δppl %':>14s} {'KL mean':>9s} {'flip gap':>8s} "
          f"{'time s':>7s}")
    for name in names:
        s = scores[name]
        nll, agree = np.concatenate(s.nll), (np.concatenate(s.top1) == ref_top).astype(np.float64)
        diff = nll - ref_nll
        dppl = 100 * np.expm1(diff.mean())
        se_ppl = 100 * np.exp(diff.mean()) * block_se(diff)
        gap = np.median(margin[agree == 0]) if (agree == 0).any() else float("nan")
        print(f"{name:42s} {agree.mean():7.4f}±{block_se(agree):.4f} {np.exp(nll.mean()):7.3f} "
              f"{dppl:+7.2f}±{se_ppl:5.2f} {np.concatenate(s.kl).mean():9.2e} {gap:8.3f} {s.seconds:7.1f}")
    print(f"\n{len(ref_nll)} scored tokens; ± = 1 standard error over {BLOCK}-token blocks (paired with exact); "
          f"flip gap: median exact top-1 - top-2 log-prob where the argmax differs (all tokens: "
          f"{np.median(margin):.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    p.add_argument("--tokens", type=int, default=8192, help="at most this many tokens, in independent windows")
    p.add_argument("--window", type=int, default=512, help="tokens per window (one forward each)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip", default="", help="comma-separated substrings of variant names to leave out")
    args = p.parse_args()

    path = resolve_model(args.model, progress=False)
    ids = np.array(load_tokenizer(path).encode(prose(args.text), add_special=False), np.int32)
    n_windows = min(args.tokens, len(ids)) // args.window
    windows = [ids[i * args.window:(i + 1) * args.window] for i in range(n_windows)]
    skip = [s for s in args.skip.split(",") if s]
    names = [n for i, n in enumerate(VARIANTS) if i == 0 or not any(s in n for s in skip)]
    print(f"{path.name}: {args.text} ({len(ids)} tokens), {n_windows} windows of {args.window}")

    scorers: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
    for name in names:
        emulation = VARIANTS[name]
        if emulation is not None or name.startswith("CPU fast"):
            scorers[name] = quanta_scorer(path, args.window, args.threads, emulation)
        else:
            scorers[name] = llama_cpp_scorer(path, args.window, args.threads or 2)

    scores = {name: Scores() for name in names}
    for w, window in enumerate(windows):
        targets, rows = window[1:], np.arange(len(window) - 1)
        ref_logp = None
        for name in names:
            t0 = time.perf_counter()
            logits = scorers[name](window)[:-1]
            scores[name].seconds += time.perf_counter() - t0
            logp = log_softmax(logits)
            if ref_logp is None:
                ref_logp = logp
                top2 = np.partition(logp, -2, axis=1)[:, -2:]
                scores[name].margin.append(top2[:, 1] - top2[:, 0])
            s = scores[name]
            s.nll.append(-logp[rows, targets])
            s.top1.append(logits.argmax(axis=1))
            s.kl.append((np.exp(ref_logp) * (ref_logp - logp)).sum(axis=1))
        print(f"window {w + 1}/{n_windows} done", flush=True)
    print()
    report(names, scores)


if __name__ == "__main__":
    main()
