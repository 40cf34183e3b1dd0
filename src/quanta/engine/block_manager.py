"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts and prefix caching (no arrays here).

A sequence owns a block table: block ``i`` of it holds the K/V of its positions ``i*B .. i*B + B-1`` at pool
slots ``block*B + offset``. A block is shared only when full: full blocks are keyed by a hash chain over their
tokens (block i's key covers every token up to the end of block i), so a new sequence whose first tokens equal a
cached chain reuses those blocks and skips their prefill. Freed blocks that carry a key stay cached until evicted,
least recently freed first; blocks without one are reused first. Nothing is ever written into a shared block:
prefix matching stops before the block holding a prompt's last token (which must be computed to give logits).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field


@dataclass(eq=False)
class Block:
    id: int
    ref_count: int = 0
    key: int | None = None  # hash-chain key once full and computed (then shareable)
    tokens: tuple[int, ...] = ()  # the tokens of a keyed block (hits are checked against them)


@dataclass(eq=False)
class BlockTable:
    """A sequence's blocks and the keys of its full, registered ones (``keys[i]`` is block i's chain key)."""

    blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)


def chain_key(previous: int | None, tokens: Seq[int]) -> int:
    """The key of a full block: its tokens and everything before them (through the previous block's key)."""
    return hash((previous, tuple(tokens)))


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = True):
        if n_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(n_blocks)]
        self._clean: list[int] = list(range(n_blocks - 1, -1, -1))  # unkeyed free blocks (a stack: low ids first)
        self._cached: OrderedDict[int, None] = OrderedDict()  # keyed free blocks, least recently freed first
        self._by_key: dict[int, int] = {}
        self.hits = 0  # prompt tokens served from the prefix cache, since the start

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def n_free(self) -> int:
        return len(self._clean) + len(self._cached)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_free

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------------------------
    def match_prefix(self, table: BlockTable, tokens: Seq[int]) -> int:
        """Attach the longest cached chain of ``tokens``' full blocks to the empty ``table`` (leaving at least the
        last token to compute); returns the number of tokens reused."""
        assert not table.blocks
        if not self.prefix_caching:
            return 0
        b, key = self.block_size, None
        for i in range((len(tokens) - 1) // b):
            chunk = tuple(tokens[i * b:(i + 1) * b])
            key = chain_key(key, chunk)
            block_id = self._by_key.get(key)
            if block_id is None or self.blocks[block_id].tokens != chunk:
                break
            self._take(block_id)
            table.blocks.append(block_id)
            table.keys.append(key)
        reused = len(table.blocks) * b
        self.hits += reused
        return reused

    def register_full(self, table: BlockTable, tokens: Seq[int], n_computed: int) -> None:
        """Key the table's blocks that are full and computed (``n_computed`` tokens hold K/V) so later sequences
        can share them."""
        if not self.prefix_caching:
            return
        b = self.block_size
        for i in range(len(table.keys), min(n_computed // b, len(table.blocks))):
            chunk = tuple(tokens[i * b:(i + 1) * b])
            key = chain_key(table.keys[-1] if table.keys else None, chunk)
            table.keys.append(key)
            block = self.blocks[table.blocks[i]]
            if key not in self._by_key:  # an identical block computed concurrently keeps the first one's key
                block.key, block.tokens = key, chunk
                self._by_key[key] = block.id

    # ---- allocation ------------------------------------------------------------------------------------------
    def can_grow(self, table: BlockTable, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) - len(table.blocks) <= self.n_free

    def grow(self, table: BlockTable, n_tokens: int) -> bool:
        """Give ``table`` blocks for ``n_tokens`` positions; False (and nothing allocated) when too few are free."""
        need = self.blocks_for(n_tokens) - len(table.blocks)
        if need > self.n_free:
            return False
        for _ in range(need):
            table.blocks.append(self._allocate())
        return True

    def free(self, table: BlockTable) -> None:
        """Release every block of ``table`` (newest first, so a sequence's tail is evicted before its head)."""
        for block_id in reversed(table.blocks):
            self._release(block_id)
        table.blocks.clear()
        table.keys.clear()

    def truncate(self, table: BlockTable, n_tokens: int) -> None:
        """Keep only the blocks holding positions below ``n_tokens`` (and the keys of blocks still full)."""
        keep = self.blocks_for(n_tokens)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())
        full = n_tokens // self.block_size
        if n_tokens % self.block_size and full < len(table.keys):  # a kept block turns partial: it is written again
            block = self.blocks[table.blocks[full]]
            assert block.ref_count == 1, "truncating into a shared block"
            if block.key is not None and self._by_key.get(block.key) == block.id:
                del self._by_key[block.key]
            block.key, block.tokens = None, ()
        del table.keys[full:]

    def reset_prefix_cache(self) -> None:
        """Forget every cached chain (blocks in use keep their contents but are no longer shareable)."""
        for block in self.blocks:
            block.key, block.tokens = None, ()
        self._by_key.clear()
        self._clean.extend(reversed(self._cached))
        self._cached.clear()

    def _allocate(self) -> int:
        if self._clean:
            block_id = self._clean.pop()
        else:
            block_id, _ = self._cached.popitem(last=False)  # evict the least recently freed cached block
            block = self.blocks[block_id]
            del self._by_key[block.key]
            block.key, block.tokens = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._cached[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.key is not None:
                self._cached[block_id] = None
            else:
                self._clean.append(block_id)
