"""The arena's C++ passes against their numpy references, and their refusals:
``SeqArena.append_packed``, the staging pass, block tables in the arena, tree-path moves."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from arena_reference import append_reference, pack
from tree_path_reference import tree_path_moves_reference

from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import Sequence
from specengine.sampling import SamplingParams


def _arena(rng: np.random.Generator, capacity: int, width: int) -> tuple[SeqArena, list[int]]:
    arena = SeqArena(capacity, max_model_len=64, width=width)
    slots = []
    for _ in range(capacity - 1):  # one slot stays free
        n_prompt = int(rng.integers(1, 12))
        stops = frozenset(rng.choice(20, size=int(rng.integers(0, 3)), replace=False).tolist())
        slots.append(arena.take(rng.integers(0, 20, n_prompt).tolist(), n_prompt,
                                int(rng.integers(1, 30)), stops))
    return arena, slots


def _same(a: SeqArena, b: SeqArena) -> None:
    for name in ("tokens", "logprobs", "versions", "lens", "done", "counters"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@pytest.mark.parametrize("seed", range(6))
def test_append_packed_equals_reference(seed: int) -> None:
    """Random steps (stop tokens among the emitted ones, max_tokens and context cuts, an arena
    that must widen): the C++ pass leaves exactly the reference's arena, counts and stats."""
    rng = np.random.default_rng(seed)
    fast, slots = _arena(rng, capacity=9, width=8)
    ref = copy.deepcopy(fast)
    stats_fast = np.zeros((2, 5), dtype=np.int64)
    stats_ref = stats_fast.copy()
    for step in range(12):
        live = [s for s in slots if not fast.done[s] and fast.lens[s] < fast.limit[s]]
        if not live:
            break
        rows = np.array(rng.permutation(live), dtype=np.int64)
        n = int(rng.integers(1, 6))
        b = len(rows)
        depths = rng.integers(0, n, b)
        num_accepted = np.minimum(rng.integers(0, n, b), depths)
        ids = rng.integers(0, 20, (b + 2, n))  # two padded rows past num_rows
        packed = pack(ids, rng.standard_normal((b + 2, n)), np.concatenate(
            [num_accepted, [0, 0]]))
        num_drafts = depths.copy()
        got = fast.append_packed(packed, b, rows, num_drafts, depths, stats_fast, step)
        want = append_reference(ref, packed, b, rows, num_drafts, depths, stats_ref, step)
        assert got == want
        _same(fast, ref)
        np.testing.assert_array_equal(stats_fast, stats_ref)
    assert fast.width > 8  # some step had to widen the arena


def test_append_packed_refuses_bad_input_and_changes_nothing() -> None:
    rng = np.random.default_rng(0)
    arena, slots = _arena(rng, capacity=4, width=16)
    before = copy.deepcopy(arena)
    stats = np.zeros((2, 2), dtype=np.int64)
    rows = np.array(slots, dtype=np.int64)
    ok = pack(np.ones((3, 3), np.int64), np.zeros((3, 3)), np.array([1, 0, 2]))
    zeros = np.zeros(3, dtype=np.int64)
    with pytest.raises(ValueError, match="slot 7 outside"):
        arena.append_packed(ok, 3, np.array([slots[0], 7, slots[1]]), zeros, zeros, stats, 1)
    with pytest.raises(ValueError, match="num_accepted 3 outside"):
        arena.append_packed(pack(np.ones((3, 3), np.int64), np.zeros((3, 3)),
                                 np.array([0, 0, 3])), 3, rows, zeros, zeros, stats, 1)
    with pytest.raises(ValueError, match="draft depth 3 outside"):
        arena.append_packed(ok, 3, rows, zeros, np.array([0, 3, 0]), stats, 1)
    with pytest.raises(TypeError, match="int64"):
        arena.append_packed(ok, 3, rows.astype(np.int32), zeros, zeros, stats, 1)
    with pytest.raises(ValueError, match="3N"):
        arena.append_packed(np.ascontiguousarray(ok[:, :5]), 3, rows, zeros, zeros, stats, 1)
    _same(arena, before)
    assert not stats.any()


def test_stage_rows_refuses_bad_rows_and_writes_nothing() -> None:
    """The staging pass checks every row before writing any (``BatchState.stage_step``),
    copies the block-table rows that grew or changed owner, and zeroes rows that left."""
    from specengine import _C

    arena = SeqArena(4, max_model_len=64, width=16, block_width=4)
    slot = arena.take([5, 6, 7], 3, 10, frozenset())
    arena.set_blocks(slot, [9, 4])
    ints = np.zeros((8, 4), dtype=np.int64)
    limits = np.array([[10] * 4, [3] * 4], dtype=np.int64)
    table = np.full((4, 3), 77, dtype=np.int32)  # stale rows: 1 and 2 left the batch
    sent = np.zeros(4, dtype=np.int64)
    none = np.zeros(0, dtype=np.int64)

    def stage(slots: list[int], changed: np.ndarray = none, ints: np.ndarray = ints,
              used: int = 3) -> tuple[int, int]:
        return _C.stage_rows(ints, limits, np.array(slots), len(slots), arena.lens,
                             arena.tokens, arena.num_blocks, None, 3, -1, 64, arena.block_ids,
                             table, sent, changed, used)

    assert stage([slot]) == (3, 3)  # 3 drafts; rows 0 (grew) .. 2 (left) to send
    assert ints[:4, 0].tolist() == [2, 7, 3, 3]  # CTX, LAST, OFFSET, NUM_DRAFT
    assert table[:3].tolist() == [[9, 4, 0], [0, 0, 0], [0, 0, 0]]
    assert table[3].tolist() == [77] * 3 and sent.tolist() == [2, 0, 0, 0]
    assert stage([slot], used=1) == (3, 0)  # nothing changed: nothing to send
    table[0] = 55
    assert stage([slot], np.array([0]), used=1) == (3, 1)  # a new owner: the row whole
    assert table[0].tolist() == [9, 4, 0]
    before = (ints.copy(), table.copy(), sent.copy())
    with pytest.raises(ValueError, match="row 1 has slot 9 outside the arena's 4"):
        stage([slot, 9])
    with pytest.raises(ValueError, match="row 1 has length 0"):  # a free slot
        stage([slot, (slot + 1) % 4])
    with pytest.raises(ValueError, match="changed row 1 is outside the batch of 1"):
        stage([slot], np.array([1]))
    arena.set_blocks(slot, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="holds 4 KV blocks, more than the 3"):
        stage([slot])
    with pytest.raises(TypeError, match="int64"):
        stage([slot], ints=ints.astype(np.int32))
    for got, want in zip((ints, table, sent), before):
        np.testing.assert_array_equal(got, want)


def test_block_tables_in_the_arena_equal_lists() -> None:
    """``add_blocks`` (one scatter for many slots) and ``set_blocks`` keep every slot's row
    equal to a list kept the slow way, past a widening; attach / detach carry the table."""
    rng = np.random.default_rng(0)
    arena = SeqArena(6, 1000, width=4, block_width=2)
    lists: dict[int, list[int]] = {}
    seqs = []
    for i in range(6):
        seq = Sequence(i, [1, 2, 3], SamplingParams(max_tokens=8), i, ())
        seq.block_table = rng.integers(0, 99, size=rng.integers(0, 3)).tolist()
        lists[i] = list(seq.block_table)
        seq.attach(arena)
        seqs.append(seq)
    for _ in range(30):
        chosen = rng.choice(6, size=rng.integers(1, 5), replace=False)
        counts = rng.integers(0, 3, size=len(chosen))
        ids = rng.integers(0, 99, size=int(counts.sum())).astype(np.int32)
        arena.add_blocks(np.array([seqs[i].slot for i in chosen]), counts, ids)
        flat = iter(ids.tolist())
        for i, c in zip(chosen, counts):
            lists[int(i)] += [next(flat) for _ in range(c)]
        if rng.random() < 0.2:  # a whole new table (as after a preemption)
            i = int(rng.integers(6))
            lists[i] = rng.integers(0, 99, size=2).tolist()
            seqs[i].block_table = lists[i]
        for i, seq in enumerate(seqs):
            assert seq.block_table == lists[i] and seq.num_blocks == len(lists[i])
            assert not arena.block_ids[seq.slot, len(lists[i]):].any()  # zeros after
    assert arena.block_ids.shape[1] > 2  # it widened
    seqs[0].add_blocks([5, 6])  # one sequence, through the arena
    seqs[0].detach()
    assert seqs[0].block_table == lists[0] + [5, 6]
    with pytest.raises(ValueError, match="block ids"):
        arena.add_blocks(np.array([seqs[1].slot]), np.array([2]), np.zeros(3, np.int32))
    assert seqs[1].block_table == lists[1]  # refused: nothing written


@pytest.mark.parametrize("seed", range(3))
def test_tree_path_moves_equal_reference(seed: int) -> None:
    """``_C.tree_path_moves`` (the accepted tree paths' KV moves, one C++ pass) equals its
    numpy reference on random trees, acceptances and block tables; bad rows are refused."""
    from specengine import _C

    rng = np.random.default_rng(seed)
    n, block_size, rows = 6, 4, 7
    arena = SeqArena(8, 1000, width=8, block_width=2)
    slots = []
    for _ in range(rows):
        length = int(rng.integers(1, 30))
        s = arena.take(rng.integers(0, 50, size=length).tolist(), 1, 100, frozenset())
        need = -(-(length + n) // block_size)
        arena.set_blocks(s, rng.permutation(500)[:need].astype(np.int32))
        slots.append(s)
    slots_a = np.array(slots + [0], dtype=np.int64)  # one padded row past the batch
    packed = np.zeros((rows + 1, 3 * n + 1))
    for r in range(rows):  # a random accepted path: node ids increasing from the root
        accepted = int(rng.integers(0, n))
        path = np.sort(rng.choice(np.arange(1, n), size=accepted, replace=False))
        packed[r, 2 * n: 2 * n + accepted + 1] = [0, *path]
        packed[r, 3 * n] = accepted
    got = _C.tree_path_moves(packed, rows, slots_a, arena.lens, arena.num_blocks,
                             arena.block_ids, block_size)
    want = tree_path_moves_reference(packed, rows, slots_a, arena, block_size)
    np.testing.assert_array_equal(got, want)
    assert got.shape[1] > 0
    in_place = packed.copy()  # every accepted node already at its depth: nothing moves
    in_place[:, 2 * n: 3 * n] = np.arange(n)
    assert _C.tree_path_moves(in_place, rows, slots_a, arena.lens, arena.num_blocks,
                              arena.block_ids, block_size).shape == (2, 0)
    bad = packed.copy()
    bad[0, 3 * n] = n  # more accepted drafts than the tree has
    with pytest.raises(ValueError, match="row 0 accepted 6 drafts of a 6-node tree"):
        _C.tree_path_moves(bad, rows, slots_a, arena.lens, arena.num_blocks, arena.block_ids,
                           block_size)
    arena.num_blocks[slots[1]] = 0  # a table too short for its path
    if packed[1, 3 * n] > 0 and (packed[1, 2 * n + 1: 2 * n + 1 + int(packed[1, 3 * n])]
                                 != np.arange(1, int(packed[1, 3 * n]) + 1)).any():
        with pytest.raises(ValueError, match="row 1 position"):
            _C.tree_path_moves(packed, rows, slots_a, arena.lens, arena.num_blocks,
                               arena.block_ids, block_size)
