"""The generation loop: prefill the prompt in one forward, then decode one token per forward until a stop.

``generate_tokens`` is a generator of text pieces (for streaming) whose return value is the
:class:`GenerationResult`; the API and the CLI wrap it.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quanta.backends.base import Backend
from quanta.engine.kv_cache import KVCache
from quanta.engine.sampler import Sampler, SamplingParams
from quanta.engine.stop import StopMatcher
from quanta.errors import ContextOverflowError
from quanta.models.base import Model


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V were reused from the previous request
    completion_tokens: int = 0
    ttft_s: float = 0.0  # request start → first generated token
    prefill_s: float = 0.0
    decode_s: float = 0.0  # first token → last token

    @property
    def prefill_tok_s(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = self.completion_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "ttft_s": self.ttft_s, "prefill_s": self.prefill_s,
                "prefill_tok_s": self.prefill_tok_s, "decode_s": self.decode_s, "decode_tok_s": self.decode_tok_s}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids, without the end-of-generation token
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length"
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass(frozen=True)
class StopConditions:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")


def prefill(backend: Backend, model: Model, kv: KVCache, prompt: Sequence[int]) -> tuple[Any, int]:
    """Run the uncached part of ``prompt`` in one forward; returns the last position's logits (1, vocab) and
    the number of prompt tokens reused from the cache."""
    if len(prompt) == 0:
        raise ValueError("the prompt is empty (no tokens)")
    if len(prompt) >= kv.n_ctx:
        raise ContextOverflowError(
            f"the prompt has {len(prompt)} tokens but the context holds {kv.n_ctx} (prompt + at least one "
            f"generated token); shorten the prompt or raise n_ctx")
    start = kv.reuse(prompt)
    logits = backend.forward(model, np.asarray(prompt[start:], np.int32), start, kv.arena, all_logits=False)
    kv.append(prompt[start:])
    return logits, start


def _next_tokens(backend: Backend, model: Model, kv: KVCache, logits: Any, start: int, steps: int, sampler: Sampler,
                 context: list[int]) -> Generator[int, None, None]:
    """The token from the prompt's ``logits``, then one per decode step from position ``start`` (at most
    ``steps``), recording in ``kv`` each token whose K/V a step wrote. Greedy decoding without penalties stays on
    the device (``Backend.greedy_decode``); sampling reads each step's logits (``context``: the tokens so far, which
    the consumer extends)."""
    params = sampler.params
    if params.greedy and not params.has_penalties:
        token = backend.argmax(logits[0])
        yield token
        steps_out = backend.greedy_decode(model, kv.arena, token, start, steps)
        try:
            for token_after in steps_out:
                kv.append([token])
                token = token_after
                yield token
        finally:
            steps_out.close()
        return
    token = sampler.sample(backend.to_host(logits)[0], context)
    yield token
    for i in range(steps):
        logits = backend.forward(model, np.asarray([token], np.int32), start + i, kv.arena, all_logits=False)
        kv.append([token])
        token = sampler.sample(backend.to_host(logits)[0], context)
        yield token


def generate_tokens(backend: Backend, model: Model, kv: KVCache, tokenizer: Any, prompt: Sequence[int],
                    params: SamplingParams, stop: StopConditions) -> Generator[str, None, GenerationResult]:
    """Yield text pieces as tokens are generated; return the GenerationResult."""
    t0 = time.perf_counter()
    stats = GenerationStats(prompt_tokens=len(prompt))
    sampler = Sampler(params)
    decoder = tokenizer.stream_decoder(skip_special=True)
    matcher = StopMatcher(stop.stop)
    eog = frozenset() if stop.ignore_eos else frozenset(tokenizer.eog_ids)
    context, generated, pieces = list(prompt), [], []
    finish = "length"
    if stop.max_tokens == 0:
        return GenerationResult("", [], finish, stats)
    logits, stats.cached_tokens = prefill(backend, model, kv, prompt)
    backend.synchronize()
    stats.prefill_s = time.perf_counter() - t0
    t_first = t_last = None
    steps = min(stop.max_tokens - 1, kv.n_ctx - len(prompt))  # decode steps after the prompt's token
    tokens = _next_tokens(backend, model, kv, logits, len(prompt), steps, sampler, context)
    for token in tokens:
        t_last = time.perf_counter()
        if t_first is None:
            t_first = t_last
            stats.ttft_s = t_first - t0
        if token in eog:
            finish = "stop"
            break
        generated.append(token)
        context.append(token)
        text = matcher.push(decoder.push(token))
        if text:
            pieces.append(text)
            yield text
        if matcher.stopped:
            finish = "stop"
            break
    tokens.close()
    tail = matcher.push(decoder.flush()) + matcher.flush()
    if tail:
        pieces.append(tail)
        yield tail
    stats.completion_tokens = len(generated)
    stats.decode_s = t_last - t_first if t_first is not None else 0.0
    return GenerationResult("".join(pieces), generated, finish, stats)
