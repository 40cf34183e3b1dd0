"""Lossless n-gram speculative decoding (prompt lookup): draft tokens from the sequence's own context, verified
by one forward over all of them.

Drafting: the longest suffix of the context (``max_ngram`` tokens down to 1) that also occurred earlier proposes
the tokens that followed its latest earlier occurrence. An index of every n-gram's latest end position, updated as
tokens arrive, makes each lookup O(max_ngram).

Verifying: the step computes the sequence's last token and its k drafts, with logits for all k + 1 rows; the
sampler keeps what plain decoding would have produced (``quanta.engine.sampler.verify``).

The gate: each sequence keeps a running acceptance rate a; a step with k drafts costs about 1 + c*k decode steps
(c: the backend's measured cost of one more verified token) and yields 1 + a + ... + a^k tokens on average, so the
sequence drafts the k (0 to ``max_draft``) with the best ratio, and none while no k beats plain decoding.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``max_draft``: most draft tokens per step; ``max_ngram``: longest suffix looked up; ``extra_token_cost``:
    a verified token's cost relative to a decode step (the gate's c; 0.2: an extra row of the CPU's batched GEMV
    costs 0.17-0.25 of a SmolLM2 step, and with 0.1 the gate drafted on prose at 11% acceptance and lost 3-4%,
    docs/PERF.md session 40); ``prior``: the acceptance rate assumed before a sequence has any."""

    max_draft: int = 4
    max_ngram: int = 3
    extra_token_cost: float = 0.2
    prior: float = 0.6

    def __post_init__(self) -> None:
        if not (1 <= self.max_draft <= 16 and 1 <= self.max_ngram <= 8 and self.extra_token_cost >= 0
                and 0 < self.prior < 1):
            raise ValueError(f"bad speculative settings: {self}")


class NgramDrafter:
    """One sequence's n-gram index and acceptance statistics."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram → end index of its latest occurrence
        self.indexed = 0  # n-grams ending before this index are in ``latest``
        self.rate = config.prior
        self.proposed = self.accepted = 0

    def propose(self, tokens: Seq[int], room: int) -> list[int]:
        """Draft tokens to follow ``tokens`` (at most ``room``, and as many as the gate says pay)."""
        k = min(self.best_k(), room)
        if k <= 0 or len(tokens) < 2:
            return []
        self._index(tokens, len(tokens) - 1)  # n-grams ending before the last token (the suffix itself excluded)
        for n in range(min(self.config.max_ngram, len(tokens) - 1), 0, -1):
            end = self.latest.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return list(tokens[end + 1:end + 1 + k])
        return []

    def record(self, proposed: int, accepted: int) -> None:
        """A verify step's outcome: ``accepted`` of ``proposed`` drafts kept."""
        self.proposed += proposed
        self.accepted += accepted
        if proposed:
            # per-draft acceptance: kept drafts pass, the first rejected fails, those after it say nothing
            trials = accepted + (accepted < proposed)
            self.rate = 0.8 * self.rate + 0.2 * (accepted / trials)

    def best_k(self) -> int:
        """The draft length with the best expected tokens per unit of step cost (0: plain decoding wins)."""
        a, c = self.rate, self.config.extra_token_cost
        best, best_value, gain = 0, 1.0, 1.0
        for k in range(1, self.config.max_draft + 1):
            gain += a ** k
            value = gain / (1 + c * k)
            if value > best_value * 1.02:  # a clear win only: never slower than plain decoding by design
                best, best_value = k, value
        return best

    def _index(self, tokens: Seq[int], stop: int) -> None:
        for end in range(max(self.indexed, 0), stop):
            for n in range(1, self.config.max_ngram + 1):
                if end - n + 1 < 0:
                    break
                self.latest[tuple(tokens[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, stop)

    def rewind(self, length: int) -> None:
        """Tokens from ``length`` on were dropped (a stop): forget n-grams that end there."""
        if self.indexed > length:
            self.latest = {g: e for g, e in self.latest.items() if e < length}
            self.indexed = length
