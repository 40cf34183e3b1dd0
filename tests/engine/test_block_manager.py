"""The block manager on its own: reference counts, prefix sharing of identical full blocks only, LRU eviction,
and invariants under random operation sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quanta.engine.block_manager import BlockManager, BlockTable

B = 4


def computed(bm: BlockManager, tokens: list[int]) -> BlockTable:
    """A table holding ``tokens`` (prefix matched, the rest allocated and computed, full blocks registered)."""
    t = BlockTable()
    bm.match_prefix(t, tokens)
    assert bm.grow(t, len(tokens))
    bm.register_full(t, tokens, len(tokens))
    return t


def test_grow_and_free_count_blocks():
    bm = BlockManager(8, B)
    t = BlockTable()
    assert bm.grow(t, 9) and len(t.blocks) == 3 and bm.n_free == 5
    assert bm.grow(t, 12) and len(t.blocks) == 3  # still fits
    assert not bm.grow(t, 100) and len(t.blocks) == 3  # nothing allocated on failure
    bm.free(t)
    assert bm.n_free == 8 and t.blocks == []


def test_identical_prefix_shares_full_blocks_only():
    bm = BlockManager(16, B)
    a = computed(bm, list(range(10)))  # blocks: [0..3] [4..7] full, [8, 9] partial
    b = BlockTable()
    assert bm.match_prefix(b, list(range(10)) + [99]) == 8
    assert b.blocks == a.blocks[:2]
    assert all(bm.blocks[i].ref_count == 2 for i in a.blocks[:2]) and bm.blocks[a.blocks[2]].ref_count == 1


def test_last_token_is_always_left_to_compute():
    bm = BlockManager(16, B)
    computed(bm, list(range(8)))
    t = BlockTable()
    assert bm.match_prefix(t, list(range(8))) == 4  # the second block holds the last token: recomputed


def test_different_tokens_miss():
    bm = BlockManager(16, B)
    computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    t = BlockTable()
    assert bm.match_prefix(t, [1, 2, 3, 5, 5, 6, 7, 8, 9]) == 0
    t2 = BlockTable()
    assert bm.match_prefix(t2, [1, 2, 3, 4, 9, 9, 9, 9, 9]) == 4  # the chain breaks at the second block


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, B)
    first = computed(bm, list(range(9)))  # 3 blocks, 2 keyed
    bm.free(first)
    assert bm.n_free == 4
    again = BlockTable()
    assert bm.match_prefix(again, list(range(9))) == 8  # served from the freed, cached blocks
    bm.free(again)
    other = BlockTable()
    assert bm.grow(other, 12)  # 3 blocks: the 2 unkeyed ones, then the least recently freed keyed one
    probe = BlockTable()
    # a table is freed tail first, so its second block went first: the first one still matches
    assert bm.match_prefix(probe, list(range(9))) == 4


def test_double_free_is_caught():
    bm = BlockManager(4, B)
    t = BlockTable()
    bm.grow(t, 4)
    block = t.blocks[0]
    bm.free(t)
    with pytest.raises(AssertionError):
        bm._release(block)


def test_truncate_keeps_a_prefix():
    bm = BlockManager(8, B)
    t = computed(bm, list(range(12)))
    bm.truncate(t, 5)
    assert len(t.blocks) == 2 and len(t.keys) == 1 and bm.n_free == 6


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=20)  # a tiny alphabet: many shared prefixes


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "free", "grow", "truncate"]), tokens_st, st.integers(0, 30)),
                max_size=40))
def test_invariants_under_random_operations(ops):
    bm = BlockManager(24, B)
    live: list[tuple[BlockTable, list[int]]] = []
    for op, tokens, k in ops:
        if op == "add":
            t = BlockTable()
            hit = bm.match_prefix(t, tokens)
            assert hit % B == 0 and hit < len(tokens)
            for i, block_id in enumerate(t.blocks):  # a hit only on identical tokens
                assert bm.blocks[block_id].tokens == tuple(tokens[i * B:(i + 1) * B])
            if bm.grow(t, len(tokens)):
                bm.register_full(t, tokens, len(tokens))
                live.append((t, list(tokens)))
            else:
                bm.free(t)
        elif live and op == "free":
            t, _ = live.pop(k % len(live))
            bm.free(t)
        elif live and op == "grow":
            t, toks = live[k % len(live)]
            extra = [k % 3] * (k % 7)
            if bm.grow(t, len(toks) + len(extra)):
                toks += extra
                bm.register_full(t, toks, len(toks))
        elif live and op == "truncate":
            t, toks = live[k % len(live)]
            n = max(1, len(toks) - k % 9)
            if all(bm.blocks[b].ref_count == 1 for b in t.blocks[n // B:]):
                bm.truncate(t, n)
                del toks[n:]
        refs = [0] * bm.n_blocks
        for t, toks in live:
            assert len(t.blocks) == bm.blocks_for(len(toks))
            for b in t.blocks:
                refs[b] += 1
        assert refs == [blk.ref_count for blk in bm.blocks]
        assert bm.n_free == sum(r == 0 for r in refs)  # no leak, no block both free and in use
    for t, _ in live:
        bm.free(t)
    assert bm.n_free == bm.n_blocks
