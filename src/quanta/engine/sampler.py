"""Choosing each sequence's next token from its logits row: bias and penalties, then greedy or temperature /
top-k / top-p / min-p sampling.

Order (as HF's logits processors): logit bias; repetition, presence and frequency penalties over the last
``penalty_last_n`` tokens of the context; an output constraint's mask; temperature (0 = greedy argmax); top-k;
top-p (the smallest set of most likely tokens whose probability reaches p); min-p (drop tokens below min_p x the top
probability); then one draw from the renormalised distribution with the sequence's own seeded generator (same seed,
same tokens, whatever else is in the batch). A batch whose rows are all plain greedy takes its argmax on the device
(one small host read), constrained rows masked there by their packed masks (one small upload). On a backend that
samples on the device (``Backend.sample_rows``), a batch without constrained rows, logprobs or drafts to verify is
sampled there: the host sends each row's settings, its logit adjustments and its draw of the generator, and reads
back only the tokens. Any other batch is sampled on the host from its logits. Both take one draw per sampled token
and pick with the same rule (:func:`pick`): a seed gives the same tokens on either path, up to float rounding.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from quanta.backends.base import SamplingRows
from quanta.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from quanta.backends.base import Array, Backend
    from quanta.engine.sequence import Sequence

MAX_LOGPROBS = 20
MAX_SEED = 2**63
NUCLEUS_FIRST = 64  # tokens a top-p without top-k looks among first (4x as many while their mass is short)


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings; the constructor validates them (ValueError with the reason).

    ``logit_bias``: token id → value added to its logit; ``logprobs``: None (off), or how many most likely
    alternatives to report with each generated token's log-probability (0 to 20)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def number(name: str, lo: float, hi: float = math.inf) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not lo <= v <= hi:
                raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {v!r}")

        number("temperature", 0.0, 1e4)
        number("top_p", 0.0, 1.0)
        number("min_p", 0.0, 1.0)
        number("repeat_penalty", 0.01, 100.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        for name in ("top_k", "penalty_last_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None (a random seed), got {s!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    isinstance(k, int) and not isinstance(k, bool) and k >= 0 and isinstance(v, (int, float))
                    and not isinstance(v, bool) and math.isfinite(v) for k, v in self.logit_bias.items()):
                raise ValueError("logit_bias must map token ids (non-negative integers) to finite numbers")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {lp!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy from the raw logits: nothing to read back but the argmax."""
        return self.greedy and not self.has_penalties and not self.logit_bias and self.logprobs is None


def apply_penalties(logits: np.ndarray, context: Seq[int], p: SamplingParams) -> None:
    """Penalise ``logits`` (1-D float32, in place) for the tokens of the last ``penalty_last_n`` of ``context``."""
    window = context[-p.penalty_last_n:] if p.penalty_last_n else []
    if not window:
        return
    counts = Counter(window)
    ids = np.fromiter(counts.keys(), dtype=np.int64)
    ids = ids[ids < logits.size]
    n = np.array([counts[i] for i in ids], dtype=np.float32)
    vals = logits[ids]
    if p.repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    logits[ids] = vals - p.presence_penalty - p.frequency_penalty * n


def adjust(row: np.ndarray, params: SamplingParams, context: Seq[int]) -> None:
    """The request's logit bias, then its penalties, applied to ``row`` in place."""
    if params.logit_bias:
        ids = np.fromiter((t for t in params.logit_bias if t < row.size), np.int64)
        row[ids] += np.array([params.logit_bias[int(t)] for t in ids], np.float32)
    if params.has_penalties:
        apply_penalties(row, context, params)


def _largest(row: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest values of ``row`` (float32, no NaN), largest first, ties by lower id: a partition
    of the float32 row itself, then a sort of the k (no float64 copy or full sort of a vocabulary)."""
    n = row.size
    ids = np.argpartition(row, n - k)[n - k:] if k < n else np.arange(n)
    return ids[np.lexsort((ids, -row[ids]))]


def candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The surviving token ids and their renormalised probabilities (temperature > 0; ``logits`` without NaN or
    +inf). With top-k or top-p the ids come most likely first; the whole distribution (neither) in id order."""
    finite = np.isfinite(logits)  # masked (-inf) tokens never survive
    live = int(np.count_nonzero(finite))
    if live == 0:
        return np.zeros(0, np.int64), np.zeros(0)
    if 0 < p.top_k < live:
        ids = _largest(logits, p.top_k)
        scaled = logits[ids].astype(np.float64) / p.temperature
        probs = np.exp(scaled - scaled[0])
        probs /= probs.sum()
    elif p.top_p < 1.0:  # top-p over every token: among its NUCLEUS_FIRST most likely, else 4x as many, ...
        scaled = logits.astype(np.float64) / p.temperature
        top = scaled.max()
        total = np.exp(scaled - top).sum()
        n = NUCLEUS_FIRST
        while True:
            ids = _largest(logits, min(n, live))
            probs = np.exp(scaled[ids] - top) / total
            if ids.size == live or np.cumsum(probs)[-1] >= p.top_p:
                break
            n *= 4
    else:  # the whole distribution
        ids = np.flatnonzero(finite)
        scaled = logits[ids].astype(np.float64) / p.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
    if p.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)  # first index where the sum reaches p
        ids, probs = ids[:keep], probs[:keep]
    if p.min_p > 0.0:
        mask = probs >= p.min_p * probs.max()
        ids, probs = ids[mask], probs[mask]
    return ids, probs / probs.sum()


def logprobs_of(raw: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under the model's own distribution (``raw`` logits), with the ``top`` most
    likely tokens."""
    m = float(raw.max())
    log_z = m + math.log(np.exp(raw.astype(np.float64) - m).sum())
    best = _largest(raw, min(top, raw.size)) if top else np.zeros(0, np.int64)
    return TokenLogprob(token, float(raw[token]) - log_z, tuple((int(i), float(raw[i]) - log_z) for i in best))


def pick(probs: np.ndarray, u: float) -> int:
    """The index drawn from ``probs`` with the uniform ``u`` in [0, 1): the first whose cumulative probability
    exceeds ``u`` times the total (``Generator.choice``'s rule; the device sampler's too)."""
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), int(np.searchsorted(cdf, cdf[-1])))


def sample_row(row: np.ndarray, params: SamplingParams, rng: np.random.Generator, context: Seq[int]) -> int:
    """The next token from a logits ``row`` (1-D float32, modified in place; a constraint's mask already applied)
    after ``context`` (the sequence's tokens so far); -1 when the row is not finite (a broken model) or the mask
    leaves no token. A sampled token takes one draw of ``rng`` whatever happens (as a device row's)."""
    u = 0.0 if params.greedy else rng.random()
    if not np.isfinite(row.max()):
        return -1
    adjust(row, params, context)
    if params.greedy:
        token = int(np.argmax(row))
        return token if np.isfinite(row[token]) else -1
    ids, probs = candidates(row, params)
    if ids.size == 0:
        return -1
    return int(ids[pick(probs, u)])


def verify(rows: np.ndarray, draft: Seq[int], params: SamplingParams, rng: np.random.Generator,
           context: Seq[int]) -> list[int]:
    """The tokens to keep from a speculative verify step: ``rows`` are the k + 1 logits rows after the context and
    after each of the k ``draft`` tokens; returns the kept drafts and one more token; [] for a non-finite row.

    Greedy: draft i is kept while it equals the argmax after the tokens before it, then the argmax after the last
    kept one is added: exactly the tokens plain greedy decoding produces. Sampling: a draft token x is kept with
    probability p(x) under the request's own distribution p (bias, penalties and the cut-offs applied); on a
    rejection the token is drawn from p without x (renormalised); after k kept drafts one more is drawn from the
    last row. With a deterministic draft this is the standard speculative-sampling rule: the output distribution
    is p's, draft or no draft."""
    out: list[int] = []
    ctx = list(context)
    for i in range(len(draft) + 1):
        row = np.array(rows[i], np.float32)
        if not np.isfinite(row.max()):
            return []
        adjust(row, params, ctx)
        x = draft[i] if i < len(draft) else None
        if params.greedy:
            best = int(np.argmax(row))
            out.append(best)
            if best != x:
                break
            ctx.append(best)
            continue
        ids, probs = candidates(row, params)
        if ids.size == 0:
            return []
        hit = np.flatnonzero(ids == x) if x is not None else np.zeros(0, np.int64)
        if hit.size and rng.random() < probs[hit[0]]:
            out.append(int(x))
            ctx.append(int(x))
            continue
        if hit.size:  # rejected: draw from p without x
            probs = probs.copy()
            probs[hit[0]] = 0.0
            probs /= probs.sum()
        out.append(int(ids[rng.choice(ids.size, p=probs)]))
        break
    return out


def on_device(seq: Sequence) -> bool:
    """Whether ``seq``'s tokens can be picked on the device by an argmax: plain greedy (an output constraint's mask
    applied there)."""
    return seq.params.plain_greedy


def draws_on_device(seq: Sequence) -> bool:
    """Whether a backend that samples on the device (``Backend.sample_rows``) can pick ``seq``'s next token: no
    output constraint, no logprobs, no draft to verify."""
    return _device_drawable(seq) and not seq.draft


def _device_drawable(seq: Sequence) -> bool:
    return seq.constraint is None and seq.params.logprobs is None


def needs_host_tokens(seq: Sequence, backend: Backend) -> bool:
    """Whether ``seq``'s sampling needs its previous tokens on the host (so no step may be queued ahead while it
    runs): it is sampled on the host (its verify steps aside: those are never queued ahead), or its penalties count
    its context's tokens. Fixed for the request's life."""
    if on_device(seq):
        return False
    return not (backend.samples_on_device and _device_drawable(seq)) or seq.params.has_penalties


class BatchSampler:
    """Picks the next tokens of each sampling sequence of a batch from its logits rows; see the module note."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self._masker: Any = None  # constraint.BatchMasker, made when a constrained sequence first samples

    def masked_on_device(self, logits: Array, seqs: list[Sequence]) -> Array | None:
        """The greedy token of every row with each constrained row masked by its constraint's state now, left on the
        device (-1 for a non-finite row, or where a constraint allows nothing); ``seqs``: the rows' sequences (one
        row each, or 1 + its drafts). None where no row is constrained any more (a finished sequence's row is not
        masked: its token is dropped): the plain argmax then serves."""
        rows = [None if seq.constraint is None or seq.is_finished else seq.constraint
                for seq in seqs for _ in range(1 + len(seq.draft))]
        if not any(rows):
            return None
        return self.backend.argmax_rows(logits, self._batch_masker(logits.shape[1]).compute(rows))

    @staticmethod
    def verify_greedy(best: np.ndarray, seqs: list[Sequence]) -> list[list[int]]:
        """:func:`verify` of plain greedy sequences from their rows' greedy tokens (``Backend.argmax_rows``', -1 for a
        non-finite row) instead of the logits: draft i kept while it equals the token after the ones before it,
        then one more token; [] for a non-finite row."""
        tokens, r = [], 0
        for seq in seqs:
            new: list[int] = []
            for i in range(len(seq.draft) + 1):
                t = int(best[r + i])
                if t < 0:
                    new = []
                    break
                new.append(t)
                if i == len(seq.draft) or t != seq.draft[i]:
                    break
            tokens.append(new)
            r += len(seq.draft) + 1
        return tokens

    def draw_on_device(self, logits: Array, seqs: list[Sequence]) -> Array:
        """Each sequence's next token (one row each, :func:`draws_on_device`), drawn by the backend and left there;
        each sampled row takes its draw of its sequence's generator now. -1 marks non-finite logits."""
        n_vocab = logits.shape[1]
        params = [seq.params for seq in seqs]
        rows, ids, bias, counts = [], [], [], []
        for r, (seq, p) in enumerate(zip(seqs, params)):
            entries: dict[int, list[float]] = {}
            for t, v in (p.logit_bias or {}).items():
                if t < n_vocab:
                    entries[t] = [v, 0.0]
            if p.has_penalties and p.penalty_last_n:
                # (all known: a penalised sequence's steps are not queued ahead, needs_host_tokens)
                for t, c in Counter(seq.token_ids[-p.penalty_last_n:]).items():
                    if t < n_vocab:
                        entries.setdefault(t, [0.0, 0.0])[1] = c
            rows += [r] * len(entries)
            ids += entries
            bias += [e[0] for e in entries.values()]
            counts += [e[1] for e in entries.values()]

        def column(name: str, dtype: type) -> np.ndarray:
            return np.array([getattr(p, name) for p in params], dtype)

        return self.backend.sample_rows(logits, SamplingRows(
            column("temperature", np.float32), column("top_k", np.int32), column("top_p", np.float32),
            column("min_p", np.float32), np.array([0.0 if p.greedy else s.rng.random() for s, p in zip(seqs, params)]),
            column("repeat_penalty", np.float32), column("presence_penalty", np.float32),
            column("frequency_penalty", np.float32), np.array(rows, np.int32), np.array(ids, np.int32),
            np.array(bias, np.float32), np.array(counts, np.float32)))

    def sample(self, logits: Array, seqs: list[Sequence]) -> tuple[list[list[int]], list[list[TokenLogprob]]]:
        """Each sequence's new tokens (and, where asked, their log-probabilities): one from its row, or, for a
        sequence verifying ``k`` draft tokens, its k + 1 rows' kept drafts and one more (engine/speculation.py).
        An empty list marks non-finite logits."""
        rows = self.backend.to_host(logits)
        masks = self._masks(seqs, rows.shape[1])
        tokens: list[list[int]] = []
        logprobs: list[list[TokenLogprob]] = []
        r = 0
        for seq in seqs:
            k = len(seq.draft)
            mine = rows[r:r + k + 1]
            r += k + 1
            if k:
                new = verify(mine, seq.draft, seq.params, seq.rng, seq.token_ids)
            else:
                row = np.array(mine[0], np.float32)
                if seq.id in masks:
                    masks[seq.id](row)
                token = sample_row(row, seq.params, seq.rng, seq.token_ids)
                new = [token] if token >= 0 else []
            tokens.append(new)
            top = seq.params.logprobs
            logprobs.append([logprobs_of(mine[i], t, top) for i, t in enumerate(new)] if top is not None else [])
        return tokens, logprobs

    def _masks(self, seqs: list[Sequence], n_vocab: int) -> dict[int, Any]:
        """For each constrained sequence, a function that masks its logits row; all masks computed in one call."""
        constrained = [s for s in seqs if s.constraint is not None]
        if not constrained:
            return {}
        from quanta.engine.constraint import apply_bitmask

        bits = self._batch_masker(n_vocab).compute([s.constraint for s in constrained])
        return {s.id: (lambda row, b=bits[i]: apply_bitmask(row, b)) for i, s in enumerate(constrained)}

    def _batch_masker(self, n_vocab: int) -> Any:
        from quanta.engine.constraint import BatchMasker  # llguidance is loaded when a constraint first samples

        if self._masker is None or self._masker.n_vocab != n_vocab:
            self._masker = BatchMasker(n_vocab)
        return self._masker
