"""Batched forwards on explicit placements, as the engine's model runner builds them (CPU and CUDA backend tests)."""

from __future__ import annotations

from typing import Any

import numpy as np

from quanta.backends.base import AttentionMetadata

# two sequences' block tables on a pool of 12 blocks of 4 tokens: scattered, not in order
TABLES = [[5, 2, 9, 0, 7, 11], [3, 10, 1, 6, 4, 8]]
BLOCK = 4


def placement(chunks: list[tuple[list[int], int, int]], block_size: int) -> AttentionMetadata:
    """Host metadata of one forward: sequence j (its block table) computes ``count`` positions from ``first``."""
    positions, slots, token_seq, starts = [], [], [], [0]
    tables = np.zeros((len(chunks), max(len(t) for t, _, _ in chunks)), np.int32)
    for j, (table, first, count) in enumerate(chunks):
        tables[j, :len(table)] = table
        for p in range(first, first + count):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
            token_seq.append(j)
        starts.append(starts[-1] + count)
    as32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    return AttentionMetadata(as32(positions), as32(slots), as32(token_seq), tables,
                             as32([f + c for _, f, c in chunks]), as32(starts), len(chunks),
                             max(c for _, _, c in chunks), block_size)


def run_steps(backend: Any, model: Any, tokens: list[list[int]], steps: list[list[tuple[int, int, int]]],
              tables: list[list[int]] = TABLES, kv_dtype: str = "auto") -> list[np.ndarray]:
    """Every row's logits of each forward of ``steps``: lists of (sequence, first position, count), sequence j's
    tokens ``tokens[j]``, on a fresh pool (as many blocks as the tables name, stored as ``kv_dtype``)."""
    cache = backend.kv_cache(model.kv_shape(max(max(t) for t in tables) + 1, BLOCK), kv_dtype)
    out = []
    for step in steps:
        meta = placement([(tables[j], first, n) for j, first, n in step], BLOCK)
        ids = np.concatenate([tokens[j][first:first + n] for j, first, n in step]).astype(np.int32)
        logits = model.forward(backend.from_host(ids), backend.metadata(meta), cache, None)
        out.append(np.array(backend.to_host(logits), np.float32))
    return out
