"""The C++ block allocator (``specengine._C.BlockAllocator``): its documented order, errors and
all-or-nothing calls (random operations against a model: test_block_allocator_model.py; the
KV cache built on it: test_kv_cache.py). Failing calls must raise the documented error and
change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specengine import _C

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
