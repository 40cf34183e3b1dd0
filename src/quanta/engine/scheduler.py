"""Continuous batching: which sequences run in the next forward, and how many of their tokens.

Each step fills a token budget (``max_batched_tokens``) in three passes: every decoding sequence's next token
(oldest first), then the next chunk of sequences still prefilling, then waiting requests, first come first served,
while ``max_seqs`` and free blocks allow (a request is admitted with blocks for its whole prompt, after its prefix
is matched against the cache). Long prompts are prefilled in chunks of what the budget leaves. When a running
sequence needs a block and none is free, the newest running sequence is preempted: its blocks are freed (full
ones stay cached) and it waits at the front of the queue, to be recomputed. The pool holds at least one full
context, so a sequence alone always fits: no deadlock, and every request finishes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from quanta.engine.block_manager import BlockManager
from quanta.engine.config import EngineConfig
from quanta.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The sequences of one forward and how many tokens each computes (from its ``num_computed`` on)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence i's chunk reaches its last token (so the forward yields its next token's logits; with
        draft tokens after it, theirs too)."""
        seq = self.seqs[i]
        return seq.num_computed + self.num_tokens[i] - len(seq.draft) == seq.num_tokens

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
        if seq.first_scheduled is None:
            seq.first_scheduled = time.perf_counter()


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager):
        assert config.max_seqs and config.max_batched_tokens, "pass a resolved EngineConfig"
        self.max_seqs, self.budget = config.max_seqs, config.max_batched_tokens
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # since the start

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.budget
        preempted = self.preemptions
        for prefilling in (False, True):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.in_prefill != prefilling or seq.status is not SequenceStatus.RUNNING or seq.at_limit:
                    continue  # (at its limit: ends when its last token's step completes)
                n = min(seq.num_tokens - seq.num_computed, budget)
                if seq.drafter is not None and not prefilling:
                    seq.draft = seq.drafter.propose(seq.token_ids, min(seq.room, budget - n))
                    n += len(seq.draft)
                if self._make_room(seq, seq.num_computed + n, batch):
                    batch.add(seq, n)
                    budget -= n
                else:
                    seq.draft = []
        # after a preemption, blocks are short: admit nobody this step (a preempted sequence would only churn)
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs and self.preemptions == preempted:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            n = min(seq.num_tokens - seq.num_computed, budget)
            batch.add(seq, n)
            budget -= n
        return batch

    def postprocess(self, batch: ScheduledBatch) -> None:
        """Once the forward is queued: the batch's tokens count as computed (their full blocks become shareable
        when the sampled tokens are known: ``BlockManager.register_full``)."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End ``seq`` (finished, aborted or failed): out of the queues, its blocks freed."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.table)
        seq.finish(reason, error)

    def _admit(self, seq: Sequence) -> bool:
        """Match ``seq``'s prefix and give it blocks for all its tokens; False (nothing held) when they don't fit."""
        cached = self.blocks.match_prefix(seq.table, seq.token_ids)
        if not self.blocks.grow(seq.table, seq.num_tokens):
            self.blocks.free(seq.table)
            self.blocks.hits -= cached
            return False
        if seq.num_generated == 0:
            seq.stats.cached_tokens = cached
        seq.num_computed = cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _make_room(self, seq: Sequence, n_tokens: int, batch: ScheduledBatch) -> bool:
        """Blocks for ``n_tokens`` positions of the running ``seq``, preempting the newest running sequences not in
        ``batch`` until they fit; False when ``seq`` itself had to go."""
        while not self.blocks.grow(seq.table, n_tokens):
            victim = next(s for s in reversed(self.running) if s not in batch.seqs)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        seq.draft = []
        self.running.remove(seq)
        self.blocks.free(seq.table)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
