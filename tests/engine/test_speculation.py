"""n-gram speculative decoding: drafting, the gate and its measured step costs (synthetic timings), the verify rule
(exact for greedy, distribution-preserving for sampling: chi-square), and the engine's output with speculation =
without it, whatever the gate decides."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from scipy.stats import chisquare

from quanta.api import LLM
from quanta.engine.sampler import SamplingParams, candidates, verify
from quanta.engine.speculation import AcceptanceHistory, NgramDrafter, SpeculativeConfig
from quanta.engine.step_cost import StepCosts


def test_the_longest_earlier_ngram_proposes_what_followed_it():
    d = NgramDrafter(SpeculativeConfig(max_draft=3, max_ngram=3, extra_token_cost=0.0))
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7]  # suffix (6, 7) occurred at 1..2, followed by 8, 9, 1
    assert d.propose(tokens, room=10) == [8, 9, 1]
    assert d.propose(tokens, room=2) == [8, 9]
    assert d.propose([1, 2, 3, 4], room=5) == []  # no repeat: nothing to draft
    tokens += [3, 3, 3]  # suffix (3, 3, 3) never seen before; (3, 3) ends at index 10: followed by 3
    assert d.propose(tokens, room=5) == [3]


def test_a_drafter_answers_as_a_fresh_one_whatever_it_looked_up_before():
    """The drafter keeps its latest lookup (a step's shadow draft and the next proposal read the same context): its
    answers equal a fresh drafter's as tokens arrive, as a last token changes in place (a sampled token resolved)
    and while it is still unknown (negative)."""
    config = SpeculativeConfig(max_draft=3, max_ngram=3, extra_token_cost=0.0, prior=0.9)
    rng = np.random.default_rng(3)
    d = NgramDrafter(config)
    tokens = rng.integers(0, 6, 8).tolist()
    for _ in range(300):
        tokens.append(int(rng.integers(0, 6)))
        if rng.random() < 0.2:
            d.follow(tokens, len(tokens))
        if rng.random() < 0.1:
            tokens[-1] = (tokens[-1] + 1) % 6
        assert d.propose(tokens, room=3) == NgramDrafter(config).propose(tokens, room=3)
        assert d.propose(tokens + [-1], room=3) == []


def test_the_gate_stops_drafting_when_it_cannot_pay():
    cheap = NgramDrafter(SpeculativeConfig(max_draft=4, extra_token_cost=0.05, prior=0.9))
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert cheap.best_k(2) == 4
    rejected = 0
    while draft := cheap.propose(tokens, room=10):  # drafts after the 2-token match (6, 7)
        assert draft == [8, 9, 1, 2][:len(draft)]
        cheap.record(len(draft), 0)  # every draft rejected
        rejected += 1
    assert 1 <= rejected <= 20 and cheap.best_k(2) == 0
    assert cheap.best_k(3) == 4  # drafts after longer matches keep their own record
    costly = NgramDrafter(SpeculativeConfig(max_draft=4, extra_token_cost=1.0, prior=0.9))
    assert costly.best_k(3) == 0  # a verified token costs a whole step: drafting never wins


def test_a_new_sequence_starts_from_the_rates_its_engine_measured():
    """Drafts after 2-token matches rejected in earlier sequences: a new sequence of the same engine does not
    verify one at the prior first, while drafts after 3-token matches, kept, still pay from its first step."""
    config = SpeculativeConfig(max_draft=4, extra_token_cost=0.2)
    history = AcceptanceHistory(config)
    assert NgramDrafter(config, None, history).best_k(2) > 0  # the prior (0.6) pays at this cost
    for _ in range(10):  # ten finished sequences, each with its own drafter
        earlier = NgramDrafter(config, None, history)
        for _ in range(3):
            earlier.matched = 2
            earlier.record(2, 0)
            earlier.matched = 3
            earlier.record(4, 4)
    fresh = NgramDrafter(config, None, history)
    assert fresh.best_k(2) == 0 and fresh.best_k(3) == 4
    assert NgramDrafter(config).best_k(2) > 0  # without the engine's history: the prior again


def measured(costs: StepCosts, seqs: int = 1, plain: float = 1.0) -> StepCosts:
    for _ in range(2):  # the first plain step of a batch size is not counted
        costs.observe(seqs, 0, plain)
    return costs


def confident(costs: StepCosts | None, rate: float = 0.9) -> NgramDrafter:
    d = NgramDrafter(SpeculativeConfig(max_draft=4), costs)
    d.rates = [rate] * len(d.rates)
    return d


def decode(d: NgramDrafter, costs: StepCosts, steps: int, verify, accept: float) -> tuple[float, float]:
    """``steps`` steps of a sequence that drafts what its gate says, a verify step of k drafts costing
    ``verify(k)`` plain steps and keeping ``accept`` of them on average: (time, tokens)."""
    time = tokens = 0.0
    for _ in range(steps):
        k = d.best_k(3)
        t = verify(k) if k else 1.0
        costs.observe(1, k, t)
        kept = sum(accept ** i for i in range(1, k + 1))  # the expected drafts kept
        d.record(k, round(kept))
        d.rates = [accept] * len(d.rates)  # the sequence's acceptance stays what it is
        time, tokens = time + t, tokens + 1 + kept
    return time, tokens


def test_no_drafts_before_a_plain_step_is_timed_then_the_prior_prices_them():
    costs = StepCosts(0.2, 4)
    d = confident(costs)
    assert d.best_k(3) == 0
    measured(costs)
    assert d.best_k(3) == 4 and costs.relative(4) == pytest.approx(1.8)
    assert measured(StepCosts(0.2, 4), seqs=8).relative(1) == pytest.approx(1 + 0.2 / 2.4)  # a row of 8


def test_a_costly_verify_stops_drafting_and_is_probed_rarely():
    """A verify step costing 5 plain steps never pays (4 drafts make at most 5 tokens): a few verify steps, then
    only probes; at 90% acceptance the steady state is within 2% of plain decoding."""
    costs = measured(StepCosts(0.2, 4))
    d = confident(costs)
    decode(d, costs, 20, lambda k: 5.0, 0.9)
    assert costs.batches[1].verifies <= 3 and costs.relative(4) > 4 and d.best_k(3) == 0
    time, tokens = decode(d, costs, 20_000, lambda k: 5.0, 0.9)
    assert time / tokens < 1.02
    assert costs.batches[1].verifies < 12  # probes, each wait longer than the last


def test_a_cheap_verify_keeps_drafting_and_is_measured():
    costs = measured(StepCosts(0.5, 4))  # a pessimistic prior: 4 drafts at 90% would not pay
    d = confident(costs)
    assert d.best_k(3) in (1, 2)
    for k in (1, 2, 3, 4) * 10:
        costs.observe(1, k, 1.1 + 0.1 * k)
    a, b = costs.batches[1].fit
    assert a == pytest.approx(1.1, abs=0.05) and b == pytest.approx(0.1, abs=0.02)
    assert d.best_k(3) == 4  # measured costs override the prior
    time, tokens = decode(d, costs, 1000, lambda k: 1.1 + 0.1 * k, 0.9)
    assert costs.batches[1].verifies > 900 and tokens / time > 2


def test_a_stray_pause_does_not_stop_drafting():
    costs = measured(StepCosts(0.2, 4))
    for _ in range(10):
        costs.observe(1, 4, 1.8)
    d = confident(costs, rate=0.8)
    k = d.best_k(3)
    costs.observe(1, 4, 200.0)  # a pause: taken as at most 4x the fit
    assert d.best_k(3) > 0
    for _ in range(10):
        costs.observe(1, 4, 1.8)
    assert d.best_k(3) == k
    costs.observe(1, 0, 100.0)
    assert costs.batches[1].plain == pytest.approx(1.2)  # a plain step's time grows at most 2x per step


def test_a_due_probe_waits_only_where_a_draft_is_found():
    """The engine stops queueing steps ahead for a sequence that wants to draft: a probe that is due must not
    make it wait on a context with nothing to draft (on the GPU every step would then lose its overlap)."""
    costs = measured(StepCosts(0.2, 4))
    d = confident(costs)
    for _ in range(3):
        costs.observe(1, 4, 19.0)  # dear verify steps (the H200's, session 45)
    assert d.best_k(3) == 0
    for _ in range(20_000):
        costs.observe(1, 0, 1.0)
    assert costs.probe_due() and d.best_k(3) > 0 and not d.wants_to_draft()
    d.follow([1, 2, 3, 1, 2], 5)  # "1, 2" came before: "3, 1, 2" would follow
    assert d.shadow == (5, [3, 1, 2], 2) and d.wants_to_draft()


def test_shadow_drafts_keep_the_acceptance_rate_while_nothing_is_verified():
    d = confident(None, rate=0.5)
    tokens = [1, 2, 3, 4, 5]
    for _ in range(8):
        for t in (1, 2, 3, 4, 5):  # the cycle repeats: every shadow draft would have been kept
            tokens.append(t)
            d.follow(tokens, len(tokens))
    assert d.rates[3] > 0.85  # every draft followed a 3-token match
    for t in np.random.default_rng(0).integers(1, 6, 60):  # the same tokens at random: drafts fail
        tokens.append(int(t))
        d.follow(tokens, len(tokens))
    assert d.rates[3] < 0.4
    rates = list(d.rates)
    d.follow(tokens + [99, 98], len(tokens))  # tokens past ``known`` are not read
    assert d.rates == rates and d.shadow is not None and d.shadow[0] == len(tokens)


def test_greedy_verify_keeps_exactly_the_argmax_chain():
    rows = np.log(np.array([[.1, .7, .2], [.6, .3, .1], [.2, .2, .6], [.5, .4, .1]], np.float32))
    greedy = SamplingParams(temperature=0)
    rng = np.random.default_rng(0)
    assert verify(rows, [1, 0, 2], greedy, rng, []) == [1, 0, 2, 0]  # all kept, plus one
    assert verify(rows, [1, 2, 2], greedy, rng, []) == [1, 0]  # the second draft is wrong: argmax instead
    assert verify(rows, [0, 0, 2], greedy, rng, []) == [1]
    assert verify(np.full((2, 3), np.nan, np.float32), [1], greedy, rng, []) == []


def test_greedy_verify_from_the_devices_tokens_is_verify():
    """``BatchSampler.verify_greedy`` (a verify step of plain greedy sequences: the rows' greedy tokens read from the
    device, not their logits) keeps what ``verify`` keeps from the logits, sequence by sequence; [] for a
    non-finite row within what is looked at."""
    from types import SimpleNamespace

    from quanta.backends import get_backend
    from quanta.engine.sampler import BatchSampler

    backend = get_backend("cpu", threads=1)
    rng = np.random.default_rng(1)
    greedy = SamplingParams(temperature=0)
    for _ in range(200):
        drafts = [rng.integers(0, 5, rng.integers(0, 4)).tolist() for _ in range(3)]
        rows = rng.standard_normal((sum(len(d) + 1 for d in drafts), 5)).astype(np.float32)
        for r in range(len(rows)):  # drafts mostly right, as a sequence's own n-grams often are
            if rng.random() < 0.6:
                rows[r, rng.integers(0, 5)] = 9.0
        if rng.random() < 0.2:
            rows[rng.integers(0, len(rows))] = np.nan
        seqs, want, o = [], [], 0
        for d in drafts:
            for i, t in enumerate(d):  # draft i right where row i's argmax says so, else a coin
                if rng.random() < 0.7:
                    d[i] = int(np.nan_to_num(rows[o + i], nan=-1).argmax())
            seqs.append(SimpleNamespace(draft=d))
            want.append(verify(rows[o:o + len(d) + 1], d, greedy, rng, []))
            o += len(d) + 1
        assert BatchSampler.verify_greedy(backend.argmax_rows(rows), seqs) == want


def test_sampled_verify_preserves_the_distribution():
    """A deterministic draft changes nothing about what is sampled: the first token follows p0 whatever the draft,
    and the second, given the first was the draft token, follows p1 (chi-square, 20,000 draws)."""
    rows = np.log(np.array([[.5, .3, .15, .05], [.1, .2, .3, .4], [.25, .25, .25, .25]], np.float32))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    p0, p1 = (candidates(r, params) for r in rows[:2])
    rng = np.random.default_rng(1)
    n = 20_000
    outs = [verify(rows, [1, 3], params, rng, []) for _ in range(n)]
    first = Counter(o[0] for o in outs)
    want0 = np.zeros(4)
    want0[p0[0]] = p0[1]
    assert chisquare([first[i] for i in range(4)], want0 * n).pvalue > 1e-3
    second = Counter(o[1] for o in outs if o[0] == 1)
    want1 = np.zeros(4)
    want1[p1[0]] = p1[1]
    m = sum(second.values())
    assert chisquare([second[i] for i in range(4)], want1 * m).pvalue > 1e-3


REPETITIVE = ["Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Repeated: apple,",
              "Copy the sentence: The quick brown fox jumps over the lazy dog. Copy: The quick brown",
              "Count: one two three four five six seven one two three four five six seven one two",
              "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
              "Summarize: Paris is the capital of France. Paris is known for the Eiffel Tower. Summary: Paris",
              "Hello world! Hello world! Hello world! Hello",
              "Once upon a time there was a king. Once upon a time there was a",
              "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"]


@pytest.fixture(scope="module")
def pair(smollm2_path):
    """Plain and speculative engines; the latter's steps all take one tick of its clock (verify steps cost what plain
    ones do: drafting pays wherever a draft is kept)."""
    kw = dict(device="cpu", exact=True, n_ctx=256, max_batched_tokens=64)
    spec = LLM(smollm2_path, speculative="ngram", **kw)
    spec.engine.clock = itertools.count().__next__
    return LLM(smollm2_path, **kw), spec


def test_greedy_with_speculation_is_token_for_token_plain_greedy(pair):
    plain, spec = pair
    kw = dict(max_tokens=40, temperature=0, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(REPETITIVE, **kw)]
    got = spec.generate(REPETITIVE, **kw)
    assert [r.token_ids for r in got] == want
    assert sum(r.stats.accepted_tokens for r in got) > 20  # drafts were proposed and kept
    alone = [spec.generate(p, **kw).token_ids for p in REPETITIVE[:3]]  # one sequence at a time too
    assert alone == want[:3]


def test_speculation_keeps_stops_and_limits(pair):
    plain, spec = pair
    for kw in (dict(max_tokens=7, temperature=0, ignore_eos=True), dict(max_tokens=60, temperature=0),
               dict(max_tokens=30, temperature=0, stop=[" four five"])):
        for p in REPETITIVE[2:4]:
            a, b = plain.generate(p, **kw), spec.generate(p, **kw)
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert spec.engine.blocks.n_used == 0


@pytest.mark.parametrize("verify_ticks", [0, 4])
def test_the_gate_follows_the_measured_cost_with_steps_queued_ahead(pair, monkeypatch, verify_ticks):
    """A verify step costs 1 or 5 plain steps on a clock that ticks as the forward runs; steps are queued ahead
    (as on a device) while no gate drafts. Where verifying is dear the engine soon drafts nothing; the tokens are
    plain greedy's either way."""
    plain, spec = pair
    engine = spec.engine
    ticks = [0.0]
    run = engine.runner.run

    def timed(batch, *args):
        ticks[0] += 1 + verify_ticks * any(seq.draft for seq in batch.seqs)
        return run(batch, *args)

    waits = [0]  # steps that waited for the previous tokens to draft
    drafting = engine._drafting

    def counted() -> bool:
        d = drafting()
        waits[0] += d
        return d

    monkeypatch.setattr(engine.runner, "run", timed)
    monkeypatch.setattr(engine, "_drafting", counted)
    monkeypatch.setattr(engine, "clock", lambda: ticks[0])
    monkeypatch.setattr(engine, "costs", StepCosts(0.2, 4))
    monkeypatch.setattr(engine, "acceptance", AcceptanceHistory(engine.config.speculative))
    monkeypatch.setattr(engine, "asynchronous", True)
    kw = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    want = [r.token_ids for r in plain.generate(REPETITIVE[:4], **kw)]
    got = [spec.generate(p, **kw) for p in REPETITIVE[:4]]
    assert [r.token_ids for r in got] == want
    verifies = sum(r.stats.verify_steps for r in got)
    assert verifies <= 4 if verify_ticks else verifies >= 8
    assert waits[0] <= verifies + 3 * 4  # a step waits to verify drafts, rarely for a lookup that finds none
    assert engine.blocks.n_used == 0


def test_a_verify_step_is_never_left_queued_ahead(pair, monkeypatch):
    """The gate's early answer (``wants_to_draft``, asked before the step's drafts are looked up) may say no draft
    comes while the lookup then finds one (it prices the match it finds, the early answer the match of its shadow
    draft): such a verify step is still read before the next step is scheduled (it was left queued ahead, and the
    next step ran from a context two tokens short: a crash on the GPU)."""
    plain, spec = pair
    answers = itertools.count()
    monkeypatch.setattr(NgramDrafter, "wants_to_draft", lambda self: next(answers) % 3 == 0)
    monkeypatch.setattr(spec.engine, "asynchronous", True)
    kw = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    want = [r.token_ids for r in plain.generate(REPETITIVE[:3], **kw)]
    got = [spec.generate(p, **kw) for p in REPETITIVE[:3]]
    assert [r.token_ids for r in got] == want
    assert sum(r.stats.verify_steps for r in got) >= 6
    assert spec.engine.blocks.n_used == 0
