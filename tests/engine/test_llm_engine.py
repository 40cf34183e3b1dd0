"""The batched engine on SmolLM2: a sequence's tokens do not depend on what else is in its batch (exact mode),
through prefix sharing, chunked prefill, preemption and aborts; failures stay with their request."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from quanta.api import LLM
from quanta.errors import ContextOverflowError, QuantaError

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,",
           "def fibonacci(n):", "The capital of France is a city that",  # shares a prefix with the first
           "List three colours:", "1, 2, 3, 4,"]
GREEDY = dict(max_tokens=14, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def exact(smollm2_path):
    return LLM(smollm2_path, device="cpu", exact=True, n_ctx=128, max_seqs=8, max_batched_tokens=32)


@pytest.fixture(scope="module")
def alone(exact):
    out = []
    for p in PROMPTS:
        exact.engine.reset_prefix_cache()
        out.append(exact.generate(p, **GREEDY).token_ids)
    return out


def test_batched_equals_alone_exact(exact, alone):
    exact.engine.reset_prefix_cache()
    batched = exact.generate(PROMPTS, **GREEDY)  # 32-token budget: prompts prefill in chunks beside decodes
    assert [r.token_ids for r in batched] == alone
    assert batched[3].stats.cached_tokens == 0 or batched[3].stats.cached_tokens % 16 == 0


def test_preempted_sequences_give_the_same_tokens(smollm2_path, alone):
    # 10 blocks of 16 tokens for up to 6 sequences of ~30 tokens each: the scheduler must preempt and recompute
    small = LLM(smollm2_path, device="cpu", exact=True, n_ctx=128, max_seqs=6, kv_blocks=10)
    batched = small.generate(PROMPTS, **GREEDY)
    assert small.engine.scheduler.preemptions > 0
    assert [r.token_ids for r in batched] == alone
    assert small.engine.blocks.n_free == small.engine.blocks.n_blocks


def test_abort_midway_leaves_the_others_untouched(exact, alone):
    exact.engine.reset_prefix_cache()
    streams = [exact.stream(p, **GREEDY) for p in PROMPTS[:3]]
    next(streams[1])
    next(streams[1])
    streams[1].close()  # aborts request 1 after two pieces
    texts = ["".join(streams[i]) for i in (0, 2)]
    assert texts == [exact.detokenize(alone[0]), exact.detokenize(alone[2])]
    assert exact.engine.blocks.n_used == 0  # the aborted request freed its blocks


def test_steps_queued_ahead_give_the_same_tokens(exact, alone):
    """A device backend queues each step before the previous step's tokens are read (inputs fed on the device):
    forced here on the CPU. Stops are found a step late; the tokens, the stop and the blocks stay right."""
    exact.engine.asynchronous = True
    try:
        exact.engine.reset_prefix_cache()
        assert [r.token_ids for r in exact.generate(PROMPTS, **GREEDY)] == alone
        full = exact.detokenize(alone[5])
        cut = exact.generate(PROMPTS[5], **{**GREEDY, "stop": [full[5:8]]})
        assert cut.finish_reason == "stop" and cut.text == full[:5]
        eos = exact.chat([{"role": "user", "content": "Say hi."}], max_tokens=100, temperature=0)
        assert eos.finish_reason == "stop" and not set(eos.token_ids) & set(exact.tokenizer.eog_ids)
        assert exact.engine.blocks.n_used == 0
        follow = exact.tokenize(PROMPTS[5]) + cut.token_ids + exact.tokenize(" 7,")
        warm = exact.generate(follow, **GREEDY)
        exact.engine.reset_prefix_cache()
        assert warm.token_ids == exact.generate(follow, **GREEDY).token_ids
    finally:
        exact.engine.asynchronous = False


def test_a_queued_step_reads_the_last_steps_tokens_after_it(exact, alone, monkeypatch):
    """Overlap: each step's tokens are fetched through ``to_host_later`` (a device backend's copy behind an event,
    which waits for that step alone) and read only once the next step has been queued."""
    events: list[str] = []
    be, runner = exact.backend, exact.engine.runner
    run, later = runner.run, be.to_host_later

    def launch(*args, **kwargs):
        events.append("launch")
        return run(*args, **kwargs)

    def fetch(a):
        read = later(a)
        return lambda: events.append("read") or read()

    monkeypatch.setattr(runner, "run", launch)
    monkeypatch.setattr(be, "to_host_later", fetch)
    monkeypatch.setattr(exact.engine, "asynchronous", True)
    exact.engine.reset_prefix_cache()
    assert exact.generate(PROMPTS[0], **GREEDY).token_ids == alone[0]
    assert events[:3] == ["launch", "launch", "read"]  # step 1's tokens read after step 2 was queued
    launches = reads = 0
    for e in events[:-1]:
        launches, reads = launches + (e == "launch"), reads + (e == "read")
        assert e == "launch" or reads < launches  # every read but the last has a later step queued
    assert events[-1] == "read" and reads + 1 == launches


def test_streams_from_two_threads(exact, alone):
    results: dict[int, str] = {}

    def consume(i: int) -> None:
        results[i] = "".join(exact.stream(PROMPTS[i], **GREEDY))

    threads = [threading.Thread(target=consume, args=(i,)) for i in (0, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {0: exact.detokenize(alone[0]), 4: exact.detokenize(alone[4])}


def test_generate_while_a_stream_is_half_read(exact, alone):
    s = exact.stream(PROMPTS[2], **GREEDY)
    first = next(s)
    mid = exact.generate(PROMPTS[5], **GREEDY)
    assert mid.token_ids == alone[5]
    assert first + "".join(s) == exact.detokenize(alone[2])


def test_prefix_cache_hit_gives_the_cold_tokens(exact):
    long = "The quick brown fox jumps over the lazy dog. " * 6
    exact.engine.reset_prefix_cache()
    cold = exact.generate(long + "Then", **GREEDY)
    warm = exact.generate(long + "Then", **GREEDY)
    assert cold.stats.cached_tokens == 0 and warm.stats.cached_tokens >= 48
    assert warm.token_ids == cold.token_ids


def test_a_request_that_cannot_fit_is_refused_alone(exact, alone):
    with pytest.raises(ContextOverflowError):
        exact.generate([PROMPTS[0], "word " * 200], **GREEDY)
    assert exact.generate(PROMPTS[0], **GREEDY).token_ids == alone[0]


def test_default_mode_batched_equals_alone(smollm2_path):
    """Fast mode too: prefill rows take the int8 GEMM and decode rows the GEMV whatever the batch (the kernels
    round differently), so the batch (prompts packed into 32-token steps, one split, decodes beside prefills)
    changes no sequence. The teacher-forced prefill agrees with the decode steps' choices up to near-ties."""
    fast = LLM(smollm2_path, device="cpu", n_ctx=128, max_batched_tokens=32)
    batched = [r.token_ids for r in fast.generate(PROMPTS, **GREEDY)]
    assert batched == [fast.generate(p, **GREEDY).token_ids for p in PROMPTS]
    agree = total = 0
    for p, ids in zip(PROMPTS, batched):
        prompt = fast.tokenize(p)
        logits = fast.logits(prompt + ids[:-1])[len(prompt) - 1:]  # one prefill: the GEMM for every row
        agree += int((logits.argmax(1) == np.asarray(ids)).sum())
        total += len(ids)
    assert agree / total >= 0.95


def test_non_finite_logits_end_their_request_with_an_error(tmp_path, exact, alone):
    """A NaN in a norm weight (a corrupt file) gives NaN logits: that request ends with a clear error, and a
    healthy model's batch is unaffected by the check."""
    from dataclasses import replace

    from quanta import gguf
    from quanta.synth import get_preset, synthesize

    path = tmp_path / "nan.gguf"
    preset = replace(get_preset("smollm2-135m"), n_layers=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2)
    synthesize(preset, path, "F32", progress=False)
    with gguf.open(path) as f:
        at = f.tensors["output_norm.weight"].offset
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(np.full(4, np.nan, np.float32).tobytes())
    broken = LLM(path, device="cpu", n_ctx=64)
    with pytest.raises(QuantaError, match="non-finite logits"):
        broken.generate("Hello", max_tokens=4, temperature=0)
    with pytest.raises(QuantaError, match="non-finite logits"):
        broken.generate("Hello", max_tokens=4, temperature=0.7, seed=1)
    assert broken.engine.blocks.n_used == 0
    assert exact.generate(PROMPTS[0], **GREEDY).token_ids == alone[0]


def test_prefill_memory_grows_linearly_with_the_prompt(tmp_path):
    """A long prompt is prefilled in chunks, and a chunk's attention scores a tile of queries at a time: the peak
    scratch grows with the prompt's length, not its square (an 8,000-token prompt once took 2.6 GB)."""
    import tracemalloc
    from dataclasses import replace

    from quanta.synth import get_preset, synthesize

    path = tmp_path / "long.gguf"
    preset = replace(get_preset("smollm2-135m"), n_layers=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                     context_length=8192)
    synthesize(preset, path, "Q8_0", progress=False)
    llm = LLM(path, device="cpu", n_ctx=8192, max_seqs=1)
    peaks = []
    for n in (1000, 4000):
        llm.generate([7] * 10, max_tokens=1)  # warm: buffers of a small batch
        tracemalloc.start()
        llm.generate(list(range(100, 100 + n)), max_tokens=1)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 6 * peaks[0], peaks  # 4x the prompt: quadratic scratch would be 16x


def test_a_request_that_ends_at_its_first_token_leaves_its_prompt_cached(exact):
    """Blocks join the prefix cache when a step completes; a request finished by that very step still adds its
    prompt's full blocks before it frees them."""
    prompt = exact.tokenize("The quick brown fox jumps over the lazy dog. " * 5)
    exact.engine.reset_prefix_cache()
    first = exact.generate(prompt, max_tokens=1, temperature=0)
    again = exact.generate(prompt + [13], max_tokens=1, temperature=0)
    assert first.stats.cached_tokens == 0 and again.stats.cached_tokens == len(prompt) // 16 * 16


def test_dry_runs_for_new_shapes_stop_after_eight_that_compile_nothing(exact, monkeypatch):
    """The runner asks the backend to compile a new shape's kernels ahead of its first eager forward; after eight
    such dry runs in a row found nothing to compile (the CPU backend compiles nothing lazily), it stops asking."""
    from quanta.engine.model_runner import QUIET_DRY_RUNS

    runner = exact.engine.runner
    monkeypatch.setattr(runner, "_eager_shapes", set())
    monkeypatch.setattr(runner, "_quiet_dry_runs", 0)
    asked: list[int] = []
    real = runner.backend.compile_ahead
    monkeypatch.setattr(runner.backend, "compile_ahead", lambda forward: asked.append(1) or real(forward))
    for n in range(1, QUIET_DRY_RUNS + 5):  # prompts of new lengths: new prefill shapes
        exact.generate(list(range(10, 10 + n)), max_tokens=1, temperature=0)
    assert len(asked) == QUIET_DRY_RUNS
