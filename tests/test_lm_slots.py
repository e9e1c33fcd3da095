"""``LMSlots`` (the small-LM drafter's per-slot draft-cache state) against the per-sequence
bookkeeping it replaces: a randomized walk of joins, growth, proposals, verify steps, releases,
slot reuse and weight updates keeps the same counters, table lengths and free blocks as
``_State`` objects grown with ``KVCache.ensure``; running out of blocks changes nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specengine.core.kv_cache import KVCache
from specengine.drafters.draft_model import _State
from specengine.drafters.lm_slots import LMSlots


def tiny_cache(num_blocks: int) -> KVCache:
    return KVCache(num_blocks, 4, 1, 1, 1, torch.float32, "cpu")


def i64(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


class Reference:
    """The old bookkeeping: a ``_State`` per sequence id, tables grown one at a time."""

    def __init__(self, cache: KVCache) -> None:
        self.cache, self.states = cache, {}

    def release(self, seq_id: int) -> None:
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.cache.free(st)

    def grow(self, seq_id: int, need: int) -> None:
        self.cache.ensure(self.states[seq_id], need)


def check(lm: LMSlots, ref: Reference, slot_of: dict[int, int]) -> None:
    assert lm.num_held == len(ref.states) == len(slot_of)
    assert lm.kv_cache.num_free_blocks == ref.cache.num_free_blocks
    held = []
    for sid, st in ref.states.items():
        s = slot_of[sid]
        assert lm.owner[s] == sid
        assert (lm.num_cached[s], lm.num_pending[s]) == (st.num_cached, st.num_pending)
        assert len(lm.blocks_of(s)) == len(st.block_table)
        held += lm.blocks_of(s)
    refs = lm.kv_cache.allocator.ref_counts()
    assert sorted(held) == sorted(np.flatnonzero(refs).tolist())  # each held once, no leak
    assert (refs <= 1).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walk_matches_per_sequence_states(seed: int) -> None:
    rng = random.Random(seed)
    capacity = 6
    lm, ref = LMSlots(capacity, tiny_cache(200), block_width=2), Reference(tiny_cache(200))
    epoch = np.zeros(capacity, dtype=np.int64)  # the arena's takes of each slot
    slot_of: dict[int, int] = {}  # running seq_id -> slot
    lens: dict[int, int] = {}
    next_id = 0
    for _ in range(400):
        op = rng.choice(["join", "step", "step", "step", "leave", "reuse", "update"])
        free = [s for s in range(capacity) if s not in slot_of.values()]
        if op == "join" and free:  # a sequence takes a slot; its first proposal claims it
            s = rng.choice(free)
            epoch[s] += 1
            sid, next_id = next_id, next_id + 1
            slot_of[sid], lens[sid] = s, rng.randint(1, 9)
            started = lm.claim(i64([s]), i64([sid]), epoch[[s]])
            assert started.tolist() == [True]
            ref.states[sid] = _State()
        elif op == "step" and slot_of:  # propose (grow, set counters) then verify
            sids = rng.sample(sorted(slot_of), rng.randint(1, len(slot_of)))
            slots = i64([slot_of[i] for i in sids])
            assert not lm.claim(slots, i64(sids), epoch[slots]).any()  # all held already
            k = rng.randint(1, 4)
            drafts = i64([rng.randint(0, k) for _ in sids])
            need = i64([lens[i] + k - 1 for i in sids])
            lm.grow(slots, need)
            for i, n in zip(sids, need.tolist()):
                ref.grow(i, n)
            lm.num_cached[slots] = [lens[i] for i in sids]
            lm.num_pending[slots] = np.maximum(drafts - 1, 0)
            for i, n in zip(sids, drafts.tolist()):
                ref.states[i].num_cached, ref.states[i].num_pending = lens[i], max(n - 1, 0)
            accepted = i64([rng.randint(0, n) for n in drafts.tolist()])
            lm.observe(slots, accepted)
            for i, a in zip(sids, accepted.tolist()):
                st = ref.states[i]
                st.num_cached += min(st.num_pending, a)
                st.num_pending = 0
                lens[i] += a + 1
        elif op == "leave" and slot_of:  # finished or preempted: it left its slot first
            sid = rng.choice(sorted(slot_of))
            del slot_of[sid]
            lm.release(sid)
            ref.release(sid)
        elif op == "reuse" and slot_of:  # the slot's next take, never released: stale state
            sid = rng.choice(sorted(slot_of))
            s = slot_of.pop(sid)
            epoch[s] += 1
            new, next_id = next_id, next_id + 1
            slot_of[new], lens[new] = s, rng.randint(1, 9)
            assert lm.claim(i64([s]), i64([new]), epoch[[s]]).tolist() == [True]
            ref.release(sid)
            ref.states[new] = _State()
        elif op == "update":  # a weight update: caches recomputed, blocks kept
            lm.drop_caches()
            for st in ref.states.values():
                st.num_cached = st.num_pending = 0
        check(lm, ref, slot_of)
    for sid in list(slot_of):
        lm.release(sid)
        ref.release(sid)
    assert lm.kv_cache.num_free_blocks == lm.kv_cache.num_blocks


def test_changed_rows_are_one_range_and_growth_is_all_or_nothing() -> None:
    lm = LMSlots(8, tiny_cache(6))
    slots = i64([2, 5])
    lm.claim(slots, i64([10, 11]), i64([1, 1]))
    lm.take_changed()
    lm.grow(slots, i64([4, 8]))  # 1 + 2 blocks
    assert lm.take_changed() == (2, 6)
    assert lm.take_changed()[0] >= lm.take_changed()[1]  # nothing changed since
    lm.grow(slots, i64([4, 8]))  # already covered: no allocation, nothing to send
    lo, hi = lm.take_changed()
    assert lo >= hi
    before = (lm.num_blocks.copy(), lm.block_ids.copy(), lm.kv_cache.num_free_blocks)
    with pytest.raises(RuntimeError, match="out of blocks: the step needs 4 more but 3"):
        lm.grow(slots, i64([12, 16]))  # 2 + 2 more, 3 free
    assert (lm.num_blocks == before[0]).all() and (lm.block_ids == before[1]).all()
    assert lm.kv_cache.num_free_blocks == before[2]
    lm.grow(slots, i64([8, 8]))  # still usable
    lm.release(10)
    lm.release(11)
    assert lm.kv_cache.num_free_blocks == 6 and lm.num_held == 0


def snapshot(lm: LMSlots) -> list:
    """What a refused step must not change (widening the table columns is no change)."""
    tables = [lm.blocks_of(s) for s in range(lm.capacity)]
    return [a.tolist() for a in (lm.owner, lm.epoch, lm.num_cached, lm.num_pending,
                                 lm.num_blocks)] + [tables, lm.kv_cache.num_free_blocks]


def same(a: list, b: list) -> bool:
    return a == b


def test_stage_and_observe_passes_match_the_array_rules() -> None:
    """``_C.lm_stage`` / ``_C.lm_observe`` (the static path's step) against numpy: fed tokens,
    starts, counts, counters and table sizes; every refusal changes nothing."""
    from specengine.core.seq_arena import SeqArena

    rng = np.random.default_rng(0)
    arena = SeqArena(8, 64)
    lm = LMSlots(8, tiny_cache(40), block_width=1)
    taken = [arena.take(rng.integers(0, 100, n).tolist(), n, 40, frozenset())
             for n in (5, 9, 2, 13)]
    slots, ids = i64(taken[::-1]), i64([7, 8, 9, 10])  # rows not in slot order
    out = np.full((8, 6), -5, dtype=np.int64)  # 4 token columns + start, count
    drafts = i64([3, 0, 2, 3])
    # first call: no row is held yet -> claimed (started empty), but 13 tokens > 4 columns
    assert lm.stage(slots, 4, ids, drafts, arena, 16, out) is None
    assert lm.num_held == 4 and (lm.num_blocks == 0).all()
    lens = arena.lens[slots]
    lm.num_cached[slots] = lens - i64([2, 1, 1, 3])  # rows then catch up 2, 1, 1, 3 tokens
    before = snapshot(lm)
    with pytest.raises(RuntimeError, match="out of blocks"):
        lm.stage(slots, 4, ids, i64([40, 0, 0, 0]), arena, 64, out)  # 50 blocks
    assert same(snapshot(lm), before)
    assert lm.stage(slots, 4, ids, drafts, arena, 3, out) is None  # 13 + 2 tokens: 4 blocks
    assert same(snapshot(lm), before)
    assert lm.stage(slots, 4, ids, drafts, arena, 16, out) == (3, 3)  # width, k
    starts = lens - i64([2, 1, 1, 3])
    for r, s in enumerate(slots.tolist()):
        count = lens[r] - starts[r]
        want = np.zeros(4, dtype=np.int64)
        want[:count] = arena.tokens[s, starts[r]:lens[r]]
        assert out[r, :4].tolist() == want.tolist()
        assert (out[r, 4], out[r, 5]) == (starts[r], count)
        assert lm.num_blocks[s] == -(-(lens[r] + 3 - 1) // 4)  # len + k - 1 tokens, k = 3
    assert (out[4:] == -5).all()
    assert (lm.num_cached[slots] == lens).all()
    assert lm.num_pending[slots].tolist() == [2, 0, 1, 2]
    assert lm.take_changed() == (int(slots.min()), int(slots.max()) + 1)
    assert lm.stage(i64([slots[0], -1]), 2, ids, drafts, arena, 16, out) is None  # no slot
    # observe: min(pending, accepted); a row held by someone else refuses the whole batch
    before = snapshot(lm)
    assert not lm.observe_rows(slots, 4, i64([7, 8, 9, 99]), i64([3, 3, 0, 1]), arena)
    assert same(snapshot(lm), before)
    assert lm.observe_rows(slots, 4, ids, i64([3, 3, 0, 1]), arena)
    assert (lm.num_cached[slots] == lens + i64([2, 0, 0, 1])).all()
    assert (lm.num_pending[slots] == 0).all()
    for sid in ids.tolist():
        lm.release(sid)
    assert lm.kv_cache.num_free_blocks == 40
