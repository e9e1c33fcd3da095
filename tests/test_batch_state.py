"""The persistent batch state, updated incrementally, always equals a rebuild from scratch:
random joins, growth, preemption (a new block table), finishes and bucket padding."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from arena_reference import pack

from specengine.core.batch import (
    ACTIVE,
    CTX,
    LAST,
    LOG_MIN_P,
    NUM_DRAFT,
    NUM_FLOAT_FIELDS,
    OFFSET,
    SEED,
    SLOT,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    BatchState,
)
from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import Sequence
from specengine.core.step import num_drafts_for
from specengine.sampling import SamplingParams

CAPACITY, MAX_BLOCKS = 8, 6


def expected_rows(seqs: tuple[Sequence, ...], num_drafts: np.ndarray, padded: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ints = np.zeros((8, padded), np.int64)
    ints[TOP_K] = ints[SLOT] = -1
    floats = np.zeros((NUM_FLOAT_FIELDS, padded), np.float32)
    floats[TOP_P] = 1.0
    floats[LOG_MIN_P] = -np.inf  # min-p off
    blocks = np.zeros((padded, MAX_BLOCKS), np.int32)
    for r, s in enumerate(seqs):
        ints[[CTX, LAST, OFFSET, NUM_DRAFT, ACTIVE, TOP_K, SEED, SLOT], r] = (
            len(s) - 1, s.token_ids[-1], len(s), num_drafts[r], 1, s.params.top_k, s.seed,
            s.slot)
        floats[[TEMPERATURE, TOP_P], r] = (s.params.temperature, s.params.top_p)
        blocks[r, : len(s.block_table)] = s.block_table
    return ints, floats, blocks


def _grow(seq: Sequence, tokens: list[int]) -> None:
    """Append tokens as a step would (through the arena when attached; its cuts apply)."""
    if seq.arena is None:
        seq.token_ids.extend(tokens)
    else:
        none = np.zeros(1, dtype=np.int64)
        seq.arena.append_packed(pack(np.array([tokens]), np.zeros((1, len(tokens))),
                                     np.array([len(tokens) - 1])), 1, np.array([seq.slot]),
                                none, none, np.zeros((2, 0), dtype=np.int64), 0)


def _new_table(seq: Sequence, table: list[int]) -> None:
    """A new block table (preempted and prefilled again: an attached sequence also gets a new
    slot, as the scheduler does)."""
    if seq.arena is not None:
        arena = seq.arena
        seq.detach()
        seq.attach(arena)
    seq.block_table = table


@pytest.mark.parametrize("attached", [False, True], ids=["lists", "arena"])
@pytest.mark.parametrize("seed", range(3))
def test_incremental_updates_equal_a_rebuild(seed: int, attached: bool) -> None:
    """Detached sequences (lists) and sequences in an arena (the engine's case: lengths,
    newest tokens and grown tables come from the arena) give the same rows as a rebuild."""
    rng = random.Random(seed)
    state = BatchState(CAPACITY, MAX_BLOCKS, torch.device("cpu"))
    arena = SeqArena(CAPACITY, 1000, width=4) if attached else None
    live: list[Sequence] = []
    next_id = 0
    rows_before: dict[int, int] = {}
    for _ in range(400):
        event = rng.random()
        if event < 0.25 and len(live) < CAPACITY:  # a sequence joins
            params = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]),
                                    top_k=rng.choice([-1, 5]), top_p=rng.choice([1.0, 0.9]),
                                    max_tokens=rng.randint(1, 40))
            seq = Sequence(next_id, [rng.randrange(100) for _ in range(rng.randint(1, 9))],
                           params, rng.randrange(1 << 62), ())
            seq.block_table = [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
            if arena is not None:
                seq.attach(arena)  # the table moves into the arena's row
            live.append(seq)
            next_id += 1
        elif event < 0.4 and live:  # one finishes or is preempted out of the batch
            live.pop(rng.randrange(len(live))).detach()
        elif event < 0.5 and live:  # preempted and re-prefilled: a new table object
            _new_table(rng.choice(live), [rng.randrange(1000) for _ in range(2)])
        for seq in live:  # every running sequence grows
            _grow(seq, [rng.randrange(100) for _ in range(rng.randint(1, 3))])
            if rng.random() < 0.3 and len(seq.block_table) < MAX_BLOCKS:
                seq.add_blocks([rng.randrange(1000)])  # into the arena's row when attached
        if not live:
            continue
        batch = tuple(rng.sample(live, len(live)))  # the scheduler's order does not matter
        ordered = state.arrange(batch)
        assert sorted(s.seq_id for s in ordered) == sorted(s.seq_id for s in batch)
        # Rows are stable: a sequence keeps its row unless it moved into a hole below it.
        for r, s in enumerate(ordered):
            if s.seq_id in rows_before:
                assert r <= rows_before[s.seq_id]
        rows_before = {s.seq_id: r for r, s in enumerate(ordered)}
        lens = state.lengths()
        for k in (0, 3, 16):  # the vectorised draft plan equals num_drafts_for, row by row
            np.testing.assert_array_equal(state.chain_drafts(k, lens, 30),
                                          [num_drafts_for(s, k, 30) for s in ordered])
        padded = min(CAPACITY, 1 << (len(ordered) - 1).bit_length())
        for k in (0, 3, 16):  # the plan staged in one pass (C++ when attached) is the same
            np.testing.assert_array_equal(state.stage_step(k, -1, 30)[0],
                                          [num_drafts_for(s, k, 30) for s in ordered])
        fits = all(len(s) + 4 <= 30 for s in ordered)  # a 5-node tree: all rows or none
        np.testing.assert_array_equal(state.stage_step(3, 4, 30)[0],
                                      np.full(len(ordered), 4 if fits else 0))
        num_drafts = np.array([rng.randint(0, 4) for _ in ordered], np.int64)
        state.stage(num_drafts)
        ints, floats, blocks = expected_rows(ordered, num_drafts, padded)
        np.testing.assert_array_equal(state.ints[:, :padded].numpy(), ints)
        np.testing.assert_array_equal(state.floats[:, :padded].numpy(), floats)
        np.testing.assert_array_equal(state.block_tables[:padded].numpy(), blocks)
    assert next_id > 20  # the walk did join, leave and grow many times


def test_bad_use_is_refused() -> None:
    state = BatchState(2, 2, torch.device("cpu"))
    seqs = tuple(Sequence(i, [1, 2], SamplingParams(), 0, ()) for i in range(3))
    with pytest.raises(ValueError, match="exceed the batch capacity 2"):
        state.arrange(seqs)
    ordered = state.arrange(seqs[:1])
    ordered[0].block_table = [1, 2, 3]
    with pytest.raises(ValueError, match="more than the 2 of a block-table row"):
        state.stage(np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="num_drafts has shape"):
        state.stage(np.zeros(2, np.int64))
