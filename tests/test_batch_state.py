"""The persistent batch state, updated incrementally, always equals a rebuild from scratch:
random joins, growth, preemption (a new block table), finishes and bucket padding."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specengine.core.batch import (
    ACTIVE,
    CTX,
    LAST,
    NUM_DRAFT,
    OFFSET,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    BatchState,
)
from specengine.sampling import SamplingParams
from specengine.sequence import Sequence
from specengine.speculate import num_drafts_for

CAPACITY, MAX_BLOCKS = 8, 6


def expected_rows(seqs: tuple[Sequence, ...], num_drafts: np.ndarray, padded: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ints = np.zeros((7, padded), np.int64)
    ints[TOP_K] = -1
    floats = np.zeros((2, padded), np.float32)
    floats[TOP_P] = 1.0
    blocks = np.zeros((padded, MAX_BLOCKS), np.int32)
    for r, s in enumerate(seqs):
        ints[[CTX, LAST, OFFSET, NUM_DRAFT, ACTIVE, TOP_K, SEED], r] = (
            len(s) - 1, s.token_ids[-1], len(s), num_drafts[r], 1, s.params.top_k, s.seed)
        floats[[TEMPERATURE, TOP_P], r] = (s.params.temperature, s.params.top_p)
        blocks[r, : len(s.block_table)] = s.block_table
    return ints, floats, blocks


@pytest.mark.parametrize("seed", range(3))
def test_incremental_updates_equal_a_rebuild(seed: int) -> None:
    rng = random.Random(seed)
    state = BatchState(CAPACITY, MAX_BLOCKS, torch.device("cpu"))
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
            live.append(seq)
            next_id += 1
        elif event < 0.4 and live:  # one finishes or is preempted out of the batch
            live.pop(rng.randrange(len(live)))
        elif event < 0.5 and live:  # preempted and re-prefilled: a new table object
            rng.choice(live).block_table = [rng.randrange(1000) for _ in range(2)]
        for seq in live:  # every running sequence grows
            seq.token_ids.extend(rng.randrange(100) for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.3 and len(seq.block_table) < MAX_BLOCKS:
                seq.block_table.append(rng.randrange(1000))
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
        num_drafts = np.array([rng.randint(0, 4) for _ in ordered], np.int64)
        padded = min(CAPACITY, 1 << (len(ordered) - 1).bit_length())
        state.stage(num_drafts, padded)
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
        state.stage(np.zeros(1, np.int64), 1)
    with pytest.raises(ValueError, match="num_drafts has shape"):
        state.stage(np.zeros(2, np.int64), 1)
