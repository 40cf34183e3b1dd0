"""Choosing the next token from logits: penalties, then greedy or temperature / top-k / top-p / min-p sampling.

Order (as HF's logits processors): repetition, presence and frequency penalties over the last
``penalty_last_n`` tokens of the context; temperature (0 = greedy argmax); top-k; top-p (the smallest set of
most likely tokens whose probability reaches p); min-p (drop tokens below min_p x the top probability); then
one draw from the renormalised distribution with the request's own seeded generator (same seed, same tokens).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings; the constructor validates them (ValueError with the reason)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        def number(name: str, lo: float, hi: float = math.inf) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v <= hi) or math.isnan(v):
                raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {v!r}")

        number("temperature", 0.0)
        number("top_p", 0.0, 1.0)
        number("min_p", 0.0, 1.0)
        number("repeat_penalty", 0.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        if self.repeat_penalty == 0:
            raise ValueError("repeat_penalty must be > 0 (1.0 disables it)")
        for name in ("top_k", "penalty_last_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class Sampler:
    """Samples one token per call for one request; owns the request's random generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def apply_penalties(self, logits: np.ndarray, context: Sequence[int]) -> np.ndarray:
        """Penalised copy of ``logits`` (1-D float32) given the context so far."""
        p = self.params
        logits = np.array(logits, dtype=np.float32)
        window = context[-p.penalty_last_n:] if p.penalty_last_n else []
        if not window:
            return logits
        counts = Counter(window)
        ids = np.fromiter(counts.keys(), dtype=np.int64)
        ids = ids[ids < logits.size]
        n = np.array([counts[i] for i in ids], dtype=np.float32)
        vals = logits[ids]
        if p.repeat_penalty != 1.0:
            vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        vals = vals - p.presence_penalty - p.frequency_penalty * n
        logits[ids] = vals
        return logits

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The surviving token ids and their renormalised probabilities (temperature > 0)."""
        p = self.params
        scaled = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < scaled.size:
            ids = np.argpartition(-scaled, p.top_k - 1)[: p.top_k]
        else:
            ids = np.arange(scaled.size)
        ids = ids[np.argsort(-scaled[ids], kind="stable")]
        probs = np.exp(scaled[ids] - scaled[ids[0]])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)  # first index where the sum reaches p
            ids, probs = ids[:keep], probs[:keep]
        if p.min_p > 0.0:
            mask = probs >= p.min_p * probs[0]
            ids, probs = ids[mask], probs[mask]
        return ids, probs / probs.sum()

    def sample(self, logits: np.ndarray, context: Sequence[int]) -> int:
        """The next token id for ``logits`` (1-D) after ``context`` (prompt and generated ids)."""
        if self.params.has_penalties:
            logits = self.apply_penalties(logits, context)
        if self.params.greedy:
            return int(np.argmax(logits))
        ids, probs = self.candidates(logits)
        return int(ids[self.rng.choice(ids.size, p=probs)]) if ids.size > 1 else int(ids[0])
