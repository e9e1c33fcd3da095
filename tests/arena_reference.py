"""Plain-numpy reference of ``SeqArena.append_packed`` (its C++ pass, ``_C.append_step``):
the specification the randomized test in ``test_seq_arena.py`` holds the fast path to."""

from __future__ import annotations

import numpy as np

from specengine.core.seq_arena import NUM_ACCEPTED, NUM_DRAFT, NUM_STEPS, SeqArena


def pack(ids: np.ndarray, logprobs: np.ndarray, num_accepted: np.ndarray) -> np.ndarray:
    """``[B, 3N + 1]`` float64 as ``SamplerOutput.pack`` lays it out (row ids are zeros)."""
    b, n = ids.shape
    return np.concatenate([ids.astype(np.float64), logprobs.astype(np.float64),
                           np.zeros((b, n)), num_accepted.astype(np.float64)[:, None]], axis=1)


def append_reference(arena: SeqArena, packed: np.ndarray, num_rows: int, slots: np.ndarray,
                     num_drafts: np.ndarray, depths: np.ndarray, stats: np.ndarray,
                     version: int) -> tuple[int, list[tuple[int, int]]]:
    """What ``append_packed`` must do, with numpy operations over whole rows."""
    n = (packed.shape[1] - 1) // 3
    h = packed[:num_rows]
    ids, logprobs = h[:, :n].astype(np.int64), h[:, n:2 * n]
    num_accepted = h[:, 3 * n].astype(np.int64)
    slots = slots[:num_rows]
    b, m = ids.shape
    lens = arena.lens[slots]
    j = np.arange(m)
    emitted = j[None, :] < (num_accepted + 1)[:, None]
    stops = arena.stop_ids[slots]
    is_stop = (ids[:, :, None] == stops[:, None, :]).any(-1) & emitted
    # Tokens up to and including the first stop; then at most the room left.
    first_stop = np.where(is_stop.any(1), is_stop.argmax(1) + 1, m + 1)
    room = np.maximum(arena.limit[slots] - lens, 0)
    kept = np.minimum(np.minimum(num_accepted + 1, first_stop), room)
    arena._grow(int((lens + kept).max(initial=0)))
    keep = j[None, :] < kept[:, None]
    rows = np.broadcast_to(slots[:, None], (b, m))[keep]
    cols = (lens[:, None] + j[None, :])[keep]
    arena.tokens[rows, cols] = ids[keep]
    arena.logprobs[rows, cols] = logprobs[keep]
    arena.versions[rows, cols] = version
    arena.lens[slots] = lens + kept
    ended = np.where(first_stop == kept, 1, np.where(lens + kept >= arena.limit[slots], 2, 0))
    arena.done[slots] = ended > 0
    c = arena.counters
    c[NUM_STEPS, slots] += 1
    c[NUM_DRAFT, slots] += num_drafts[:num_rows]
    c[NUM_ACCEPTED, slots] += num_accepted
    for p in range(stats.shape[1]):
        stats[0, p] += int((depths[:num_rows] > p).sum())
        stats[1, p] += int(((num_accepted > p) & (depths[:num_rows] > p)).sum())
    return int(kept.sum()), [(int(r), int(ended[r])) for r in np.flatnonzero(ended)]
