"""One request's state inside the engine: its tokens, how many hold K/V, its blocks, and when it stops."""

from __future__ import annotations

import enum
import time
from typing import Any

import numpy as np

from quanta.engine.block_manager import BlockTable
from quanta.engine.outputs import GenerationStats, TokenLogprob
from quanta.engine.sampler import SamplingParams
from quanta.engine.stop import StopConditions, StopMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its K/V freed; recomputed when admitted again)
    RUNNING = "running"
    FINISHED = "finished"


PENDING = -1  # a sampled token whose value is still on the device (resolved when its step completes)


class Sequence:
    """A request's prompt and generated ids; ``num_computed`` of them have their K/V in the pool.

    A step that samples for the sequence first ``reserve``s the token's place (its value may still be on the
    device: the next step can already compute from it); ``resolve`` then takes the value: it detokenizes it
    (streaming), matches stop strings and sets ``finish_reason`` when a stop condition holds (end-of-generation
    token, stop string, max_tokens, the context)."""

    def __init__(self, seq_id: int, prompt: list[int], params: SamplingParams, stop: StopConditions,
                 decoder: Any, eog: frozenset[int], max_len: int, constraint: Any = None, drafter: Any = None):
        self.id = seq_id
        self.token_ids = list(prompt)
        self.prompt_len = len(prompt)
        self.num_computed = 0
        self.table = BlockTable()
        self.status = SequenceStatus.WAITING
        self.params, self.stop = params, stop
        self.rng = np.random.default_rng(params.seed)
        self.decoder = decoder
        self.matcher = StopMatcher(stop.stop)
        self.eog = frozenset() if stop.ignore_eos else eog
        self.max_len = max_len  # positions the context holds (the last token generated needs no K/V)
        self.constraint = constraint
        self.drafter = drafter  # speculative decoding (engine/speculation.py), or None
        self.draft: list[int] = []  # this step's draft tokens, verified after the sequence's last token
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.arrival = time.perf_counter()
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """Whether tokens before the last still lack K/V (the prompt, or everything after a preemption)."""
        return self.num_computed < self.num_tokens - 1

    @property
    def at_limit(self) -> bool:
        """Whether the tokens reserved so far already reach max_tokens or the context: nothing more to compute."""
        return self.num_generated >= self.stop.max_tokens or self.num_tokens > self.max_len

    @property
    def room(self) -> int:
        """How many more tokens it may still generate after the next one (the most draft tokens worth verifying)."""
        return min(self.stop.max_tokens - self.num_generated, self.max_len + 1 - self.num_tokens) - 1

    def reserve(self) -> int:
        """Make room for a sampled token (``PENDING`` until resolved); returns its index."""
        self.token_ids.append(PENDING)
        return len(self.token_ids) - 1

    def resolve(self, index: int, token: int, logprob: TokenLogprob | None = None) -> str:
        """The value of the token reserved at ``index``; returns the text it releases (stop strings held back)."""
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            self.stats.ttft_s = now - self.arrival
            self.stats.prefill_s = now - (self.first_scheduled or self.arrival)
        self.last_token = now
        if token in self.eog:
            del self.token_ids[index:]  # the end-of-generation token (and any step queued after it) is no output
            self.finish_reason = "stop"
            if self.drafter is not None:
                self.drafter.rewind(index)
            return self._flush()
        self.token_ids[index] = token
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.constraint is not None:
            self.constraint.advance(token)
        text = self.matcher.push(self.decoder.push(token))
        if self.matcher.stopped or (self.constraint is not None and self.constraint.is_finished):
            self.finish_reason = "stop"
        elif index - self.prompt_len + 1 >= self.stop.max_tokens or index + 1 > self.max_len:
            self.finish_reason = "length"
        if self.finish_reason:
            del self.token_ids[index + 1:]
            if self.drafter is not None:
                self.drafter.rewind(index + 1)
            return text + self._flush()
        return text

    def finish(self, reason: str, error: str | None = None) -> None:
        """Mark the sequence done (the caller frees its blocks)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = self.finish_reason or reason
        self.error = error
        self.stats.completion_tokens = self.num_generated
        if self.first_token is not None and self.last_token is not None:
            self.stats.decode_s = self.last_token - self.first_token

    def _flush(self) -> str:
        return self.matcher.push(self.decoder.flush()) + self.matcher.flush()
