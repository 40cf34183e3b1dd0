"""Forwards as captured graphs (engine/graphs.py over ``CUDABackend.capture``): the buckets, the padding (dummy
sequences in the pool's padding block), the inputs rewritten in place and the tokens fed from the previous step on
the device, for decode batches and prefill steps, run under the interpreter with a capture that replays the
recorded forward eagerly; on a GPU the real CUDA graphs against eager forwards, replay without allocating, and
captures holding the garbage collector off."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from batches import BLOCK, TABLES, placement
from tiny_models import write_tiny_model

from quanta import gguf
from quanta.engine.graphs import CAPTURE_AT_USE, ForwardGraphs, buckets, token_bucket
from quanta.models import load_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
QK_FUSED = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
            "ffn_down": "Q6_K"}
LENGTHS = [9, 4, 13, 6, 2]  # tokens each sequence holds before its decode steps
TABLES5 = TABLES + [[12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]


def test_buckets() -> None:
    assert buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(1) == [1]
    assert buckets(40, every=5) == [1, 2, 3, 4, 5, 8, 16, 32, 40]  # a verify step of 1 + 4 drafts: no padding
    assert buckets(4, every=5) == [1, 2, 3, 4]
    sizes = {token_bucket(n) for n in range(1, 2049)}
    assert len(sizes) == 40 and max(sizes) == 2048  # 16 multiples of 16 up to 256, then 8 per octave
    for n in range(1, 2049):
        b = token_bucket(n)
        assert b >= n and b % 16 == 0 and (b - n < 16 or (b - n) / n < 0.125)


def _graphs(be, model, cache, max_seqs: int = 8) -> ForwardGraphs:
    return ForwardGraphs(model, be, cache, max_seqs=max_seqs, max_tokens=64, n_ctx=32, block_size=BLOCK,
                         n_blocks=24)


def _setup(be, tmp_path: Path, exact: bool = True):
    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=1,
                            vocab=64)
    model = load_model(gguf.open(path), be, 32)
    cache = be.kv_cache(model.kv_shape(24, BLOCK))
    rng = np.random.default_rng(3)
    tokens = [rng.integers(1, 64, n + 4).astype(np.int32) for n in LENGTHS]
    return model, cache, tokens


def _prefill(be, model, cache, tokens) -> None:
    meta = placement([(TABLES5[j], 0, n) for j, n in enumerate(LENGTHS)], BLOCK)
    ids = np.concatenate([t[:n] for t, n in zip(tokens, LENGTHS)])
    model.forward(be.from_host(ids), be.metadata(meta), cache, None)


def _decode_meta(seqs: list[int], done: dict[int, int] | None = None):
    """A decode step of ``seqs``, each after its prompt and its ``done`` decode steps."""
    done = done or {}
    return placement([(TABLES5[j], LENGTHS[j] + done.get(j, 0), 1) for j in seqs], BLOCK)


def _decode_steps(be, model, cache, tokens, graphs: ForwardGraphs | None,
                  batches: tuple[list[int], ...] = ([0, 1, 2], [3, 4], [0, 1, 2, 3, 4])) -> list[np.ndarray]:
    """Decode steps of 3 sequences (bucket 4: one padding row), then of 2 (bucket 2), then of all 5 (bucket 8)."""
    out, done = [], {}
    for seqs in batches:
        meta = _decode_meta(seqs, done)
        ids = np.asarray([tokens[j][LENGTHS[j] + done.get(j, 0)] for j in seqs], np.int32)
        logits = graphs.run(ids, meta) if graphs else model.forward(be.from_host(ids), be.metadata(meta), cache, None)
        assert logits is not None and logits.shape[0] == len(seqs)
        out.append(np.array(be.to_host(logits)))
        for j in seqs:
            done[j] = done.get(j, 0) + 1
    return out


def test_padded_graph_batches_equal_eager_forwards(tmp_path: Path, device: str, few_programs: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter (no CUDA graphs) ``capture`` is made to return the recorded forward itself: the
    buckets' input arrays, their padding and the pool's padding block are what runs. The real rows equal eager
    forwards of the same sequences; the padding block takes the dummy rows' K/V; no real block is touched."""
    from quanta.backends.cuda.backend import CUDABackend

    runs, pools = [], []
    for graphed in (False, True):
        be = CUDABackend(device, exact=True, graphs=False)
        if graphed:
            monkeypatch.setattr(be, "graphs", True)
            monkeypatch.setattr(be, "capture", lambda forward: forward)
        model, cache, tokens = _setup(be, tmp_path)
        _prefill(be, model, cache, tokens)
        graphs = _graphs(be, model, cache) if graphed else None
        runs.append(_decode_steps(be, model, cache, tokens, graphs))
        pools.append(cache.k.cpu().numpy().copy())
        if graphed:
            assert sorted(graphs._graphs) == [(2, 2, False), (4, 4, False), (8, 8, False)]
    for got, want in zip(*reversed(runs)):  # (a padded bucket of 4 rows takes the GEMM, 3 rows the GEMV)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    eager, graphed = pools
    np.testing.assert_allclose(graphed[:, :, :24 * BLOCK], eager[:, :, :24 * BLOCK], rtol=1e-5, atol=1e-5)
    assert np.abs(graphed[:, :, 24 * BLOCK]).max() > 0  # the padding rows wrote slot 0 of the padding block


def test_graphs_step_aside(tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No graph for: graphs off (as the bench's profiler turns them), a batch that is not decode-only, more
    sequences than the largest bucket, or a backend that records none."""
    from quanta.backends.cuda.backend import CUDABackend

    be = CUDABackend(device, graphs=False)
    model, cache, _ = _setup(be, tmp_path)
    graphs = _graphs(be, model, cache, max_seqs=2)
    ids = np.asarray([1, 2], np.int32)
    assert graphs.run(ids, _decode_meta([0, 1])) is None  # graphs off
    monkeypatch.setattr(be, "graphs", True)
    prefill = placement([(TABLES5[0], 0, 2)], BLOCK)
    assert graphs.run(ids, prefill) is None  # a prefill's every row
    assert graphs.run(np.asarray([1, 2, 3], np.int32), _decode_meta([0, 1, 2])) is None
    monkeypatch.setattr(be, "capture", lambda forward: None)
    assert graphs.run(ids, _decode_meta([0, 1])) is None and graphs._graphs[2, 2, False].replay is None


def test_prefill_graphs_and_fed_tokens_equal_eager(tmp_path: Path, device: str, few_programs: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill step of two prompts (9 tokens: bucket 16, 4 sequence rows) runs eagerly at its first use and as
    its graph at its second, with the same logits rows; a decode step whose tokens are the step before's samples on
    the device (swapped) equals the eager step with those ids."""
    import torch as t

    from quanta.backends.cuda.backend import CUDABackend

    be = CUDABackend(device, exact=True, graphs=False)
    monkeypatch.setattr(be, "graphs", True)
    captured = []
    monkeypatch.setattr(be, "capture", lambda forward, **kw: captured.append(kw) or forward)
    model, cache, tokens = _setup(be, tmp_path)
    graphs = _graphs(be, model, cache)
    meta = placement([(TABLES5[0], 0, 6), (TABLES5[1], 0, 3)], BLOCK)
    ids = np.concatenate([tokens[0][:6], tokens[1][:3]])
    rows = np.asarray([5, 8], np.int32)
    want = np.array(be.to_host(model.forward(be.from_host(ids), be.metadata(meta), cache, be.from_host(rows))))
    for use in range(1, CAPTURE_AT_USE + 1):
        got = graphs.run(ids, meta, rows=rows)
        assert (got is None) == (use < CAPTURE_AT_USE)
    np.testing.assert_allclose(np.array(be.to_host(got)), want, rtol=1e-6, atol=1e-6)
    assert (16, 4, True) in graphs._graphs and captured == [{"share_rows": 64}]
    step = placement([(TABLES5[0], 6, 1), (TABLES5[1], 3, 1)], BLOCK)
    previous = t.tensor([tokens[1][3], 7, tokens[0][6]], dtype=t.int32, device=device)
    fed = graphs.run(np.asarray([-1, -1], np.int32), step, previous, np.asarray([2, 0], np.int32))
    want = model.forward(be.from_host(np.asarray([tokens[0][6], tokens[1][3]], np.int32)), be.metadata(step), cache,
                         None)
    np.testing.assert_allclose(np.array(be.to_host(fed)), np.array(be.to_host(want)), rtol=1e-6, atol=1e-6)


def test_verify_steps_replay_the_decode_graphs(tmp_path: Path, device: str, few_programs: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify step (sequences 0 and 1: their next token and 3 drafts; sequence 2: one token) as decode rows
    (``model_runner.decode_rows``) replays the decode graph of 16 rows (recorded at its first use, and replayed
    then too), with the logits of the eager forward of the same step as chunks (each draft attending to the rows
    before it)."""
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.engine.model_runner import decode_rows

    be = CUDABackend(device, exact=True, graphs=False)
    model, cache, tokens = _setup(be, tmp_path)
    _prefill(be, model, cache, tokens)
    counts = [4, 4, 1]
    meta = placement([(TABLES5[j], LENGTHS[j], c) for j, c in enumerate(counts)], BLOCK)
    ids = np.concatenate([tokens[j][LENGTHS[j]:LENGTHS[j] + c] for j, c in enumerate(counts)]).astype(np.int32)
    want = np.array(be.to_host(model.forward(be.from_host(ids), be.metadata(meta), cache, None)))
    monkeypatch.setattr(be, "graphs", True)
    monkeypatch.setattr(be, "capture", lambda forward: forward)
    graphs = _graphs(be, model, cache, max_seqs=16)
    assert graphs.run(ids, meta) is None  # as chunks: no graph
    for _ in range(2):  # the step that records the graph, then a replay
        got = graphs.run(ids, decode_rows(meta))
        assert got is not None and sorted(graphs._graphs) == [(16, 16, False)] and graphs.captures == 1
        np.testing.assert_allclose(np.array(be.to_host(got)), want, rtol=1e-5, atol=1e-5)


def test_decode_graphs_pick_the_greedy_tokens_and_feed_them(tmp_path: Path, device: str, few_programs: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode graph ends with its rows' greedy tokens (``greedy_of``: numpy's argmax of its logits) in the shared
    token array, and the next decode step feeds its ids from there: in the same bucket (nothing copied), in a new
    bucket whose recording step overwrites the array (the tokens set aside and put back), and from tokens picked
    outside a graph (copied in). Each step's logits equal the eager forward's of the same ids."""
    from quanta.backends.cuda.backend import CUDABackend

    want_be = CUDABackend(device, exact=True, graphs=False)
    model_e, cache_e, tokens = _setup(want_be, tmp_path)
    _prefill(want_be, model_e, cache_e, tokens)
    be = CUDABackend(device, exact=True, graphs=False)
    monkeypatch.setattr(be, "graphs", True)
    monkeypatch.setattr(be, "capture", lambda forward: (forward(), forward)[1])  # a warm-up run, as recording's
    model, cache, _ = _setup(be, tmp_path)
    _prefill(be, model, cache, tokens)
    graphs = _graphs(be, model, cache)
    done: dict[int, int] = {}
    previous, picked = None, {}  # the step before's tokens on the device, and on the host by sequence
    for seqs, outside in (([0, 1, 3], False), ([0, 1, 3], False), ([1, 3], True), ([0, 1, 3, 4], False)):
        meta = _decode_meta(seqs, done)
        ids = np.asarray([picked.get(j, tokens[j][LENGTHS[j] + done.get(j, 0)]) for j in seqs], np.int32)
        source = np.asarray([list(picked).index(j) if j in picked else -1 for j in seqs], np.int32)
        logits = graphs.run(np.where(source >= 0, -1, ids).astype(np.int32), meta, previous, source)
        want = np.array(want_be.to_host(model_e.forward(want_be.from_host(ids), want_be.metadata(meta), cache_e, None)))
        np.testing.assert_allclose(np.array(be.to_host(logits)), want, rtol=1e-5, atol=1e-5)
        best = graphs.greedy_of(logits)
        assert best is not None and graphs.greedy_of(logits[:1]) is None
        assert (np.array(be.to_host(best)) == want.argmax(1)).all()
        order = seqs[::-1] if outside else seqs  # tokens picked outside a graph: the rows reversed
        previous = be.argmax_rows(logits).flip(0) if outside else best
        picked = dict(zip(order, want.argmax(1)[::-1] if outside else want.argmax(1)))
        for j in seqs:
            done[j] = done.get(j, 0) + 1
    assert sorted(graphs._graphs) == [(2, 2, False), (4, 4, False)]


def test_the_engine_takes_its_greedy_tokens_from_the_decode_graphs(tmp_path: Path, device: str, few_programs: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy requests of different lengths through the batched engine with its steps queued ahead: with decode
    graphs (recorded forwards replayed under the interpreter) the decode steps' tokens are the graphs' picks, and
    every request's tokens equal those of the engine without graphs."""
    from dataclasses import replace

    from quanta.backends.cuda.backend import CUDABackend
    from quanta.engine import LLMEngine, SamplingParams, StopConditions
    from quanta.engine.config import EngineConfig
    from quanta.synth import get_preset, synthesize
    from quanta.tokenizer import load_tokenizer

    path = tmp_path / "small.gguf"
    preset = replace(get_preset("smollm2-135m"), n_layers=1, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                     vocab_size=512)
    synthesize(preset, path, "Q8_0", std=0.1, progress=False)
    prompts = [[5, 9, 100, 200, 7], [11, 12, 13], [300, 301, 302, 303, 304, 305, 306, 307, 308]]

    def greedy(graphed: bool) -> tuple[list[list[int]], int]:
        be = CUDABackend(device, exact=True, graphs=False)
        if graphed:
            monkeypatch.setattr(be, "graphs", True)
            monkeypatch.setattr(be, "capture", lambda forward, **kw: (forward(), forward)[1])
        engine = LLMEngine(load_model(gguf.open(path), be, 64), be, load_tokenizer(gguf.open(path)),
                           EngineConfig(max_seqs=4, kv_blocks=16), 64)
        engine.asynchronous = True
        picks = []
        if graphed:
            greedy_of = engine.runner.graphs.greedy_of
            monkeypatch.setattr(engine.runner.graphs, "greedy_of", lambda x: picks.append(greedy_of(x)) or picks[-1])
        ids = [engine.add_request(p, SamplingParams(temperature=0.0), StopConditions(max_tokens=n, ignore_eos=True))
               for p, n in zip(prompts, (7, 3, 5))]
        out: dict[int, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for r in engine.step():
                out[r.request_id].extend(r.new_token_ids)
        return [out[i] for i in ids], sum(p is not None for p in picks)

    want, _ = greedy(False)
    got, picked = greedy(True)
    assert got == want and [len(t) for t in got] == [7, 3, 5]
    assert picked >= 5  # the decode steps after the first (the prompts' steps have no graph)


# ---- on a GPU ----------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("exact", [False, True])
def test_cuda_graphs_equal_eager(exact: bool, tmp_path: Path) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    runs = []
    for graphed in (False, True):
        be = CUDABackend("cuda", exact=exact)
        model, cache, tokens = _setup(be, tmp_path)
        _prefill(be, model, cache, tokens)
        graphs = _graphs(be, model, cache) if graphed else None
        # fast mode: 5 rows take the int8 GEMV and their padded bucket of 8 the GEMM (other rounding), so only the
        # batches whose bucket takes the same kernel
        batches = ([0, 1, 2], [3, 4], [0, 1, 2, 3, 4]) if exact else ([0, 1, 2], [3, 4])
        runs.append(_decode_steps(be, model, cache, tokens, graphs, batches))
    for got, want in zip(*reversed(runs)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_cuda
def test_graph_replay_allocates_nothing_and_holds_the_collector_off(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection during a capture can destroy another, unreachable graph, which invalidates the capture (GPU run
    133): captures hold the collector off. Once captured, a bucket replays without allocating."""
    from quanta.backends.cuda.backend import CUDABackend

    collector_on = []
    begin = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(graph: torch.cuda.CUDAGraph, *args, **kwargs) -> None:
        collector_on.append(gc.isenabled())
        begin(graph, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
    be = CUDABackend("cuda")
    model, cache, tokens = _setup(be, tmp_path)
    _prefill(be, model, cache, tokens)
    graphs = _graphs(be, model, cache)
    _decode_steps(be, model, cache, tokens, graphs)
    assert collector_on == [False, False, False] and gc.isenabled()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    _decode_steps(be, model, cache, tokens, graphs)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
