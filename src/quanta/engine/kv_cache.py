"""The engine's view of the KV cache: the backend's arena plus the token ids it currently holds.

Knowing the cached ids lets a new request reuse the longest common prefix (multi-turn chat re-sends the whole
history; only the new turn is prefilled).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quanta.backends.base import Backend, KVShape


class KVCache:
    def __init__(self, backend: Backend, shape: KVShape):
        self.shape = shape
        self.arena: Any = backend.kv_cache(shape)
        self.tokens: list[int] = []

    @property
    def n_ctx(self) -> int:
        return self.shape.n_ctx

    @property
    def itemsize(self) -> int:
        """Bytes per cached K or V value (4 for float32, 2 for the GPU default mode's float16)."""
        return self.arena.nbytes // self.shape.nbytes(1)

    def reuse(self, ids: Sequence[int]) -> int:
        """Keep the cached prefix shared with ``ids`` (at most len(ids) - 1, so the last token is recomputed
        and yields logits); returns how many positions are reused."""
        n = 0
        limit = min(len(self.tokens), len(ids) - 1)
        while n < limit and self.tokens[n] == ids[n]:
            n += 1
        del self.tokens[n:]
        return n

    def append(self, ids: Sequence[int]) -> None:
        """Record ids whose K/V the backend has just written at the next positions."""
        self.tokens.extend(int(i) for i in ids)

    def reset(self) -> None:
        self.tokens.clear()
