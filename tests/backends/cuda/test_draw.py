"""The device sampler (draw.py) against the host sampler (engine/sampler.py's ``sample_row``): the same logits, the
same settings and the same generator state give the same token, for every mix of cut-offs, adjustments and greedy
rows in one batch."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

from quanta.engine.sampler import SamplingParams, sample_row

torch = pytest.importorskip("torch")


class _Seq:
    """What BatchSampler.draw_on_device reads of a sequence."""

    def __init__(self, params: SamplingParams, context: list[int], seed: int):
        self.params, self.token_ids, self.rng = params, context, np.random.default_rng(seed)
        self.constraint, self.draft = None, []


def _settings() -> list[SamplingParams]:
    cuts = [dict(top_k=k, top_p=p, min_p=m) for k, p, m in itertools.product((0, 1, 7, 40, 5000), (1.0, 0.9, 0.0),
                                                                            (0.0, 0.05))]
    out = [SamplingParams(temperature=t, **c) for t, c in itertools.product((0.7, 1.3), cuts)]
    out += [SamplingParams(temperature=0.0, logit_bias={3: 50.0}), SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.9, top_k=0, top_p=1.0, repeat_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.25, penalty_last_n=16, logit_bias={2: 2.5, 7: -1.0, 900: 3.0}),
            SamplingParams(temperature=1.0, top_k=20, top_p=0.8, repeat_penalty=0.8, penalty_last_n=0)]
    return out


def _check_against_host(device: str, settings: list[SamplingParams], logits: np.ndarray, order: str) -> list[int]:
    """The device's tokens for ``logits`` (a row per setting, in ``order``) equal sample_row's, and each sampled row
    took one draw of its generator; returns the tokens, in setting order."""
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.engine.sampler import BatchSampler

    rng = np.random.default_rng(2)
    seqs = [_Seq(p, list(rng.integers(0, logits.shape[1], 40)), seed=i) for i, p in enumerate(settings)]
    rows = list(range(len(seqs)))
    if order == "reversed":  # a row's token does not depend on its batch's order
        rows = rows[::-1]
    want = {r: sample_row(logits[r].copy(), seqs[r].params, copy.deepcopy(seqs[r].rng), seqs[r].token_ids)
            for r in rows}
    be = CUDABackend(device)
    got = be.to_host(BatchSampler(be).draw_on_device(be.from_host(logits[rows]), [seqs[r] for r in rows]))
    assert [int(got[i]) for i in range(len(rows))] == [want[r] for r in rows]
    for s, i in zip(seqs, itertools.count()):
        assert s.rng.random() == np.random.default_rng(i).random(1 + (not s.params.greedy))[-1]
    return [want[r] for r in range(len(seqs))]


@pytest.mark.parametrize("order,fused", [("given", True), ("reversed", False)])
def test_device_draws_equal_the_host_sampler(device: str, order: str, fused: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused``: cut rows drawn by torch.topk and one kernel (their candidates fit it), else by the torch ops."""
    from quanta.backends.cuda import draw

    if not fused:
        monkeypatch.setattr(draw, "FUSED_MAX_K", 0)
    rng = np.random.default_rng(1)
    settings = _settings() + [SamplingParams(temperature=0.8)]
    logits = (rng.standard_normal((len(settings), 600)) * 3).astype(np.float32)
    logits[-1, 11] = np.nan  # a broken row: -1
    assert _check_against_host(device, settings, logits, order)[-1] == -1


def test_two_kernel_draws_equal_the_host_sampler(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows cut to at most TOP_MAX candidates, found block by block (blocks of 128 here, the last three past the
    row's end), with ties (the lower id first, as the host), -inf logits and a NaN."""
    from quanta.backends.cuda import draw

    monkeypatch.setattr(draw, "MIN_TOP_BLOCK", 128)
    assert draw._top_blocks(600, 7) == (8, 128, 8)
    cuts = [dict(top_k=k, top_p=p, min_p=m) for k, (p, m) in itertools.product((1, 2, 7), ((1.0, 0.0), (0.9, 0.05)))]
    settings = [SamplingParams(temperature=1.3, **c) for c in cuts] + [
        SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=7, repeat_penalty=1.3,
                                                        logit_bias={2: 2.5, 900: 3.0}),
        SamplingParams(temperature=5.0, top_k=7, top_p=1.0, min_p=0.0), SamplingParams(temperature=0.8, top_k=7)]
    rng = np.random.default_rng(3)
    logits = np.round(rng.standard_normal((len(settings), 600)) * 2, 1).astype(np.float32)  # many equal logits
    logits[:, [50, 450]] = logits.max(axis=1, keepdims=True) + 1.0  # two equal largest, in different blocks
    logits[-2, :590] = -np.inf  # ten finite candidates, seven kept
    logits[-1, 599] = np.nan
    tokens = _check_against_host(device, settings, logits, "given")
    assert tokens[0] == tokens[1] == 50 and tokens[-1] == -1 and 590 <= tokens[-2] < 600


def test_device_draws_follow_the_distribution(device: str) -> None:
    """Many draws of one row (different uniforms) land on the surviving tokens in their renormalised proportions."""
    from quanta.backends.base import SamplingRows
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.engine.sampler import candidates

    row = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.85, min_p=0.0)
    n = 4000
    u = (np.arange(n) + 0.5) / n  # evenly spread draws: frequencies are the probabilities to 1/n
    r = np.ones(n, np.float32)
    be = CUDABackend(device)
    empty = np.zeros(0, np.int32)
    tokens = be.to_host(be.sample_rows(be.from_host(np.tile(row, (n, 1))), SamplingRows(
        r * params.temperature, np.zeros(n, np.int32), r * params.top_p, r * 0, u, r, r * 0, r * 0, empty, empty,
        empty.astype(np.float32), empty.astype(np.float32))))
    ids, probs = candidates(row.copy(), params)
    counts = np.bincount(tokens, minlength=row.size) / n
    assert sorted(ids.tolist()) == [0, 1, 2, 3]
    np.testing.assert_allclose(counts[ids], probs, atol=1.5 / n)
    assert counts[4:].sum() == 0


def test_the_engine_samples_on_the_device_as_on_the_host(tmp_path, device: str, few_programs: None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded sampled requests through the batched engine with its steps queued ahead (device sampling, only the
    tokens read back) give the tokens the host path gives (logprobs asked: the logits read back and sampled by
    sample_row), and the same tokens each alone; a penalised request beside them stops the queueing ahead."""
    from dataclasses import replace

    from quanta import gguf
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.engine import LLMEngine, StopConditions
    from quanta.engine.config import EngineConfig
    from quanta.models import load_model
    from quanta.synth import get_preset, synthesize
    from quanta.tokenizer import load_tokenizer

    path = tmp_path / "small.gguf"
    preset = replace(get_preset("smollm2-135m"), n_layers=1, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                     vocab_size=512)
    synthesize(preset, path, "Q8_0", std=0.5, progress=False)
    prompts = [[5, 9, 100, 200, 7], [11, 12, 13], [300, 301, 302, 303, 304, 305, 306, 307, 308]]
    settings = [SamplingParams(temperature=1.5, seed=3), SamplingParams(temperature=2.0, top_k=0, top_p=0.9, seed=4),
                SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5),
                SamplingParams(temperature=1.2, repeat_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 4.0},
                               seed=6)]
    be = CUDABackend(device, exact=True, graphs=False)
    model, tokenizer = load_model(gguf.open(path), be, 64), load_tokenizer(gguf.open(path))

    def run(jobs: list[tuple[list[int], SamplingParams]], host: bool) -> tuple[list[list[int]], int]:
        engine = LLMEngine(model, be, tokenizer, EngineConfig(max_seqs=4, kv_blocks=16), 64)
        engine.asynchronous = True
        drawn = []
        draw = engine.sampler.draw_on_device
        monkeypatch.setattr(engine.sampler, "draw_on_device", lambda x, seqs: drawn.append(1) or draw(x, seqs))
        ids = [engine.add_request(p, replace(s, logprobs=0) if host else s, StopConditions(max_tokens=6,
                                                                                          ignore_eos=True))
               for p, s in jobs]
        out: dict[int, list[int]] = {i: [] for i in ids}
        ahead = 0
        while engine.has_unfinished():
            for r in engine.step():
                out[r.request_id].extend(r.new_token_ids)
            ahead += engine._inflight is not None
        assert len(drawn) == (0 if host else 6)
        return [out[i] for i in ids], ahead

    jobs = list(zip(prompts, settings))
    device_tokens, ahead = run(jobs, host=False)
    assert ahead >= 4  # steps queued ahead while only unpenalised requests ran
    host_tokens, _ = run(jobs, host=True)
    assert device_tokens == host_tokens and all(len(t) == 6 for t in device_tokens)
    assert device_tokens[:3] == [run([job], host=False)[0][0] for job in jobs[:3]]
    with_penalties, ahead = run(jobs + [(prompts[0], settings[3])], host=False)
    assert with_penalties[:3] == device_tokens and ahead == 0
    assert with_penalties[3] == run([(prompts[0], settings[3])], host=True)[0][0]
    assert len({tuple(t) for t in device_tokens}) == 3


def test_the_compile_ahead_warm_up_takes_any_vocabulary(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """draw.warm_up (run inside compile-ahead dry runs) launches a draw for logits of any width, narrower than the
    default top-k too (where it once asked torch.topk for more candidates than the row has)."""
    from quanta.backends.cuda import draw

    monkeypatch.setattr(draw, "MIN_TOP_BLOCK", 128)
    for vocab in (30, 40, 300):
        draw.warm_up(torch.randn(2, vocab, device=device))
