"""What a decode step costs on this backend, as the engine times it: the prices of the speculation gate.

For each batch size (sequences in a decode step): the time of a plain step (one token per sequence), and the time
of a verify step with ``d`` draft rows in all relative to it, fitted as ``a + b*d`` (a: verifying at all, e.g. a
step outside the captured CUDA graphs, its logits read on the host; b: each draft row) by least squares over the
recent verify steps, with a prior as two light pseudo-observations (the fit until steps are measured): each row
costs ``extra_token_cost`` of a one-sequence step, so ``b = c / (1 + c*(seqs - 1))``. A step's time is the wall
time since the previous step completed (or since it was scheduled, if later): steps queued back to back complete
one step apart.

Against stray times: the first plain and the first verify step of each batch size are not counted (compiles, graph
captures), a plain time grows at most 2x per step and a relative cost is taken at most 4x the fit's, so one pause
cannot stop speculation for long.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLAIN_WEIGHT = 0.2  # of a new plain step in the moving average
DECAY = 0.85  # of the verify steps measured before, per new one (about the last seven count)
PRIOR_WEIGHT = 0.1  # of each of the prior's two pseudo-observations (a measured step weighs 1)
PROBE_STEPS = 100  # steps between probes, per plain step a probe loses (and doubled per probe in a row): <= 1%


def line(fit: tuple[float, float], k: int) -> float:
    """A step with ``k`` draft rows, in plain steps, for ``fit`` = (a, b)."""
    a, b = fit
    return a + b * k if k else 1.0


@dataclass
class BatchCost:
    """One batch size's measurements: ``plain`` seconds (None: not yet), ``fit`` (a, b), ``verifies`` measured."""

    prior: tuple[float, float]
    max_draft: int
    plain: float | None = None
    fit: tuple[float, float] = field(init=False)
    verifies: int = 0
    seen: set[bool] = field(default_factory=set)  # whether a plain / a verify step came (the first is not counted)
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # Σw, Σw·d, Σw·d², Σw·y, Σw·d·y, decayed

    def __post_init__(self) -> None:
        self.fit = self.prior

    def observe(self, drafts: int, seconds: float) -> None:
        """A step of this batch size with ``drafts`` draft rows in all took ``seconds``."""
        if seconds <= 0:  # nothing measured (a coarse clock)
            return
        if bool(drafts) not in self.seen:
            self.seen.add(bool(drafts))
        elif not drafts:
            self.plain = seconds if self.plain is None else self.plain + PLAIN_WEIGHT * (
                min(seconds, 2 * self.plain) - self.plain)
        elif self.plain is not None:
            y = min(seconds / self.plain, 4 * line(self.fit, drafts))
            self.sums = [DECAY * s + v for s, v in zip(self.sums, (1, drafts, drafts * drafts, y, drafts * y))]
            self.fit = self._solve()
            self.verifies += 1

    def _solve(self) -> tuple[float, float]:
        """Weighted least squares of y = a + b·d over the verify steps and the prior's points at d = 1 and
        d = max_draft, held to a >= 1 (a verify step does a plain step's work and more) and b >= 0."""
        (a0, b0), p = self.prior, PRIOR_WEIGHT
        w, sd, sdd, sy, sdy = self.sums
        for d in (1, self.max_draft):
            y = a0 + b0 * d
            w, sd, sdd, sy, sdy = w + p, sd + p * d, sdd + p * d * d, sy + p * y, sdy + p * d * y
        det = w * sdd - sd * sd
        b = (w * sdy - sd * sy) / det if det > 1e-9 * w * sdd else self.fit[1]
        a = (sy - b * sd) / w
        if b < 0:
            a, b = sy / w, 0.0
        if a < 1:
            a, b = 1.0, max(0.0, (sdy - sd) / sdd)
        return a, b


class StepCosts:
    """The measured cost of a step with ``k`` drafts relative to a plain step of the latest batch size
    (:attr:`fit`, :meth:`relative`), and when to measure it again where it says drafting loses (:meth:`probe_due`). One per
    engine, shared by its drafters."""

    def __init__(self, extra_token_cost: float, max_draft: int):
        self.extra_token_cost, self.max_draft = extra_token_cost, max_draft
        self.batches: dict[int, BatchCost] = {}  # sequences in the step → its costs
        self.seqs = 1  # sequences of the latest decode step
        self.steps = 0  # decode steps seen
        self._last_verify = 0  # ``steps`` at the latest verify step
        self._probes = 0  # verify steps in a row, each after a long wait: probes

    @property
    def measured(self) -> bool:
        """Whether a plain step of the latest batch size is timed (a verify step can then be priced)."""
        return self._batch().plain is not None

    @property
    def fit(self) -> tuple[float, float]:
        """(a, b) of the latest batch size: a step with k draft rows costs a + b*k of its plain steps."""
        return self._batch().fit

    @property
    def prior_fit(self) -> tuple[float, float]:
        """:attr:`fit` as the prior has it."""
        return self._batch().prior

    def relative(self, k: int) -> float:
        """A step with ``k`` draft rows in plain steps of the same batch, as measured (the prior until then)."""
        return line(self._batch().fit, k)

    def probe_due(self) -> bool:
        """Whether to verify drafts that the fit says lose, to measure them again: after ``PROBE_STEPS`` steps times
        the plain steps a probe loses, doubled for each probe in a row (so probing costs at most ~1% of the time)."""
        loss = max(1.0, self.relative(self.max_draft) - 1)
        return self.steps - self._last_verify >= PROBE_STEPS * loss * 2 ** min(self._probes, 10)

    def observe(self, seqs: int, drafts: int, seconds: float) -> None:
        """A decode step of ``seqs`` sequences and ``drafts`` draft rows in all took ``seconds``."""
        self.steps += 1
        self.seqs = seqs
        if drafts:
            self._probes = self._probes + 1 if self.steps - self._last_verify > PROBE_STEPS else 0
            self._last_verify = self.steps
        self._batch().observe(drafts, seconds)

    def _batch(self) -> BatchCost:
        batch = self.batches.get(self.seqs)
        if batch is None:
            c = self.extra_token_cost
            batch = self.batches[self.seqs] = BatchCost((1.0, c / (1 + c * (self.seqs - 1))), self.max_draft)
        return batch
