"""Runs scheduled batches through the model: explicit inputs for the backend, the KV pool, its size.

A batch becomes token ids, positions, KV-pool slots, block tables and the rows that need logits
(:class:`quanta.backends.base.AttentionMetadata`); the model's forward then runs the whole batch at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quanta.backends.base import Array, AttentionMetadata, Backend
from quanta.engine.config import EngineConfig
from quanta.engine.scheduler import ScheduledBatch
from quanta.engine.sequence import PENDING
from quanta.errors import QuantaError
from quanta.models.base import Model


# after this many dry runs in a row that compile nothing, new shapes run without one (a server's prompts come in
# ever new lengths; the few kernels still missing then compile at their launch)
QUIET_DRY_RUNS = 8


def pool_blocks(model: Model, backend: Backend, config: EngineConfig, n_ctx: int) -> int:
    """Blocks of the KV pool: ``kv_blocks``, or ``kv_memory`` bytes' worth, or room for ``max_seqs`` full contexts
    within ``kv_memory_fraction`` of the device's free memory. At least one full context."""
    b = config.block_size
    per_block = backend.kv_nbytes(model.kv_shape(1, b), config.kv_dtype)
    one_context = -(-n_ctx // b)
    if config.kv_blocks is not None:
        n = config.kv_blocks
    elif config.kv_memory is not None:
        n = config.kv_memory // per_block
    else:
        n = one_context * config.max_seqs
        free = backend.free_memory()
        if free is not None:
            n = min(n, int(free * config.kv_memory_fraction) // per_block)
    if n < one_context:
        raise QuantaError(f"the KV pool would hold {n * b:,} tokens ({n * per_block / 2**30:.2f} GiB), less than one "
                          f"context of {n_ctx:,} tokens ({one_context * per_block / 2**30:.2f} GiB); lower n_ctx "
                          f"(--n-ctx) or give the pool more memory (--kv-memory / --kv-blocks)")
    return n


def decode_rows(meta: AttentionMetadata) -> AttentionMetadata:
    """A verify step (each sequence's last token and its drafts, all sampled, no prefill) as a decode step of one
    sequence per token: token i attends through its sequence's blocks to the positions up to its own, as it does as
    a query of its sequence's chunk (the K/V of the drafts before it are written, in each layer, before attention
    reads the pool: the decode graphs that run it are recorded with ``fresh`` rows, AttentionMetadata's). So verify
    steps replay the captured decode graphs."""
    n = len(meta.positions)
    return AttentionMetadata(meta.positions, meta.slots, np.arange(n, dtype=np.int32),
                             meta.block_tables[meta.token_seq], meta.positions + 1, np.arange(n + 1, dtype=np.int32),
                             n, 1, meta.block_size)


class ModelRunner:
    def __init__(self, model: Model, backend: Backend, config: EngineConfig, n_ctx: int):
        self.model, self.backend, self.block_size = model, backend, config.block_size
        self.n_blocks = pool_blocks(model, backend, config, n_ctx)
        self.cache: Any = backend.kv_cache(model.kv_shape(self.n_blocks, self.block_size), config.kv_dtype)
        self.graphs = None
        self._eager_shapes: set[tuple[int, int, int, int | None]] = set()  # run eagerly so far
        self._quiet_dry_runs = 0  # dry runs in a row that found nothing to compile
        if backend.graphs:
            from quanta.engine.graphs import ForwardGraphs

            rows, fresh = config.max_seqs, 1  # decode graphs' rows: with speculation, a verify step's drafts too
            if config.speculative is not None:
                rows = min(rows * (1 + config.speculative.max_draft), config.max_batched_tokens)
                fresh = 1 + config.speculative.max_draft
            self.graphs = ForwardGraphs(model, backend, self.cache, max_seqs=rows,
                                        max_tokens=config.max_batched_tokens, n_ctx=n_ctx,
                                        block_size=self.block_size, n_blocks=self.n_blocks, fresh=fresh)

    @property
    def captures(self) -> int:
        """Graphs captured so far (a step that captured one is not a step's usual time)."""
        return self.graphs.captures if self.graphs is not None else 0

    def run(self, batch: ScheduledBatch, previous: Array | None = None,
            pending_rows: dict[tuple[int, int], int] | None = None) -> Array:
        """The forward of ``batch``: logits of its sampling sequences' last tokens, in batch order. Tokens still
        ``PENDING`` are the previous step's samples: ``previous[pending_rows[seq id, index]]`` on the device."""
        ids, meta, rows = self.inputs(batch)
        source = None
        if pending_rows and (ids == PENDING).any():
            source = np.full(len(ids), -1, np.int32)
            o = 0
            for seq, k in zip(batch.seqs, batch.num_tokens):
                for i in range(seq.num_computed, min(seq.num_computed + k, seq.num_tokens)):
                    if seq.token_ids[i] == PENDING:
                        source[o + i - seq.num_computed] = pending_rows[seq.id, i]
                o += k
        return self.execute(ids, meta, rows, previous, source)

    def execute(self, ids: np.ndarray, meta: AttentionMetadata, rows: np.ndarray | None,
                previous: Array | None = None, source: np.ndarray | None = None) -> Array:
        """The forward of explicit host inputs (:meth:`inputs`' three, and where ``source[i] >= 0`` token i is
        ``previous[source[i]]`` on the device), through a captured graph where one runs it. The lead of a
        tensor-parallel group first sends the inputs to the other ranks, which run the same forward
        (quanta.parallel.launch.follow); their token ids come from the lead's inside it."""
        parallel = self.model.parallel
        if parallel is not None and parallel.rank == 0:
            parallel.lead((ids, meta, rows))
        if self.graphs is not None:
            verify = meta.max_query_len > 1 and rows is None and meta.prefill is not None and not meta.prefill.any()
            logits = self.graphs.run(ids, decode_rows(meta) if verify else meta, previous, source, rows)
            if logits is not None:
                return logits  # a captured graph
        be = self.backend

        def forward() -> Array:
            return self.model.forward(be.feed_tokens(ids, previous, source), be.metadata(meta), self.cache,
                                      None if rows is None else be.from_host(rows))

        shape = (len(ids), meta.n_seqs, meta.max_query_len, None if rows is None else len(rows))
        if self._quiet_dry_runs < QUIET_DRY_RUNS and shape not in self._eager_shapes:
            # a new shape may launch kernels not compiled yet: all of them at once
            self._eager_shapes.add(shape)
            compiled = be.compile_ahead(forward)
            # (a tensor-parallel group keeps dry-running new shapes: its ranks must agree without a collective)
            self._quiet_dry_runs = 0 if compiled or parallel is not None else self._quiet_dry_runs + 1
        return forward()

    def greedy(self, logits: Array) -> Array:
        """The greedy token of every row of ``logits`` (``Backend.argmax_rows``), left on the device; those of a
        captured decode step were picked inside its graph."""
        best = self.graphs.greedy_of(logits) if self.graphs is not None else None
        return self.backend.argmax_rows(logits) if best is None else best

    def inputs(self, batch: ScheduledBatch) -> tuple[np.ndarray, AttentionMetadata, np.ndarray | None]:
        """Token ids (``PENDING`` where not known yet), placement and logit rows of ``batch`` (host arrays)."""
        b = self.block_size
        n, s = batch.total_tokens, len(batch)
        if n == s and all(batch.samples(j) for j in range(s)):
            return self._decode_inputs(batch)
        ids = np.empty(n, np.int32)
        positions = np.empty(n, np.int32)
        token_seq = np.empty(n, np.int32)
        starts = np.zeros(s + 1, np.int32)
        tables = np.zeros((s, max(len(seq.table.blocks) for seq in batch.seqs)), np.int32)
        seq_lens = np.empty(s, np.int32)
        prefill = np.zeros(s, bool)
        rows = []
        o = 0
        for j, (seq, k) in enumerate(zip(batch.seqs, batch.num_tokens)):
            first = seq.num_computed
            ids[o:o + k] = seq.token_ids[first:first + k] + seq.draft if seq.draft else seq.token_ids[first:first + k]
            positions[o:o + k] = np.arange(first, first + k)
            token_seq[o:o + k] = j
            tables[j, :len(seq.table.blocks)] = seq.table.blocks
            seq_lens[j] = first + k
            prefill[j] = k - len(seq.draft) > 1
            o += k
            starts[j + 1] = o
            if batch.samples(j):
                rows.extend(range(o - 1 - len(seq.draft), o))
        slots = tables[token_seq, positions // b] * b + positions % b
        meta = AttentionMetadata(positions, slots.astype(np.int32), token_seq, tables, seq_lens, starts, s,
                                 int(max(batch.num_tokens)), b, prefill)
        return ids, meta, None if len(rows) == n else np.asarray(rows, np.int32)

    def _decode_inputs(self, batch: ScheduledBatch) -> tuple[np.ndarray, AttentionMetadata, None]:
        """:meth:`inputs` of a decode-only batch (each sequence's last token), the common step: built from lists."""
        b = self.block_size
        positions = [seq.num_computed for seq in batch.seqs]
        width = max(len(seq.table.blocks) for seq in batch.seqs)
        tables = np.zeros((len(batch), width), np.int32)
        slots = []
        for j, (seq, p) in enumerate(zip(batch.seqs, positions)):
            blocks = seq.table.blocks
            tables[j, :len(blocks)] = blocks
            slots.append(blocks[p // b] * b + p % b)
        s = len(batch)
        pos = np.array(positions, np.int32)
        meta = AttentionMetadata(pos, np.array(slots, np.int32), np.arange(s, dtype=np.int32), tables, pos + 1,
                                 np.arange(s + 1, dtype=np.int32), s, 1, b)
        return np.array([seq.token_ids[p] for seq, p in zip(batch.seqs, positions)], np.int32), meta, None

    def score(self, token_ids: list[int], table: list[int], chunk: int) -> np.ndarray:
        """Teacher-forced logits (n, vocab) of ``token_ids`` written into the blocks ``table``, ``chunk`` tokens per
        forward."""
        b, n = self.block_size, len(token_ids)
        out = np.empty((n, self.model.n_vocab), np.float32)
        blocks = np.asarray(table, np.int32)[None, :]
        for start in range(0, n, chunk):
            k = min(chunk, n - start)
            positions = np.arange(start, start + k, dtype=np.int32)
            meta = AttentionMetadata(positions, (blocks[0, positions // b] * b + positions % b).astype(np.int32),
                                     np.zeros(k, np.int32), blocks, np.asarray([start + k], np.int32),
                                     np.asarray([0, k], np.int32), 1, k, b, np.asarray([k > 1]))
            logits = self.execute(np.asarray(token_ids[start:start + k], np.int32), meta, None)
            out[start:start + k] = self.backend.to_host(logits)
        return out
