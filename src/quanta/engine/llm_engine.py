"""The engine: requests in, one batched step at a time, outputs out.

A step is schedule → run → sample → postprocess: the scheduler picks the batch, the model runner computes its
logits, the sampler picks each finishing chunk's next token, and the sequences take their tokens (detokenized,
stop conditions checked). With speculation on, each decode step is timed: the gate prices drafts with what steps
cost on this backend (``StepCosts``). The engine is not thread-safe: one loop (the API's streams, the server) owns
it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence as Seq
from typing import Any

import numpy as np

from quanta.backends.base import Backend
from quanta.engine.block_manager import BlockManager, BlockTable
from quanta.engine.config import EngineConfig
from quanta.engine.model_runner import ModelRunner
from quanta.engine.outputs import RequestOutput, TokenLogprob
from quanta.engine.sampler import BatchSampler, SamplingParams, draws_on_device, needs_host_tokens, on_device
from quanta.engine.scheduler import ScheduledBatch, Scheduler
from quanta.engine.sequence import PENDING, Sequence
from quanta.engine.speculation import AcceptanceHistory, NgramDrafter
from quanta.engine.step_cost import StepCosts
from quanta.engine.stop import StopConditions
from quanta.errors import ContextOverflowError, QuantaError
from quanta.models.base import Model

NON_FINITE = ("the model produced non-finite logits (NaN or inf): its weights are probably corrupt "
              "(`quanta inspect --check MODEL` scans them); or the output constraint allowed no token")


@dataclass
class Launched:
    """A queued step: its batch, the sequences it samples for, the indices their tokens were reserved at, and the
    tokens (on the device, or already on the host), with ``rows``: (sequence id, index) → row of ``tokens``;
    ``started``: when it was scheduled; ``shape``: (sequences, draft rows) of a decode step that is timed."""

    batch: ScheduledBatch
    sampling: list[Sequence]
    indices: list[int]
    started: float = 0.0
    shape: tuple[int, int] | None = None
    tokens: Any = None
    read_tokens: Callable[[], np.ndarray] | None = None
    host_tokens: list[list[int]] | None = None
    logprobs: list[list[TokenLogprob]] | None = None
    rows: dict[tuple[int, int], int] = field(default_factory=dict)
    masked: Any = None  # the logits of constrained greedy rows, until their masks can be made


class LLMEngine:
    """Continuous batching over a paged KV cache for one model on one backend (see the package's modules)."""

    def __init__(self, model: Model, backend: Backend, tokenizer: Any, config: EngineConfig, n_ctx: int,
                 clock: Callable[[], float] = time.perf_counter):
        self.config = config.resolved(backend.name)
        self.model, self.backend, self.tokenizer, self.n_ctx = model, backend, tokenizer, n_ctx
        self.runner = ModelRunner(model, backend, self.config, n_ctx)
        self.blocks = BlockManager(self.runner.n_blocks, self.config.block_size, self.config.prefix_caching)
        self.scheduler = Scheduler(self.config, self.blocks)
        self.sampler = BatchSampler(backend)
        self.requests: dict[int, Sequence] = {}
        self._ended: list[Sequence] = []  # ended outside a step (aborted, nothing to generate): reported next step
        self.asynchronous = backend.asynchronous
        self._on_host = 0  # live requests whose sampling needs their tokens on the host (no step overlap while any)
        self._inflight: Launched | None = None
        self._ids = itertools.count()
        spec = self.config.speculative
        self.costs = StepCosts(spec.extra_token_cost, spec.max_draft) if spec is not None else None
        self.acceptance = AcceptanceHistory(spec) if spec is not None else None
        self.clock = clock
        self._done = 0.0  # when the latest step completed

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Seq[int], params: SamplingParams, stop: StopConditions,
                    constraint: Any = None) -> int:
        """Queue a request; returns its id. A prompt that can never run is refused here (ValueError,
        ContextOverflowError); everything else is reported through :meth:`step`'s outputs."""
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("the prompt is empty (no tokens)")
        if len(prompt) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.n_ctx} (prompt + at least one "
                f"generated token); shorten the prompt or raise n_ctx")
        spec = self.config.speculative
        drafter = NgramDrafter(spec, self.costs, self.acceptance) if spec is not None and constraint is None else None
        # constrained text is exactly what the grammar accepted: special tokens it names (tool-call tags) kept,
        # no space clean-up
        decoder = self.tokenizer.stream_decoder(skip_special=constraint is None, clean=constraint is None)
        seq = Sequence(next(self._ids), prompt, params, stop, decoder, frozenset(self.tokenizer.eog_ids), self.n_ctx,
                       constraint, drafter)
        self.requests[seq.id] = seq
        if stop.max_tokens == 0:
            seq.finish("length")
            self._ended.append(seq)
            return seq.id
        if needs_host_tokens(seq, self.backend):
            self._on_host += 1
        self.scheduler.add(seq)
        return seq.id

    def abort(self, request_id: int) -> None:
        """Stop a request now (its blocks are freed); its last output says ``finish_reason="abort"``."""
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            self._end(seq, "abort")
            self._ended.append(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._ended) or self._inflight is not None

    def release(self, request_id: int) -> Sequence | None:
        """Forget a finished request (its caller has read its result)."""
        return self.requests.pop(request_id, None)

    # ---- the step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled batch; an output for each request that gained tokens or finished.

        On an asynchronous backend, while every live request is plain greedy or sampled on the device without
        penalties (sampler.py's ``needs_host_tokens``), the forward is queued before the previous step's tokens are
        read (its inputs come from those tokens on the device): the host's work overlaps the device's. A request
        that stops (end-of-generation token, stop string) is then found one step late; the extra step's token is
        dropped. A step in which a gate drafts waits for the tokens (drafts are looked up in them), and a step that
        verifies drafts is read before the next one is scheduled, even where the gates' early answer
        (``_drafting``) said no draft would come: its accepted tokens are the next step's inputs. A step with
        constrained rows queues its argmax only after the previous step's tokens have advanced the grammars: their
        masks are made while its forward runs."""
        started = self.clock()
        outputs = [self._finished(seq) for seq in self._ended]
        self._ended.clear()
        overlap = self.asynchronous and self._on_host == 0 and not self._drafting()
        if self._inflight is not None and not overlap:
            outputs += self._complete(self._inflight)
            self._inflight = None
        batch = self.scheduler.schedule()
        overlap = overlap and not any(seq.draft for seq in batch.seqs)
        launched = self._launch(batch, started) if batch.seqs else None
        if self._inflight is not None:
            outputs += self._complete(self._inflight)
        if launched is not None and launched.masked is not None:
            self._pick_on_device(launched, launched.masked, constrained=True)
        self._inflight = launched if overlap else None
        if launched is not None and not overlap:
            outputs += self._complete(launched)
        return outputs

    def _drafting(self) -> bool:
        """Whether a running sequence drafts in this step (``NgramDrafter.wants_to_draft``: waiting for the tokens
        without a draft to verify would only stop the queueing ahead)."""
        return self.costs is not None and any(seq.drafter is not None and seq.drafter.wants_to_draft()
                                              for seq in self.scheduler.running)

    def _launch(self, batch: ScheduledBatch, started: float) -> Launched:
        """Queue ``batch``'s forward and its sampling; each sampling sequence reserves its next token."""
        previous = self._inflight
        captures = self.runner.captures
        logits = self.runner.run(batch, previous.tokens if previous else None, previous.rows if previous else None)
        sampling = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
        launched = Launched(batch, sampling, [], started=started)
        if self.costs is not None and len(sampling) == len(batch) and all(
                n == 1 + len(seq.draft) for seq, n in zip(batch.seqs, batch.num_tokens)) and (
                self.runner.captures == captures):  # no prefill chunk, no graph recorded
            launched.shape = (len(batch), sum(len(seq.draft) for seq in batch.seqs))
        if sampling and all(on_device(seq) for seq in sampling):
            if any(seq.constraint is not None for seq in sampling):
                launched.masked = logits  # masks follow the tokens of the step before: made once they are read
            else:
                self._pick_on_device(launched, logits)
        elif sampling and self.backend.samples_on_device and all(draws_on_device(seq) for seq in sampling):
            tokens = self.sampler.draw_on_device(logits, sampling)  # before the reservations (penalties)
            launched.tokens, launched.read_tokens = tokens, self.backend.to_host_later(tokens)
        elif sampling:  # before the reservations: penalties read the context
            launched.host_tokens, launched.logprobs = self.sampler.sample(logits, sampling)
        self.scheduler.postprocess(batch)
        launched.indices = [seq.reserve() for seq in sampling]
        launched.rows = {(seq.id, index): row for row, (seq, index) in enumerate(zip(sampling, launched.indices))}
        return launched

    def _pick_on_device(self, launched: Launched, logits: Any, constrained: bool = False) -> None:
        """Queue the argmax of ``launched``'s rows (``constrained``: masked where a sequence has a constraint, the
        masks made now from each grammar's state) and the copy of its tokens."""
        launched.masked = None
        best = self.sampler.masked_on_device(logits, launched.sampling) if constrained else None
        if best is None:
            best = self.runner.greedy(logits)
        if any(seq.draft for seq in launched.sampling):  # a verify step: every row's greedy token, read now
            launched.host_tokens = self.sampler.verify_greedy(self.backend.to_host(best), launched.sampling)
        else:
            launched.tokens, launched.read_tokens = best, self.backend.to_host_later(best)

    def _complete(self, launched: Launched) -> list[RequestOutput]:
        """Read ``launched``'s tokens and hand them to their sequences (stops, text, finishing)."""
        tokens = launched.host_tokens
        if tokens is None:
            tokens = [[int(t)] if t >= 0 else [] for t in launched.read_tokens()] if launched.read_tokens else []
        logprobs = launched.logprobs or [[] for _ in tokens]
        outputs = []
        for seq, index, new, lps in zip(launched.sampling, launched.indices, tokens, logprobs):
            if seq.is_finished:  # stopped a step earlier, or aborted: this token was never asked for
                continue
            if not new:
                self._end(seq, "error", NON_FINITE)
                outputs.append(self._finished(seq))
                continue
            if seq.draft:
                self._settle_draft(seq, len(new) - 1)
            kept: list[int] = []
            text = ""
            resolved = 0
            for i, token in enumerate(new):
                text += seq.resolve(index if i == 0 else seq.reserve(), token, lps[i] if lps else None)
                resolved = i + 1
                if token not in seq.eog:
                    kept.append(token)
                if seq.finish_reason is not None:
                    break
            if seq.drafter is not None and seq.finish_reason is None:  # after a verify step: a fresh shadow
                seq.drafter.follow(seq.token_ids, index + resolved)
            kept_lps = lps[:len(kept)]
            self._register(seq)  # before a finished sequence frees its blocks: they stay cached for later requests
            if seq.finish_reason is not None:
                self._end(seq, seq.finish_reason)
                outputs.append(self._finished(seq, kept, text, kept_lps))
            else:
                outputs.append(RequestOutput(seq.id, kept, text, logprobs=kept_lps))
        for seq in launched.batch.seqs:
            if not seq.is_finished:
                self._register(seq)
        now = self.clock()
        if launched.shape is not None and self.costs is not None:
            self.costs.observe(*launched.shape, now - max(self._done, launched.started))
        self._done = now
        return outputs

    def _register(self, seq: Sequence) -> None:
        """Make the sequence's full blocks whose tokens are all computed and known shareable (only the tokens past
        its registered blocks are looked at: a step costs the same at any context length)."""
        known = min(seq.num_computed, len(seq.token_ids))
        start = len(seq.table.keys) * self.blocks.block_size
        if PENDING in seq.token_ids[start:known]:
            known = seq.token_ids.index(PENDING, start)
        self.blocks.register_full(seq.table, seq.token_ids, known)

    def _settle_draft(self, seq: Sequence, accepted: int) -> None:
        """After a verify step: the rejected drafts' K/V are dropped (written past what is kept, in blocks no
        longer needed, or overwritten by the next tokens)."""
        rejected = len(seq.draft) - accepted
        seq.drafter.record(len(seq.draft), accepted)
        seq.stats.draft_tokens += len(seq.draft)
        seq.stats.accepted_tokens += accepted
        seq.stats.verify_steps += 1
        seq.num_computed -= rejected
        seq.draft = []
        self.blocks.truncate(seq.table, seq.num_computed + 1)

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if needs_host_tokens(seq, self.backend):
            self._on_host -= 1
        self.scheduler.finish(seq, reason, error)

    @staticmethod
    def _finished(seq: Sequence, new: list[int] | None = None, text: str = "",
                  logprobs: list | None = None) -> RequestOutput:
        return RequestOutput(seq.id, new or [], text, True, seq.finish_reason, seq.error, logprobs or [], seq.stats)

    # ---- scoring and the cache -------------------------------------------------------------------------------
    def score(self, token_ids: Seq[int]) -> np.ndarray:
        """float32 (n, vocab): row i holds the next-token logits after token_ids[:i+1] (teacher forcing), computed
        in blocks of the pool that are freed afterwards (running requests are not disturbed)."""
        ids = list(token_ids)
        if len(ids) > self.n_ctx:
            raise ContextOverflowError(f"{len(ids)} tokens do not fit in the context of {self.n_ctx}; raise n_ctx")
        table = BlockTable()
        if not self.blocks.grow(table, len(ids)):
            raise QuantaError(f"the KV pool has no room for {len(ids)} more tokens now; retry when requests finish")
        try:
            return self.runner.score(ids, table.blocks, self.config.max_batched_tokens)
        finally:
            self.blocks.free(table)

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()
