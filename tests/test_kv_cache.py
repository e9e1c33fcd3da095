"""The paged KV cache (``specengine.core.kv_cache.KVCache``) on the C++ block allocator: layout,
all-or-nothing growth, freeing (double frees through stale tables refused), capacity checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specengine import _C
from specengine.core.kv_cache import KVCache, KVCacheFullError
from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import Sequence
from specengine.sampling import SamplingParams


def make_seq(seq_id: int, num_tokens: int = 3) -> Sequence:
    return Sequence(seq_id, list(range(num_tokens)), SamplingParams(), seed=seq_id,
                    eos_token_ids=())


def make_cache(num_blocks: int = 8, block_size: int = 4) -> KVCache:
    return KVCache(num_blocks, block_size, num_layers=2, num_kv_heads=2, head_dim=8,
                   dtype=torch.float16, device="cpu")


def test_kv_cache_layout() -> None:
    cache = make_cache(num_blocks=5, block_size=4)
    assert cache.kv.shape == (2, 2, 5, 4, 2, 8)
    assert cache.kv.dtype == torch.float16
    assert cache.num_free_blocks == 5
    assert [cache.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="at least one block"):
        make_cache(num_blocks=0)


def test_kv_cache_ensure_grows_table() -> None:
    cache = make_cache(num_blocks=8, block_size=4)
    a, b = make_seq(0), make_seq(1)
    cache.ensure(a, 5)
    assert a.block_table == [0, 1]
    assert all(isinstance(x, int) for x in a.block_table)
    cache.ensure(a, 8)  # still two blocks
    assert a.block_table == [0, 1]
    cache.ensure(b, 1)
    cache.ensure(a, 9)
    assert a.block_table == [0, 1, 3] and b.block_table == [2]
    assert cache.num_free_blocks == 4
    assert cache.num_missing_blocks(a, 20) == 2 and cache.num_missing_blocks(a, 4) == 0
    assert cache.can_ensure(a, 4 * 7) and not cache.can_ensure(a, 4 * 7 + 1)
    refs = cache.allocator.ref_counts().tolist()
    assert refs == [1, 1, 1, 1, 0, 0, 0, 0]


def test_kv_cache_ensure_is_all_or_nothing() -> None:
    cache = make_cache(num_blocks=4, block_size=4)
    a, b = make_seq(0), make_seq(1)
    cache.ensure(a, 8)
    cache.ensure(b, 1)
    with pytest.raises(_C.OutOfBlocksError):
        cache.ensure(b, 4 * 3 + 1)  # needs 3 more, only 1 free
    assert b.block_table == [2]  # nothing appended
    assert cache.num_free_blocks == 1
    assert cache.allocator.ref_counts().tolist() == [1, 1, 1, 0]
    cache.ensure(b, 8)  # exactly the last block
    assert b.block_table == [2, 3] and cache.num_free_blocks == 0


def test_kv_cache_free_returns_blocks() -> None:
    cache = make_cache(num_blocks=6, block_size=2)
    a, b = make_seq(0), make_seq(1)
    cache.ensure(a, 6)
    cache.ensure(b, 4)
    a.num_cached_tokens = 5
    cache.free(a)
    assert a.block_table == [] and a.num_cached_tokens == 0
    assert cache.num_free_blocks == 4
    assert cache.allocator.ref_counts().tolist() == [0, 0, 0, 1, 1, 0]
    cache.free(a)  # an empty table frees nothing (and is no double free)
    assert cache.num_free_blocks == 4
    c = make_seq(2)
    cache.ensure(c, 6)  # LIFO: a's blocks come back first, in the order a held them
    assert c.block_table == [0, 1, 2]
    cache.free(b)
    cache.free(c)
    assert cache.num_free_blocks == 6


def test_kv_cache_free_twice_via_stale_table_raises() -> None:
    cache = make_cache(num_blocks=3, block_size=2)
    a = make_seq(0)
    cache.ensure(a, 4)
    stale = list(a.block_table)
    cache.free(a)
    a.block_table = stale
    with pytest.raises(ValueError, match="double free"):
        cache.free(a)
    assert cache.num_free_blocks == 3


def test_kv_cache_check_fits() -> None:
    cache = make_cache(num_blocks=4, block_size=4)
    cache.check_fits(16)  # exactly all blocks
    cache.check_fits(1)
    with pytest.raises(KVCacheFullError, match="needs 5 KV blocks but the cache has only 4"):
        cache.check_fits(17)
    assert issubclass(KVCacheFullError, RuntimeError)
    # check_fits is about capacity, not the current free count.
    seq = make_seq(0)
    cache.ensure(seq, 16)
    cache.check_fits(16)


def test_ensure_running_grows_every_table_at_once_or_none() -> None:
    """The decode step's growth of every short table (length + lookahead, capped by the
    context): one allocation written into the arena's rows, all or nothing, evicting cached
    blocks nobody holds when it must, widening the arena's table columns when needed."""
    cache = KVCache(6, 4, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16,
                    device="cpu", prefix_caching=True)
    arena = SeqArena(4, 100, block_width=2)
    a, b, c = make_seq(0, 4), make_seq(1, 4), make_seq(2, 8)
    for s in (a, b, c):
        cache.ensure(s, len(s))
    cache.prefix.register(c.block_table, [b"x", b"y"], cache.prefix.epoch)  # type: ignore
    cache.free(c)  # c's two blocks stay cached, held by nobody: they count as free
    for s in (a, b):
        s.attach(arena)
    slots = np.array([a.slot, b.slot])
    before = (a.block_table, b.block_table)
    assert cache.num_free_blocks == 4
    arena.lookahead[slots] = 9  # 4 + 9 tokens: 4 blocks each, 3 missing each, 6 > 4
    assert not cache.ensure_running(arena, slots)
    assert (a.block_table, b.block_table) == before and cache.num_free_blocks == 4
    arena.lookahead[slots] = 0  # covered already: nothing allocated
    assert cache.ensure_running(arena, slots) and cache.num_free_blocks == 4
    arena.lookahead[slots] = 8
    assert cache.ensure_running(arena, slots)  # 2 + 2 blocks: both cached ones evicted
    assert [len(a.block_table), len(b.block_table)] == [3, 3]
    assert arena.block_ids.shape[1] >= 3  # widened from 2 columns
    assert a.block_table[0] == before[0][0] and b.block_table[0] == before[1][0]
    assert sorted(a.block_table + b.block_table) == list(range(6))
    assert cache.num_free_blocks == 0
    assert cache.prefix.match([b"x"]) == []  # type: ignore[union-attr]  # evicted
    arena.lens[a.slot] = 99  # near the context: lookahead capped at 1 token, 25 blocks
    with pytest.raises(ValueError, match="outside the arena"):
        _C.grow_tables(cache.allocator, np.array([7]), 1, arena.lens, arena.lookahead,
                       arena.num_blocks, arena.block_ids, 100, 4)
    assert not cache.ensure_running(arena, slots)  # 22 more blocks: none free
    assert len(a.block_table) == 3
