"""Forwards as captured graphs: decode batches per batch-size bucket, prefill steps per token-count bucket.

A decode-only batch (one new token per sequence, every row sampled) of n sequences replays the graph of the smallest
bucket b ≥ n of 1, 2, 4, … max_seqs (a verify step of speculative decoding comes as one such row per token:
``model_runner.decode_rows``; a speculative engine has a bucket for every size up to 1 + its most drafts). A step
with prefill chunks of n tokens in s sequences (decode tokens beside them too) replays the graph of (T ≥ n tokens, S
≥ s + 1 sequences) once that shape has run twice (the first time eagerly: a one-off prompt length pays no capture),
T from 16 up in steps of 16, or 1/16 of the next power of two above 256 (padding under 16 tokens or 12.5%), S a
power of two. Graphs are recorded by ``Backend.capture``.

A decode graph replays from the step that records it. A speculative engine's decode graphs are recorded with
``fresh`` = 1 + the most drafts (AttentionMetadata.fresh): the decode attention loads its first K/V tile before its
PDL wait, taking the keys of earlier forwards as written, and a verify step's draft rows read keys that the rows
before them store in the same forward, so those rows are read again after the wait. Without it the first replay of
a graph recorded in a verify step returned a wrong row on the H200 (GPU run 234); running each recording step
eagerly hid that but put those steps through other kernels (six fresh engines' first requests parted from plain
greedy at near ties; with the replay, identical: GPU run 253).

A graph's inputs, the token ids, the placement (AttentionMetadata) and the rows that need logits, live in one device
array that each step rewrites in place with one host→device copy (``write``); tokens the step before sampled and
left on the device are gathered into it there (``feed_tokens_into``), so a step can be queued before the host has
read the last one's tokens. A decode graph holds that gather and the greedy pick too: it starts by feeding its ids
from the decode graphs' shared token array and ends with the argmax of every row into it (``greedy_of``), so a plain
greedy step is one copy in, one replay and one copy out (tokens picked elsewhere, by an eager step or a masked
argmax, are copied into the shared array first; a graph's recording step overwrites it, so tokens still to be fed
from it are set aside and put back). These ops (and ``argmax_rows(out=)``) are the CUDA backend's: only a backend
that captures graphs needs them. Padding is dummy sequences at position 0 whose K/V go to the pool's padding block,
one past the engine's ``n_blocks`` (a backend that captures graphs allocates it: ``CUDAKVCache.pad_block``), so it
never touches a real sequence: in decode one dummy sequence per padding row, in prefill one holding all padding
tokens (each attends to position 0 only) and empty ones up to S. Rows are independent in every op but attention, and
attention reads only its own sequence: the real rows' logits are an eager forward's of the same batch. The prefill
graphs share one set of buffers (sized for the largest bucket): graphs replay one after another on one stream.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from quanta.backends.base import Array, AttentionMetadata, Backend
from quanta.models.base import Model

PAD_TOKEN = 0  # any valid id: the padding rows' logits are never read
MIN_STEP = 16  # prefill buckets are multiples of 16 tokens
CAPTURE_AT_USE = 2  # a prefill shape's graph is recorded at its second use


def buckets(max_seqs: int, every: int = 1) -> list[int]:
    """The decode batch sizes graphs are captured for: powers of two below ``max_seqs``, then ``max_seqs``, and every
    size up to ``every`` (a speculative engine's 1 + most drafts: one sequence's verify step runs no padding rows,
    which cost the matmuls as much as real ones)."""
    sizes = {1 << i for i in range(max_seqs.bit_length()) if 1 << i < max_seqs} | set(range(1, every + 1))
    return sorted(s for s in sizes if s < max_seqs) + [max_seqs]


def token_bucket(n: int) -> int:
    """Tokens a prefill step of ``n`` tokens runs as: ``n`` rounded up to a multiple of ``max(16, next_pow2(n) /
    16)`` (16, 32, … 256, 288, 320, … 512, 576, …: eight buckets per octave above 256)."""
    step = max(MIN_STEP, (1 << (n - 1).bit_length()) // 16)
    return -(-n // step) * step


class _Graph:
    """One captured forward of ``tokens`` token rows in ``seqs`` sequence rows, its input array and the host copy
    written into it each step. Decode (``prefill`` False): token i is sequence i and every row gets logits.

    The input array holds, in order: ids, positions, slots, token_seq, source (``tokens`` each; source[i] >= 0:
    token i is that row of the previous step's samples on the device), seq_lens, logit rows (``seqs`` each),
    query_starts (seqs + 1), block_tables (seqs x width)."""

    TOKEN_FIELDS = ("ids", "positions", "slots", "token_seq", "source")
    SEQ_FIELDS = ("seq_lens", "rows")

    def __init__(self, model: Model, backend: Backend, cache: Any, tokens: int, seqs: int, width: int,
                 block_size: int, pad_block: int, prefill: bool, share_rows: int | None = None, fresh: int = 1,
                 picked: Array | None = None):
        self.backend, self.tokens, self.seqs, self.width, self.prefill = backend, tokens, seqs, width, prefill
        self.pad_slot, self.pad_block = pad_block * block_size, pad_block
        t, s, o, at = tokens, seqs, 0, {}
        for name, size in [(f, t) for f in self.TOKEN_FIELDS] + [(f, s) for f in self.SEQ_FIELDS] + [
                ("query_starts", s + 1), ("block_tables", s * width)]:
            at[name], o = slice(o, o + size), o + size
        self.at = at
        self.host = np.zeros(o, np.int32)
        if not prefill:
            self._field("token_seq")[:] = np.arange(t)
            self._field("query_starts")[:] = np.arange(s + 1)
        self._pad(0, 0)
        self.io = backend.from_host(self.host)
        io = self.io
        meta = AttentionMetadata(positions=io[at["positions"]], slots=io[at["slots"]],
                                 token_seq=io[at["token_seq"]], seq_lens=io[at["seq_lens"]],
                                 query_starts=io[at["query_starts"]],
                                 block_tables=io[at["block_tables"]].reshape(s, width), n_seqs=s,
                                 max_query_len=t if prefill else 1, block_size=block_size,
                                 fresh=1 if prefill else fresh)
        ids, rows = io[at["ids"]], io[at["rows"]] if prefill else None
        self.ids, self.source = ids, io[at["source"]]
        # a decode graph: its ids fed from the shared array ``picked`` and its rows' greedy tokens written into it
        self.best = None if picked is None else picked[:tokens]
        be: Any = backend

        def forward() -> Array:
            if picked is not None:
                be.feed_tokens_into(ids, picked, self.source)
            logits = model.forward(ids, meta, cache, rows)
            if picked is not None:
                be.argmax_rows(logits, out=self.best)
            return logits

        kwargs = {} if share_rows is None else {"share_rows": share_rows}
        self.replay: Callable[[], Array] | None = backend.capture(forward, **kwargs)

    def _field(self, name: str) -> np.ndarray:
        return self.host[self.at[name]]

    def _tables(self) -> np.ndarray:
        return self._field("block_tables").reshape(self.seqs, self.width)

    def _pad(self, n: int, s: int) -> None:
        """Tokens n.. and sequences s.. as padding (decode: one dummy sequence per row; prefill: the tokens in
        sequence s, the sequences after it empty), at position 0 in the padding block."""
        self._field("ids")[n:] = PAD_TOKEN
        self._field("positions")[n:] = 0
        self._field("slots")[n:] = self.pad_slot
        self._field("source")[n:] = -1
        self._field("seq_lens")[s:] = 1
        self._tables()[s:, 0] = self.pad_block
        if self.prefill:
            self._field("token_seq")[n:] = s
            self._field("query_starts")[s + 1:] = self.tokens

    def run(self, ids: np.ndarray, meta: AttentionMetadata, previous: Array | None, source: np.ndarray | None,
            rows: np.ndarray | None) -> Array:
        n, s = len(ids), meta.n_seqs
        assert self.replay is not None
        self._field("ids")[:n] = ids
        self._field("positions")[:n] = meta.positions
        self._field("slots")[:n] = meta.slots
        self._field("source")[:n] = -1 if source is None else source
        self._field("seq_lens")[:s] = meta.seq_lens
        self._tables()[:s, :meta.block_tables.shape[1]] = meta.block_tables
        if self.prefill:
            self._field("token_seq")[:n] = meta.token_seq
            self._field("query_starts")[:s + 1] = meta.query_starts
            self._field("rows")[:len(rows)] = rows
            self._field("rows")[len(rows):] = self.tokens - 1
        self._pad(n, s)
        be: Any = self.backend  # a backend that captures graphs provides write and feed_tokens_into
        be.write(self.io, self.host)
        if source is not None and self.best is None:  # (a decode graph feeds its ids itself)
            be.feed_tokens_into(self.ids, previous, self.source)
        return self.replay()[:n if rows is None else len(rows)]


class ForwardGraphs:
    """The captured forwards of one model and KV pool (see the module docstring); ``run`` is the model runner's
    hook."""

    def __init__(self, model: Model, backend: Backend, cache: Any, *, max_seqs: int, max_tokens: int, n_ctx: int,
                 block_size: int, n_blocks: int, fresh: int = 1):
        self.model, self.backend, self.cache = model, backend, cache
        self.fresh = fresh  # decode graphs: AttentionMetadata.fresh (1 + the most drafts with speculation)
        self.sizes = buckets(max_seqs, fresh)
        self.max_tokens = token_bucket(max_tokens)
        self.width = -(-n_ctx // block_size)  # block-table columns: the longest sequence's blocks
        self.block_size, self.pad_block = block_size, n_blocks
        self._graphs: dict[tuple[int, int, bool], _Graph | None] = {}  # None: its capture failed
        self._uses: dict[tuple[int, int, bool], int] = {}
        self.captures = 0  # graphs recorded (or tried)
        self._picked: Array | None = None  # the decode graphs' shared token array (module docstring)
        self._rows: Array | None = None  # 0, 1, 2, … on the device (the rows copied into it)
        self._greedy: tuple[Array, Array] | None = None  # the last decode replay's logits and greedy tokens

    def bucket(self, n: int) -> int | None:
        """The decode bucket of n sequences."""
        return next((b for b in self.sizes if b >= n), None)

    def replay_of(self, n: int) -> Callable[[], Array] | None:
        """The replay function of the decode bucket that runs n sequences, once captured (to time a step's GPU
        work)."""
        g = self._graphs.get((self.bucket(n) or 0, self.bucket(n) or 0, False))
        return g.replay if g is not None else None

    def greedy_of(self, logits: Array) -> Array | None:
        """The greedy token of every row of ``logits`` if they are the last decode replay's (its graph picked them),
        else None. Valid until the next replay."""
        return self._greedy[1] if self._greedy is not None and logits is self._greedy[0] else None

    def _holds(self, previous: Array | None) -> bool:
        """Whether ``previous`` is the last decode replay's greedy tokens (in the shared token array)."""
        return previous is not None and self._greedy is not None and previous is self._greedy[1]

    def run(self, ids: np.ndarray, meta: AttentionMetadata, previous: Array | None = None,
            source: np.ndarray | None = None, rows: np.ndarray | None = None) -> Array | None:
        """Logits of the step (host inputs, as the model runner builds them; where ``source[i] >= 0``, token i is
        ``previous[source[i]]``, the step before's sample on the device): of every row of a decode batch, of
        ``rows`` of a prefill step; or None where no graph runs it (graphs off or unsupported, a shape past the
        buckets, every row's logits asked of a prefill, a prefill shape's first use): the caller then runs the
        forward eagerly. The logits stay valid until the next replay."""
        if not self.backend.graphs or meta.block_tables.shape[1] > self.width:
            return None
        if meta.max_query_len == 1 and rows is None and len(ids) == meta.n_seqs:
            b = self.bucket(meta.n_seqs)
            key = (b, b, False) if b is not None else None
        elif rows is not None and len(ids) <= self.max_tokens:
            seqs = 1 << max(meta.n_seqs, len(rows) - 1).bit_length()  # room for the padding sequence and the rows
            key = (token_bucket(len(ids)), seqs, True)
            self._uses[key] = self._uses.get(key, 0) + 1
            if self._uses[key] < CAPTURE_AT_USE:
                return None
        else:
            key = None
        if key is None:
            return None
        be: Any = self.backend
        k = 0 if previous is None or source is None else len(previous)  # tokens fed from the step before
        if not key[2] and self._picked is None:
            self._picked = be.from_host(np.zeros(self.sizes[-1], np.int32))
            self._rows = be.from_host(np.arange(self.sizes[-1], dtype=np.int32))
        if not key[2] and k > len(self._picked):
            return None
        if key not in self._graphs:  # recorded once; a failed capture is not tried again
            tokens, seqs, prefill = key
            self.captures += 1
            # a decode graph's recording step overwrites the shared token array: what is to be fed from it, aside
            aside = be.feed_tokens(np.zeros(k, np.int32), previous, np.arange(k, dtype=np.int32)) if (
                k and not prefill and self._holds(previous)) else None
            try:
                g = _Graph(self.model, self.backend, self.cache, tokens, seqs, self.width, self.block_size,
                           self.pad_block, prefill, self.max_tokens if prefill else None, self.fresh,
                           None if prefill else self._picked)
            except Exception as e:  # noqa: BLE001 - a capture that fails costs speed, never the request
                warnings.warn(f"a {'prefill' if prefill else 'decode'} graph of {tokens} rows could not be captured "
                              f"({type(e).__name__}: {e}); that shape runs without a graph", RuntimeWarning,
                              stacklevel=2)
                g = None
            self._graphs[key] = g
            if aside is not None:
                be.feed_tokens_into(previous, aside, self._rows[:k])
        g = self._graphs[key]
        if g is None or g.replay is None:
            return None
        if g.best is not None and k and not self._holds(previous):  # tokens picked outside a decode graph
            be.feed_tokens_into(self._picked[:k], previous, self._rows[:k])
        logits = g.run(ids, meta, previous, source, rows)
        if g.best is not None:
            self._greedy = (logits, g.best[:len(ids)])
        return logits
