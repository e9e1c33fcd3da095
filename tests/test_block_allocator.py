"""The C++ block allocator (``specengine._C.BlockAllocator``) against a Python model of
ownership, and the KV cache (``specengine.kv_cache.KVCache``) built on it.

The model keeps which sequence owns which block references and the allocator's free stack;
after every one of 10,000 random operations the allocator's reference counts, free count and
handed-out ids must equal the model's. Failing calls must raise the documented error and change
nothing.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from specengine import _C
from specengine.kv_cache import KVCache, KVCacheFullError
from specengine.sampling import SamplingParams
from specengine.sequence import Sequence

# --------------------------------------------------------------------------------------------
# Fixed, documented behaviour
# --------------------------------------------------------------------------------------------


def test_fresh_allocator_hands_out_ascending_ids() -> None:
    a = _C.BlockAllocator(6)
    assert a.num_blocks == 6 and a.num_free == 6
    first = a.allocate(4)
    assert first.dtype == np.int32
    assert first.tolist() == [0, 1, 2, 3]
    assert a.allocate(2).tolist() == [4, 5]
    assert a.num_free == 0
    assert a.ref_counts().tolist() == [1] * 6


def test_lifo_freed_blocks_come_back_in_freed_order() -> None:
    a = _C.BlockAllocator(8)
    a.allocate(8)
    a.free([5, 2, 7])
    a.free([1])
    # The latest free() comes back first, then the earlier one in the order it was passed.
    assert a.allocate(1).tolist() == [1]
    assert a.allocate(3).tolist() == [5, 2, 7]


def test_lifo_with_shared_block_returns_when_last_reference_drops() -> None:
    a = _C.BlockAllocator(4)
    a.allocate(4)
    a.incref([2])
    a.free([2, 3])  # 2 still referenced once: only 3 is freed
    assert a.num_free == 1 and a.ref_count(2) == 1 and a.ref_count(3) == 0
    a.free([0, 2])
    assert a.allocate(3).tolist() == [0, 2, 3]


def test_repeated_id_in_one_free_call() -> None:
    a = _C.BlockAllocator(3)
    a.allocate(3)
    a.incref([1])
    a.free([1, 0, 1])  # 1 reaches 0 at its second occurrence, after 0
    assert a.ref_counts().tolist() == [0, 0, 1]
    assert a.allocate(2).tolist() == [0, 1]


def test_reset_restores_fresh_order() -> None:
    a = _C.BlockAllocator(5)
    a.allocate(3)
    a.free([1])
    a.incref([0])
    a.reset()
    assert a.num_free == 5
    assert a.ref_counts().tolist() == [0] * 5
    assert a.allocate(5).tolist() == [0, 1, 2, 3, 4]


def test_ref_counts_is_a_copy() -> None:
    a = _C.BlockAllocator(3)
    a.allocate(1)
    refs = a.ref_counts()
    refs[0] = 99
    assert a.ref_count(0) == 1


def _state(a) -> tuple[list[int], int]:
    return a.ref_counts().tolist(), a.num_free


def test_exhaustion_raises_and_changes_nothing() -> None:
    a = _C.BlockAllocator(5)
    a.allocate(3)
    before = _state(a)
    with pytest.raises(_C.OutOfBlocksError, match="only 2 of 5"):
        a.allocate(3)
    assert issubclass(_C.OutOfBlocksError, RuntimeError)
    assert _state(a) == before
    with pytest.raises(_C.OutOfBlocksError):
        a.allocate_batch([1, 1, 1])  # 3 > 2 free: none of the lists is allocated
    assert _state(a) == before
    assert a.allocate(2).tolist() == [3, 4]  # the free stack was not disturbed either


def test_allocate_batch_all_or_nothing_and_order() -> None:
    a = _C.BlockAllocator(10)
    lists = a.allocate_batch([2, 0, 3])
    assert [x.tolist() for x in lists] == [[0, 1], [], [2, 3, 4]]
    assert all(x.dtype == np.int32 for x in lists)
    before = _state(a)
    with pytest.raises(ValueError, match="negative"):
        a.allocate_batch([1, -1])
    assert _state(a) == before
    with pytest.raises(_C.OutOfBlocksError):
        a.allocate_batch([4, 2])
    assert _state(a) == before
    assert [x.tolist() for x in a.allocate_batch([4, 1])] == [[5, 6, 7, 8], [9]]
    assert a.allocate_batch([]) == []


def test_double_free_raises_and_changes_nothing() -> None:
    a = _C.BlockAllocator(4)
    a.allocate(3)
    a.free([1])
    before = _state(a)
    with pytest.raises(ValueError, match="double free of KV block 1"):
        a.free([0, 1])  # 0 is valid but must not be freed when the call fails
    assert _state(a) == before
    with pytest.raises(ValueError, match="double free of KV block 2"):
        a.free([2, 2])  # one reference, freed twice in one call
    assert _state(a) == before
    with pytest.raises(ValueError, match="double free"):
        a.free_batch([[0], [2], [0]])  # validated as one call across the lists
    assert _state(a) == before
    a.free_batch([[0], [2]])
    assert a.num_free == 4


@pytest.mark.parametrize("bad", [-1, 4, 2**31, -(2**40)])
def test_out_of_range_ids_raise_and_change_nothing(bad: int) -> None:
    a = _C.BlockAllocator(4)
    a.allocate(2)
    before = _state(a)
    for call in (a.free, a.incref):
        with pytest.raises(ValueError, match="out of range"):
            call([0, bad])
        assert _state(a) == before
    with pytest.raises(ValueError, match="out of range"):
        a.free_batch([[0], [bad]])
    with pytest.raises(ValueError, match="out of range"):
        a.ref_count(bad)
    assert _state(a) == before


def test_incref_of_free_block_raises() -> None:
    a = _C.BlockAllocator(3)
    a.allocate(1)
    with pytest.raises(ValueError, match="which is free"):
        a.incref([0, 2])
    assert a.ref_counts().tolist() == [1, 0, 0]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        _C.BlockAllocator(-1)
    a = _C.BlockAllocator(2)
    with pytest.raises(ValueError, match="negative"):
        a.allocate(-1)
    with pytest.raises(TypeError, match="integers"):
        a.free(np.array([0.5]))
    with pytest.raises(ValueError, match="1-D"):
        a.free(np.zeros((1, 1), dtype=np.int64))
    assert a.allocate(0).tolist() == []
    a.free([])  # empty input is a no-op, whatever its dtype
    a.free(np.asarray([]))
    assert _state(a) == ([0, 0], 2)
    empty = _C.BlockAllocator(0)
    assert empty.num_free == 0 and empty.allocate(0).tolist() == []
    with pytest.raises(_C.OutOfBlocksError):
        empty.allocate(1)


def test_accepts_numpy_and_tensor_ids() -> None:
    a = _C.BlockAllocator(6)
    blocks = a.allocate(6)
    a.incref(torch.tensor([0, 1], dtype=torch.int32))
    a.free(blocks[:3])  # the int32 array allocate() returned
    a.free(np.array([0, 1], dtype=np.uint8))
    assert a.ref_counts().tolist() == [0, 0, 0, 1, 1, 1]


# --------------------------------------------------------------------------------------------
# Randomised ownership model
# --------------------------------------------------------------------------------------------


class Model:
    """What the allocator must look like: the free stack and who owns which references."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.stack = list(range(num_blocks - 1, -1, -1))  # back is handed out next
        self.seqs: dict[int, list[int]] = {}  # sequence -> its block references, in order
        self.next_seq = 0

    def refs(self) -> list[int]:
        counts = Counter(b for blocks in self.seqs.values() for b in blocks)
        return [counts.get(b, 0) for b in range(self.num_blocks)]

    def pop(self, n: int) -> list[int]:
        out = [self.stack.pop() for _ in range(n)]
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop the references (already removed from their owners) and push the zeroed ones."""
        refs = Counter(b for owned in self.seqs.values() for b in owned)
        for b in blocks:
            assert 0 <= b < self.num_blocks
        remaining = Counter(blocks)
        zeroed = []
        for b in blocks:
            remaining[b] -= 1
            if refs[b] == 0 and remaining[b] == 0:
                zeroed.append(b)
        self.stack.extend(reversed(zeroed))

    def new_seq(self, blocks: list[int]) -> int:
        sid = self.next_seq
        self.next_seq += 1
        self.seqs[sid] = list(blocks)
        return sid


def check(a, model: Model) -> None:
    refs = a.ref_counts().tolist()
    expected = model.refs()
    assert refs == expected, "reference counts differ from the ownership model"
    assert all(r >= 0 for r in refs)
    free = sum(1 for r in refs if r == 0)
    assert a.num_free == free == len(model.stack)
    assert sorted(model.stack) == [b for b in range(model.num_blocks) if refs[b] == 0]


def expect_unchanged(a, model: Model, exc: type[BaseException], call) -> None:
    before = a.ref_counts().tolist(), a.num_free
    with pytest.raises(exc):
        call()
    assert (a.ref_counts().tolist(), a.num_free) == before
    check(a, model)


@pytest.mark.parametrize("seed,num_blocks", [(0, 48), (1, 7), (2, 200)])
def test_random_operations_match_model(seed: int, num_blocks: int) -> None:
    rng = random.Random(seed)
    a = _C.BlockAllocator(num_blocks)
    model = Model(num_blocks)
    ops = ["allocate", "extend", "allocate_batch", "free_tail", "finish", "finish_batch", "fork",
           "double_free", "out_of_range", "incref_free", "exhaust"]
    weights = [10, 12, 5, 8, 8, 3, 6, 3, 2, 2, 3]
    seen = Counter()
    for _ in range(10_000):
        op = rng.choices(ops, weights)[0]
        seen[op] += 1
        sids = list(model.seqs)
        if op == "allocate":
            n = rng.randint(0, 6)
            if n > len(model.stack):
                expect_unchanged(a, model, _C.OutOfBlocksError, lambda n=n: a.allocate(n))
                continue
            got = a.allocate(n).tolist()
            assert got == model.pop(n)  # deterministic LIFO order
            model.new_seq(got)
        elif op == "extend" and sids:
            sid = rng.choice(sids)
            n = rng.randint(1, 4)
            if n > len(model.stack):
                expect_unchanged(a, model, _C.OutOfBlocksError, lambda n=n: a.allocate(n))
                continue
            got = a.allocate(n).tolist()
            assert got == model.pop(n)
            model.seqs[sid].extend(got)
        elif op == "allocate_batch":
            counts = [rng.randint(0, 4) for _ in range(rng.randint(0, 4))]
            if sum(counts) > len(model.stack):
                expect_unchanged(a, model, _C.OutOfBlocksError,
                                 lambda c=counts: a.allocate_batch(c))
                continue
            got = [x.tolist() for x in a.allocate_batch(counts)]
            assert [len(x) for x in got] == counts
            for blocks in got:
                assert blocks == model.pop(len(blocks))
                model.new_seq(blocks)
        elif op == "free_tail" and sids:
            # A sequence gives back its last few blocks (e.g. a rejected speculative tail).
            sid = rng.choice(sids)
            owned = model.seqs[sid]
            k = rng.randint(0, len(owned))
            tail = owned[len(owned) - k:]
            del owned[len(owned) - k:]
            a.free(np.asarray(tail, dtype=rng.choice([np.int32, np.int64])))
            model.release(tail)
        elif op == "finish" and sids:
            sid = rng.choice(sids)
            blocks = model.seqs.pop(sid)
            a.free(blocks)
            model.release(blocks)
        elif op == "finish_batch" and sids:
            chosen = rng.sample(sids, rng.randint(1, min(4, len(sids))))
            lists = [model.seqs.pop(s) for s in chosen]
            a.free_batch(lists)
            model.release([b for blocks in lists for b in blocks])
        elif op == "fork" and sids:
            # A new sequence shares a prefix of an existing one (references, not copies).
            parent = model.seqs[rng.choice(sids)]
            prefix = parent[: rng.randint(0, len(parent))]
            a.incref(prefix)
            model.new_seq(prefix)
        elif op == "double_free":
            refs = model.refs()
            owned = [b for b in range(num_blocks) if refs[b] > 0]
            if owned and rng.random() < 0.5:
                b = rng.choice(owned)
                bad = [b] * (refs[b] + 1)  # one more reference than exists
            else:
                free_ids = [b for b in range(num_blocks) if refs[b] == 0]
                if not free_ids:
                    continue
                bad = [rng.choice(free_ids)]
            valid = owned[:1]  # a valid id in the same call must not be freed either
            mixed = valid + bad
            rng.shuffle(mixed)
            expect_unchanged(a, model, ValueError, lambda m=mixed: a.free(m))
        elif op == "out_of_range":
            bad = rng.choice([-1, num_blocks, num_blocks + rng.randint(1, 1000), -(2**33)])
            refs = model.refs()
            valid = [b for b in range(num_blocks) if refs[b] > 0][:2]
            call = rng.choice([a.free, a.incref])
            expect_unchanged(a, model, ValueError, lambda c=call, v=valid + [bad]: c(v))
            expect_unchanged(a, model, ValueError, lambda b=bad: a.ref_count(b))
        elif op == "incref_free":
            refs = model.refs()
            free_ids = [b for b in range(num_blocks) if refs[b] == 0]
            if free_ids:
                b = rng.choice(free_ids)
                expect_unchanged(a, model, ValueError, lambda b=b: a.incref([b]))
        elif op == "exhaust":
            n = len(model.stack) + rng.randint(1, 3)
            expect_unchanged(a, model, _C.OutOfBlocksError, lambda n=n: a.allocate(n))
            expect_unchanged(a, model, _C.OutOfBlocksError,
                             lambda n=n: a.allocate_batch([0, n - 1, 1]))
        check(a, model)
        for b in rng.sample(range(num_blocks), min(3, num_blocks)):
            assert a.ref_count(b) == model.refs()[b]
    # Every kind of operation really happened, and the pool is whole once everyone finishes.
    assert all(seen[op] > 50 for op in ops)
    a.free_batch(list(model.seqs.values()))
    assert a.num_free == num_blocks and not any(a.ref_counts())


# --------------------------------------------------------------------------------------------
# KVCache
# --------------------------------------------------------------------------------------------


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
