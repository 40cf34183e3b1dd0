"""Lossless n-gram speculative decoding (prompt lookup): draft tokens from the sequence's own context, verified
by one forward over all of them.

Drafting: the longest suffix of the context (``max_ngram`` tokens down to 1) that also occurred earlier proposes
the tokens that followed its latest earlier occurrence. An index of every n-gram's latest end position, updated as
tokens arrive, makes each lookup O(max_ngram).

Verifying: the step computes the sequence's last token and its k drafts, with logits for all k + 1 rows; the
sampler keeps what plain decoding would have produced (``quanta.engine.sampler.verify``).

The gate: each sequence keeps a running acceptance rate a per match length (a draft that follows a 3-token match is
kept far more often than one after a single token), from its verify steps and, while it drafts nothing, from
shadow drafts scored against the tokens that follow them, starting from the rates its engine's sequences measured
before it (``AcceptanceHistory``; the configured prior until any draft is scored); a step with k drafts costs r(k)
plain steps, measured on the backend (``quanta.engine.step_cost``; the prior 1 + c*k until then), and yields 1 + a +
... + a^k tokens on average, so the sequence drafts the k (0 to ``max_draft``) with the best tokens per unit of time
over its batch, and none while no k clearly beats plain decoding. Where the measured cost says drafting loses, a rare
probe (``StepCosts.probe_due``) prices drafts by the prior again, to measure them again.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from quanta.engine.sequence import PENDING
from quanta.engine.step_cost import StepCosts

SPECULATIVE_METHODS = ("ngram",)
HISTORY_WEIGHT = 0.05  # of a scored draft in the engine's acceptance rates (about the last twenty count)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``max_draft``: most draft tokens per step; ``max_ngram``: longest suffix looked up; ``extra_token_cost``:
    the prior of a verified token's cost relative to a decode step, until the backend's is measured (the gate's c;
    0.2: an extra row of the CPU's batched GEMV costs 0.17-0.25 of a SmolLM2 step, docs/PERF.md session 40);
    ``prior``: the acceptance rate assumed before a sequence has any."""

    max_draft: int = 4
    max_ngram: int = 3
    extra_token_cost: float = 0.2
    prior: float = 0.6

    def __post_init__(self) -> None:
        if not (1 <= self.max_draft <= 16 and 1 <= self.max_ngram <= 8 and self.extra_token_cost >= 0
                and 0 < self.prior < 1):
            raise ValueError(f"bad speculative settings: {self}")


class AcceptanceHistory:
    """The acceptance rates per match length over all of an engine's sequences: a new sequence's starting rates (at
    the configured prior, each request verified its first drafts after every match length: on prose, where ~25% are
    kept, those verify steps lost 1-3% on the GPU)."""

    def __init__(self, config: SpeculativeConfig):
        self.rates = [config.prior] * (config.max_ngram + 1)

    def update(self, matched: int, rate: float) -> None:
        self.rates[matched] += HISTORY_WEIGHT * (rate - self.rates[matched])


class NgramDrafter:
    """One sequence's n-gram index, acceptance rate and gate; ``costs``: its engine's measured step costs (None:
    priced by the configured prior alone); ``history``: its engine's acceptance rates (None: its own, from the
    prior)."""

    def __init__(self, config: SpeculativeConfig, costs: StepCosts | None = None,
                 history: AcceptanceHistory | None = None):
        self.config, self.costs = config, costs
        self.history = history or AcceptanceHistory(config)
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram → end index of its latest occurrence
        self.indexed = 0  # n-grams ending before this index are in ``latest``
        self.rates = list(self.history.rates)  # [m]: acceptance of drafts after an m-token match
        self.matched = 0  # the match length behind the last proposed draft
        # (start, draft, match length): a draft not verified, scored by ``follow``
        self.shadow: tuple[int, list[int], int] | None = None
        # the latest lookup: (n, k, the last token looked up, draft, match length)
        self._last: tuple[int, int, int, list[int], int] | None = None

    def propose(self, tokens: Seq[int], room: int) -> list[int]:
        """Draft tokens to follow ``tokens`` (at most ``room``, and as many as the gate says pay for the match found;
        none after a last token still unknown, ``PENDING``: no n-gram with it is indexed)."""
        if room <= 0 or len(tokens) < 2 or tokens[-1] == PENDING:
            return []
        draft, matched = self._lookup(tokens, len(tokens), self.config.max_draft)
        k = min(self.best_k(matched), room) if draft else 0
        if k <= 0:
            return []  # the shadow draft, if any, stays to be scored
        self.shadow, self.matched = None, matched
        return draft[:k]

    def follow(self, tokens: Seq[int], known: int) -> None:
        """A step without drafts: ``tokens[:known]`` are final. The shadow draft is scored against them as a verify
        step would score it (once decided), and a new one is drafted from them."""
        if self.shadow is not None:
            start, draft, matched = self.shadow
            got = tokens[start:min(known, start + len(draft))]
            accepted = next((i for i, (g, d) in enumerate(zip(got, draft)) if g != d), len(got))
            if accepted < len(got) or accepted == len(draft):
                self._update(matched, len(draft), accepted)
                self.shadow = None
        if self.shadow is None and known >= 2:
            draft, matched = self._lookup(tokens, known, self.config.max_draft)
            self.shadow = (known, draft, matched) if draft else None

    def wants_to_draft(self) -> bool:
        """Whether this sequence drafts in its next step: the context has a draft to offer (its shadow draft) and
        the gate says drafts after its match pay."""
        return self.shadow is not None and self.best_k(self.shadow[2]) > 0

    def record(self, proposed: int, accepted: int) -> None:
        """A verify step's outcome: ``accepted`` of the ``proposed`` drafts of the last proposal kept."""
        self._update(self.matched, proposed, accepted)

    def _update(self, matched: int, proposed: int, accepted: int) -> None:
        if proposed:
            # per-draft acceptance: kept drafts pass, the first rejected fails, those after it say nothing
            rate = accepted / (accepted + (accepted < proposed))
            self.rates[matched] = 0.8 * self.rates[matched] + 0.2 * rate
            self.history.update(matched, rate)

    def best_k(self, matched: int) -> int:
        """The draft length with the best expected tokens per unit of time after a match of ``matched`` tokens
        (0: plain decoding wins), priced by the measured costs (no drafts before a plain step of the batch size is
        timed), or by the prior for a probe."""
        rate, costs = self.rates[matched], self.costs
        if costs is None:
            return self._best((1.0, self.config.extra_token_cost), 1, rate)
        if not costs.measured:
            return 0
        k = self._best(costs.fit, costs.seqs, rate)
        if k == 0 and costs.probe_due():
            k = self._best(costs.prior_fit, costs.seqs, rate)
        return k

    def _best(self, fit: tuple[float, float], seqs: int, p: float) -> int:
        """The best k when a step with k drafts costs a + b*k plain steps (``fit`` = (a, b)) of a batch of ``seqs``
        sequences (the others make one token each either way) and each draft is kept with probability ``p``."""
        a, b = fit
        best, best_value, gain = 0, 1.0, 1.0
        for k in range(1, self.config.max_draft + 1):
            gain += p ** k
            value = (seqs - 1 + gain) / (seqs * (a + b * k))
            if value > best_value * 1.02:  # a clear win only: never slower than plain decoding by design
                best, best_value = k, value
        return best

    def _lookup(self, tokens: Seq[int], n: int, k: int) -> tuple[list[int], int]:
        """At most ``k`` tokens that followed the latest earlier occurrence of ``tokens[:n]``'s longest suffix, and
        that suffix's length (0: none found). The latest answer is kept: a step's shadow draft and the next step's
        proposal look up the same context."""
        key = (n, k, tokens[n - 1])
        if self._last is not None and self._last[:3] == key:
            return self._last[3], self._last[4]
        self._index(tokens, n - 1)  # n-grams ending before the last token (the suffix itself excluded)
        found: tuple[list[int], int] = ([], 0)
        for m in range(min(self.config.max_ngram, n - 1), 0, -1):
            end = self.latest.get(tuple(tokens[n - m:n]))
            if end is not None:
                found = list(tokens[end + 1:min(end + 1 + k, n)]), m
                break
        self._last = (*key, *found)
        return found

    def _index(self, tokens: Seq[int], stop: int) -> None:
        for end in range(max(self.indexed, 0), stop):
            for n in range(1, self.config.max_ngram + 1):
                if end - n + 1 < 0:
                    break
                self.latest[tuple(tokens[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, stop)

    def rewind(self, length: int) -> None:
        """Tokens from ``length`` on were dropped (a stop): forget n-grams that end there, and the shadow draft."""
        self.shadow = self._last = None
        if self.indexed > length:
            self.latest = {g: e for g, e in self.latest.items() if e < length}
            self.indexed = length
