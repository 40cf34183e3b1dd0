"""Decode variants and loops for the GPU run (called by gpu_check.py): what each variant does to the backend, their
decode speed alternating in one process (``ab``), their logits against the first variant's (``logits``), and the
product's decode loop against the host-driven one and back-to-back replays (``loops``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from gpu_common import BENCH_N_CTX, SUMMARY, say, section
from gpu_speed import _loaded, decode_rate


def _decode_config(tiles: dict | None = None, **scratch):
    """A variant's setup: int8 GEMV tile overrides (on the shipped table) and decode-attention settings
    (``DecodeScratch`` keywords); applied to the backend (its attention scratch is remade, and variants_ab its
    graphs)."""
    def apply(be) -> None:
        from quanta.backends.cuda import flash_decode, q8gemv

        defaults = flash_decode.DecodeScratch.__init__.__kwdefaults__
        if not SHIPPED:  # the settings before the first variant changed them
            SHIPPED.update(scratch=dict(defaults), tiles={key: dict(cfg) for key, cfg in q8gemv.Q8_CONFIG.items()})
        defaults.update({**SHIPPED["scratch"], **scratch})
        be._decode_scratch.clear()
        for key, cfg in SHIPPED["tiles"].items():
            q8gemv.Q8_CONFIG[key] = {**cfg, **(tiles or {}).get(key, {})}
    return apply


SHIPPED: dict = {}  # DecodeScratch's keyword defaults and the int8 GEMV's tiles as shipped


def _without_decode_norms(be) -> None:
    """A diagnostic, wrong in its output: the in-layer norms of a decode step are not launched (their int8 copies
    keep what they held): what the norms cost in the loop."""
    _decode_config()(be)
    cls = type(be)

    def rms_norm(x, weight, eps, *, out=None, residual=None):
        final = out is not None and out.data_ptr() == be.buffer("h_out", tuple(x.shape)).data_ptr()
        if x.shape[0] != 1 or residual is not None or out is None or final:
            return cls.rms_norm(be, x, weight, eps, out=out, residual=residual)
        be._copies.produce(out)
        return out
    be.rms_norm = rms_norm


def _shipped(be) -> None:
    _decode_config()(be)
    be.__dict__.pop("rms_norm", None)


VARIANTS = {  # decode variants compared in one process: what each does to the backend before its runs
    "shipped": _shipped,
    "no norms (diagnostic)": _without_decode_norms,
}


@section("decode variants against the first: logits of 24 decode steps on the first's greedy tokens, graph replay")
def variants_logits(models: list[tuple[str, Path]], depths: tuple[int, ...] = (0, 1024), steps: int = 24,
                    n_ctx: int = BENCH_N_CTX) -> None:
    """Whether a variant changes the arithmetic: every variant decodes the first variant's greedy tokens (so one
    flipped near-tie does not send it down another path), and its logits are compared with the first's."""
    first = next(iter(VARIANTS))
    for name, path in models:
        with _loaded(path, n_ctx) as (be, model, _):
            cache = be.kv_cache(model.kv_shape())
            for depth in depths:
                prompt = np.random.default_rng(depth).integers(5, min(model.n_vocab, 30000),
                                                               size=max(depth, 8)).astype(np.int32)
                runs: dict = {}
                tokens: list[int] = []
                for label, apply in VARIANTS.items():
                    apply(be)
                    be._graphs.clear()
                    tok = be.argmax(be.forward(model, prompt, 0, cache, all_logits=False)[0])
                    logits = []
                    for i in range(steps):
                        tok = tokens[i] if label != first else tok
                        out = be.forward(model, np.asarray([tok], np.int32), len(prompt) + i, cache, all_logits=False)
                        logits.append(be.to_host(out).reshape(-1).copy())
                        if label == first:
                            tokens.append(tok)
                            tok = int(np.argmax(logits[-1]))
                    runs[label] = np.stack(logits)
                line = f"{name:22s} depth {depth}: " + ", ".join(
                    f"{label} max |diff| {float(np.abs(r - runs[first]).max()):.1e}" for label, r in runs.items()
                    if label != first)
                say("  ", line)
                SUMMARY.append(line)
            VARIANTS[first](be)


@section("decode variants (VARIANTS), alternating in one process")
def variants_ab(models: list[tuple[str, Path]], reps: int = 3, n_ctx: int = BENCH_N_CTX) -> None:
    """Medians of ``reps`` at depths 0 and 1,024, at the issue's bench's n_ctx."""
    for name, path in models:
        rates: dict = {}
        with _loaded(path, n_ctx) as (be, model, _):
            cache = be.kv_cache(model.kv_shape())
            for _ in range(reps):
                for depth in (0, 1024):
                    for label, apply in VARIANTS.items():
                        apply(be)
                        be._graphs.clear()
                        rates.setdefault((depth, label), []).append(decode_rate(be, model, cache, depth, 128))
        med = {k: float(np.median(v)) for k, v in rates.items()}
        line = f"{name:22s} decode " + ", ".join(f"{lab} {med[(0, lab)]:.0f}" for lab in VARIANTS) + \
            " | @1024 " + ", ".join(f"{med[(1024, lab)]:.0f} ({100 * med[(1024, lab)] / med[(0, lab)]:.0f}%)"
                                   for lab in VARIANTS)
        say("  ", line, json.dumps({f"{d} {lab}": [round(x) for x in v] for (d, lab), v in rates.items()}))
        SUMMARY.append(line)


@section("decode loops: the product's generate (as `quanta bench` runs it), the host-driven loop, back-to-back replays")
def loop_compare(models: list[tuple[str, Path]], reps: int = 5, n_decode: int = 128) -> None:
    """tok/s at depths 0 and 1,024 of ``LLM.generate`` (the bench's QuantaEngine, n_ctx as the bench sets it), of
    the host-driven loop on the same backend, model and cache (a token read before each replay), and of the decode
    graph replayed back to back without reading a token (the GPU's own rate), alternating: what the product loop
    costs over the GPU's rate (GPU runs 188, 190)."""
    from quanta.bench.engines import QuantaEngine
    from quanta.bench.runner import _prompt

    for name, path in models:
        engine = QuantaEngine(str(path), device="cuda", threads=1, n_ctx=1024 + n_decode + 8)
        llm = engine.llm
        vocab = llm.model.n_vocab
        prompts = {0: _prompt(vocab, 8), 1024: _prompt(vocab, 1024, seed=1)}
        for depth in prompts:  # warm-up: compile, capture (a prompt length's graph at its second use)
            engine.run(prompts[depth], 4)
            engine.run(prompts[depth], 4)
        rates: dict = {}
        for _ in range(reps):
            for depth, prompt in prompts.items():
                rates.setdefault(("generate", depth), []).append(engine.run(prompt, n_decode).decode_tok_s)
                llm.kv.reset()
                rates.setdefault(("host-driven", depth), []).append(
                    decode_rate(llm.backend, llm.model, llm.kv.arena, depth, n_decode, chained=False))
                rates.setdefault(("replays", depth), []).append(
                    _replay_rate(llm.backend, llm.model, llm.kv.arena, len(prompt), n_decode))
        med = {k: float(np.median(v)) for k, v in rates.items()}
        line = f"{name:22s} " + ", ".join(
            f"{loop} {med[(loop, 0)]:.0f} / {med[(loop, 1024)]:.0f} ({100 * med[(loop, 1024)] / med[(loop, 0)]:.1f}%, "
            f"gap {1e6 / med[(loop, 1024)] - 1e6 / med[(loop, 0)]:.1f} µs)"
            for loop in ("generate", "host-driven", "replays"))
        say("  ", line, json.dumps({f"{lp} {d}": [round(x) for x in v] for (lp, d), v in rates.items()}))
        SUMMARY.append(line)
        del engine, llm
        torch.cuda.empty_cache()


def _replay_rate(be, model, cache, start: int, n_decode: int) -> float:
    """tok/s of ``n_decode`` decode steps from position ``start`` enqueued back to back (a fixed token, no argmax,
    no host read): the GPU-bound rate of the same graph."""
    be.forward(model, np.asarray([7], np.int32), start, cache, all_logits=False)  # the graph exists: no capture here
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n_decode):
        be.forward(model, np.asarray([7], np.int32), start + i, cache, all_logits=False)
    torch.cuda.synchronize()
    return n_decode / (time.perf_counter() - t0)

