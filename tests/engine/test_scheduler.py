"""Continuous batching without a model: random arrivals, finishes and aborts over a small pool (hypothesis).

Every request finishes, no block leaks, the step limits hold, and a sequence computes each of its tokens exactly
once between preemptions."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from quanta.engine.block_manager import BlockManager
from quanta.engine.config import EngineConfig
from quanta.engine.sampler import SamplingParams
from quanta.engine.scheduler import Scheduler
from quanta.engine.sequence import Sequence, SequenceStatus
from quanta.engine.stop import StopConditions


class Decoder:
    def push(self, token: int) -> str:
        return "x"

    def flush(self) -> str:
        return ""


def make(i: int, prompt: list[int], max_tokens: int, max_len: int) -> Sequence:
    return Sequence(i, prompt, SamplingParams(temperature=0), StopConditions(max_tokens=max_tokens), Decoder(),
                    frozenset({7}), max_len)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n_requests=st.integers(1, 25), n_blocks=st.integers(4, 40),
       block_size=st.sampled_from([2, 4, 8]), max_seqs=st.integers(1, 6), budget=st.integers(6, 40))
def test_every_request_finishes_without_leaks(seed, n_requests, n_blocks, block_size, max_seqs, budget):
    rnd = random.Random(seed)
    max_len = n_blocks * block_size // 2  # the pool holds at least one full context (as the runner ensures)
    cfg = EngineConfig(max_seqs=max_seqs, max_batched_tokens=max(budget, max_seqs), block_size=block_size)
    bm = BlockManager(n_blocks, block_size)
    sched = Scheduler(cfg, bm)
    pending = [make(i, [rnd.randrange(3) for _ in range(rnd.randint(1, max_len - 1))], rnd.randint(1, 12), max_len)
               for i in range(n_requests)]
    done: list[Sequence] = []
    for _ in range(5000):
        while pending and rnd.random() < 0.4:
            sched.add(pending.pop())
        if not sched.has_work() and not pending:
            break
        batch = sched.schedule()
        assert batch.total_tokens <= cfg.max_batched_tokens
        assert len(sched.running) <= max_seqs
        assert len(set(map(id, batch.seqs))) == len(batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            assert seq.status is SequenceStatus.RUNNING and n >= 1
            assert len(seq.table.blocks) * block_size >= seq.num_computed + n  # slots exist for every token
        samples = [batch.samples(i) for i in range(len(batch))]
        sched.postprocess(batch)
        for seq, sample in zip(batch.seqs, samples):
            if not sample:
                continue
            seq.resolve(seq.reserve(), rnd.choice([1, 2, 7]) if rnd.random() < 0.1 else rnd.randrange(3))
            if seq.finish_reason:
                sched.finish(seq, seq.finish_reason)
                done.append(seq)
        if sched.running and rnd.random() < 0.05:  # an abort midway
            victim = rnd.choice(sched.running)
            sched.finish(victim, "abort")
            done.append(victim)
    assert not pending and not sched.has_work()
    assert len(done) == n_requests and all(s.is_finished for s in done)
    assert bm.n_free == n_blocks and all(b.ref_count == 0 for b in bm.blocks)
    for s in done:
        if s.finish_reason == "length":
            assert s.num_generated == s.stop.max_tokens or s.num_tokens == max_len + 1


def test_preempted_sequence_is_recomputed_and_finishes():
    bm = BlockManager(6, 2)  # 12 slots
    sched = Scheduler(EngineConfig(max_seqs=4, max_batched_tokens=16, block_size=2), bm)
    seqs = [make(i, [1, 2, 1], max_tokens=6, max_len=12) for i in range(3)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work():
        batch = sched.schedule()
        samples = [batch.samples(i) for i in range(len(batch))]
        sched.postprocess(batch)
        for seq, sample in zip(batch.seqs, samples):
            if sample:
                seq.resolve(seq.reserve(), 2)
                if seq.finish_reason:
                    sched.finish(seq, seq.finish_reason)
        steps += 1
        assert steps < 200
    assert sched.preemptions > 0
    assert all(s.num_generated == 6 and s.finish_reason == "length" for s in seqs)
    assert bm.n_free == 6
