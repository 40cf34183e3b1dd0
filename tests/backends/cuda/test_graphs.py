"""Prefill as CUDA graphs: the bucket rule, the eager fallbacks, front padding (the padded forward's last-token
logits equal an unpadded eager forward's: runs under the interpreter), buffer stability, and on a GPU the captured
graphs against eager execution (logits and greedy continuations) and replay without allocation."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import write_tiny_model

from quanta import gguf
from quanta.backends.cuda.graphs import (MAX_GRAPH_PREFILL, MIN_GRAPH_PREFILL, PAD_ID, DecodeGraph, PrefillGraph,
                                         bucket, padded_inputs, prefill_bucket)
from quanta.models import load_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_bucket_rule_bounds_padding_and_graph_count() -> None:
    sizes = set()
    for n in range(MIN_GRAPH_PREFILL, MAX_GRAPH_PREFILL + 1):
        b = bucket(n)
        assert b >= n and b % 16 == 0 and bucket(b) == b, n
        assert b - n < 16 or (b - n) / n < 0.125, (n, b)
        assert bucket(n - 1) <= b  # monotone
        sizes.add(b)
    assert bucket(MAX_GRAPH_PREFILL) == MAX_GRAPH_PREFILL
    assert len(sizes) == 40  # 16 multiples of 16 up to 256, then 8 per octave (3 octaves)


def test_prefill_bucket_falls_back_to_eager() -> None:
    assert prefill_bucket(1, 0, 4096) is None  # decode has its own graph
    assert prefill_bucket(MIN_GRAPH_PREFILL - 1, 0, 4096) is None  # few rows keep the GEMV path
    assert prefill_bucket(MAX_GRAPH_PREFILL + 1, 0, 4096) is None
    assert prefill_bucket(MAX_GRAPH_PREFILL, 0, 4096) == MAX_GRAPH_PREFILL
    assert prefill_bucket(100, 0, 4096) == 112
    assert prefill_bucket(100, 144, 256) == 112  # padding ends exactly at the context's end
    assert prefill_bucket(100, 145, 256) is None  # padding positions would pass n_ctx
    assert prefill_bucket(100, 0, 100) is None


@pytest.mark.parametrize("n,start,rows", [(5, 0, 16), (16, 3, 16), (17, 40, 32), (200, 7, 208)])
def test_padded_inputs_put_the_prompt_last(n: int, start: int, rows: int) -> None:
    ids = np.arange(1, n + 1, dtype=np.int32) * 3
    io = padded_inputs(ids, start, rows)
    assert io.shape == (2, rows) and io.dtype == np.int32
    np.testing.assert_array_equal(io[0, rows - n:], ids)
    np.testing.assert_array_equal(io[1, rows - n:], np.arange(start, start + n))
    assert (io[0, :rows - n] == PAD_ID).all()
    np.testing.assert_array_equal(np.sort(io[1, :rows - n]), np.arange(start + n, start + rows))


def _prefill(be, model, cache, ids: list[int], start: int, padded: bool) -> np.ndarray:
    """The last token's logits of a prefill, eager, or padded to its bucket as a prefill graph runs it."""
    ids_np = np.asarray(ids, np.int32)
    if not padded:
        return be.to_host(be.forward(model, ids_np, start, cache, all_logits=False)).copy()
    rows = prefill_bucket(len(ids), start, model.n_ctx)
    assert rows is not None and rows > len(ids)
    io = be.from_host(padded_inputs(ids_np, start, rows))
    capacity = min(MAX_GRAPH_PREFILL, model.n_ctx)
    return be.to_host(be._padded_forward(model, cache, io[0], io[1], capacity)).copy()


def _conversation(be, model, padded: bool) -> list[np.ndarray]:
    """Logits of two prompts, the second right after the first: it overwrites the first one's padding K/V and
    reads every position before it, as the next decode step would (decode itself is too slow to interpret)."""
    cache = be.kv_cache(model.kv_shape())
    first, second = [5, 9, 2, 44, 17, 3, 8, 61, 12, 30, 7, 1, 90], [4, 70, 33, 2, 19, 26, 51]
    return [_prefill(be, model, cache, first, 0, padded), _prefill(be, model, cache, second, len(first), padded)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_padded_prefill_equals_unpadded(arch: str, tmp_path: Path, device: str) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    g = gguf.open(write_tiny_model(tmp_path / f"{arch}.gguf", arch))
    # on a GPU the default mode: every row is computed alike whatever the rows beside it. The interpreter's numpy
    # matmuls round a row's last bit by its place in the tile, and the default mode's fp16 attention operands
    # (rounded as the tensor cores round them) magnify that bit: there, the exact mode checks the padding
    be = CUDABackend(device, exact=device == "cpu", graphs=False)
    model = load_model(g, be, 64)
    for got, want in zip(_conversation(be, model, padded=True), _conversation(be, model, padded=False)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_buffers_keep_their_addresses(tmp_path: Path, device: str) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    g = gguf.open(write_tiny_model(tmp_path / "llama.gguf", "llama", n_layers=1))
    be = CUDABackend(device, graphs=False)
    model = load_model(g, be, 64)
    cache = be.kv_cache(model.kv_shape())
    _prefill(be, model, cache, list(range(1, 10)), 0, padded=True)  # bucket 16
    addresses = {name: b.data_ptr() for name, b in be._prefill_buffers.items()}
    assert {"x", "h", "q", "k", "v", "gate", "up"} <= set(addresses)
    _prefill(be, model, cache, list(range(1, 40)), 9, padded=True)  # bucket 48
    assert {name: b.data_ptr() for name, b in be._prefill_buffers.items()} == addresses
    # a bigger cache needs bigger storage: the graphs that read the old storage are dropped, decode graphs stay
    big = load_model(g, be, 128)
    big_cache = be.kv_cache(big.kv_shape())  # (a new cache drops every graph)
    be._graphs[(0, 0, 16)] = object.__new__(PrefillGraph)
    be._graphs[(0, 0)] = object.__new__(DecodeGraph)
    _prefill(be, big, big_cache, list(range(1, 10)), 0, padded=True)
    assert be._prefill_buffers["x"].numel() == 128 * big.config.d_model
    assert (0, 0, 16) not in be._graphs and (0, 0) in be._graphs
    be._graphs[(0, 0, 16)] = object.__new__(PrefillGraph)
    _prefill(be, model, cache, list(range(1, 10)), 0, padded=True)  # fits: nothing dropped
    assert (0, 0, 16) in be._graphs


class _EagerGraph:
    """PrefillGraph without a capture (none on the CPU): its warm-up forward, then every replay runs the captured
    forward again."""

    def __init__(self, forward, inputs: np.ndarray, device, pool, stream):
        self.forward, self.device = forward, device
        self.run(inputs)

    def run(self, inputs: np.ndarray):
        io = torch.from_numpy(inputs).to(self.device)
        return self.forward(io[0], io[1])


@pytest.fixture(autouse=True)
def capture_at_first_use(monkeypatch) -> None:
    """Graphs from a bucket's first prefill (the backend waits for the second, to keep the first prompt fast)."""
    import quanta.backends.cuda.backend as backend_module

    monkeypatch.setattr(backend_module, "CAPTURE_AT_USE", 1)


def test_first_prefill_of_a_bucket_runs_eagerly(tmp_path: Path, device: str, monkeypatch) -> None:
    import quanta.backends.cuda.backend as backend_module
    from quanta.backends.cuda.backend import CUDABackend

    monkeypatch.setattr(backend_module, "CAPTURE_AT_USE", 2)
    monkeypatch.setattr(backend_module, "PrefillGraph", _EagerGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    g = gguf.open(write_tiny_model(tmp_path / "llama.gguf", "llama", n_layers=1))
    be = CUDABackend(device, graphs=False)
    be.graphs = True
    model = load_model(g, be, 64)
    cache = be.kv_cache(model.kv_shape())
    be.forward(model, np.arange(3, 16, dtype=np.int32), 0, cache, all_logits=False)
    assert not be._graphs
    be.forward(model, np.arange(3, 10, dtype=np.int32), 13, cache, all_logits=False)  # bucket 16 again
    assert [key[2] for key in be._graphs] == [16]


def test_forward_routes_prefills_to_bucket_graphs(tmp_path: Path, device: str, monkeypatch) -> None:
    """CUDABackend.forward's choice of graph (one per bucket) or eager path, and the padded run it captures."""
    import quanta.backends.cuda.backend as backend_module
    from quanta.backends.cuda.backend import CUDABackend

    monkeypatch.setattr(backend_module, "PrefillGraph", _EagerGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    g = gguf.open(write_tiny_model(tmp_path / "gemma3.gguf", "gemma3", n_layers=1))
    turns = [(13, 0), (7, 13), (30, 20), (20, 40)]  # buckets 16, 16, 32; eager: 32 rows at 40 would pass n_ctx
    results = []
    for graphs in (False, True):
        be = CUDABackend(device, graphs=False)
        be.graphs = graphs
        model = load_model(g, be, 64)
        cache = be.kv_cache(model.kv_shape())
        results.append([be.to_host(be.forward(model, np.arange(3, 3 + n, dtype=np.int32) % 90, start, cache,
                                              all_logits=False)).copy() for n, start in turns])
    assert sorted(key[2] for key in be._graphs) == [16, 32]
    for got, want in zip(*reversed(results)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- on a GPU ----------------------------------------------------------------------------------------------------
MIXED = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_0",
         "ffn_up": "Q5_1", "ffn_down": "Q4_1", "token_embd": "Q8_0"}


def _turns(be, model, cache, prompts: list[list[int]], n_new: int = 4) -> tuple[list[np.ndarray], list[int]]:
    """Each prompt after the previous turn's prompt and greedy tokens: its logits, and all greedy tokens."""
    logits, tokens, pos = [], [], 0
    for prompt in prompts:
        out = be.forward(model, np.asarray(prompt, np.int32), pos, cache, all_logits=False)
        logits.append(be.to_host(out).copy())
        pos += len(prompt)
        tok = be.argmax(out[0])
        for _ in range(n_new):
            tokens.append(tok)
            tok = be.argmax(be.forward(model, np.asarray([tok], np.int32), pos, cache, all_logits=False)[0])
            pos += 1
    return logits, tokens


@needs_cuda
@pytest.mark.parametrize("arch,types,exact", [("llama", MIXED, False), ("llama", MIXED, True),
                                              ("gemma3", {"token_embd": "F16"}, False)])
def test_graph_prefill_equals_eager(arch: str, types: dict, exact: bool, tmp_path: Path) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    g = gguf.open(write_tiny_model(tmp_path / f"{arch}.gguf", arch, types=types, d_model=256, d_ff=256, vocab=64))
    rng = np.random.default_rng(1)
    # 9 and 16 share bucket 16, 17 and 30 bucket 32; later prompts start > 0 (after 4 generated tokens); eager:
    # 3 tokens (too few), and 17 tokens at 234 (bucket 32 would pass n_ctx = 256)
    conversations = [[9, 17, 100], [16, 30, 5], [200, 3, 21], [230, 17]]
    for lengths in conversations:
        prompts = [rng.integers(1, 64, size=n).tolist() for n in lengths]
        starts = np.cumsum([0] + [n + 4 for n in lengths[:-1]])
        buckets = {prefill_bucket(n, int(s), 256) for n, s in zip(lengths, starts)} - {None}
        results = []
        for graphs in (False, True):
            be = CUDABackend("cuda", exact=exact, graphs=graphs)
            model = load_model(g, be, 256)
            results.append(_turns(be, model, be.kv_cache(model.kv_shape()), prompts))
            if graphs:
                assert {k[2] for k in be._graphs if len(k) == 3} == buckets
        (want_logits, want_tokens), (got_logits, got_tokens) = results
        for got, want in zip(got_logits, want_logits):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert got_tokens == want_tokens


@needs_cuda
def test_graph_prefill_replays_without_allocating(tmp_path: Path) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    g = gguf.open(write_tiny_model(tmp_path / "llama.gguf", "llama", types=MIXED, d_model=256, d_ff=256))
    be = CUDABackend("cuda")
    model = load_model(g, be, 256)
    cache = be.kv_cache(model.kv_shape())
    be.forward(model, np.arange(1, 41, dtype=np.int32), 0, cache, all_logits=False)  # captures bucket 48
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for n, start in ((33, 0), (47, 50), (40, 100)):
        be.forward(model, np.arange(2, 2 + n, dtype=np.int32), start, cache, all_logits=False)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert [k[2] for k in be._graphs] == [48]


@needs_cuda
def test_captures_hold_off_the_garbage_collector(tmp_path: Path, monkeypatch) -> None:
    """A dropped backend is freed by the collector (it holds its own bound methods), and a collection during a
    capture that destroys such a backend's graphs invalidates the capture (GPU run 133: once in 5 x 12
    conversations of test_graph_prefill_equals_eager's cases in one process). So captures hold the collector off."""
    from quanta.backends.cuda.backend import CUDABackend

    g = gguf.open(write_tiny_model(tmp_path / "llama.gguf", "llama", types=MIXED, d_model=256, d_ff=256, vocab=64))
    collector_on = []
    begin = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(graph: torch.cuda.CUDAGraph, *args, **kwargs) -> None:
        collector_on.append(gc.isenabled())
        begin(graph, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
    be = CUDABackend("cuda")
    model = load_model(g, be, 256)
    _turns(be, model, be.kv_cache(model.kv_shape()), [list(range(1, 21)), list(range(3, 28))])
    assert len(be._graphs) == 2 and collector_on == [False, False]  # the decode step, then one prefill bucket
    assert gc.isenabled()


@needs_cuda
def test_greedy_decode_chains_graphs_and_equals_the_step_loop(tmp_path: Path) -> None:
    """The chained decode graph (each step writes its argmax into the next one's input; one step queued ahead of
    the host) yields the tokens of the host-driven loop (forward, then argmax, step by step), also after a consumer
    that stopped early left a step running past its last token."""
    from quanta.backends.base import Backend
    from quanta.backends.cuda.backend import CUDABackend

    g = gguf.open(write_tiny_model(tmp_path / "llama.gguf", "llama", types=MIXED, d_model=256, d_ff=256, vocab=64))
    be = CUDABackend("cuda")
    model = load_model(g, be, 256)
    cache = be.kv_cache(model.kv_shape())
    prompt = np.arange(1, 20, dtype=np.int32)

    def first() -> int:
        return be.argmax(be.forward(model, prompt, 0, cache, all_logits=False)[0])

    tok = first()
    want = [tok, *Backend.greedy_decode(be, model, cache, tok, len(prompt), 40)]
    tok = first()
    early = be.greedy_decode(model, cache, tok, len(prompt), 40)
    assert [tok] + [next(early) for _ in range(5)] == want[:6]
    early.close()
    tok = first()
    assert [tok, *be.greedy_decode(model, cache, tok, len(prompt), 40)] == want
    assert [*be.greedy_decode(model, cache, want[-1], len(prompt) + 40, 0)] == []
