"""Plain-numpy reference of ``_C.tree_path_moves`` (``speculate._compact_tree_path``): the KV
moves of accepted tree paths, the specification its randomized test holds the C++ pass to."""

from __future__ import annotations

import numpy as np

from specengine.core.seq_arena import SeqArena


def tree_path_moves_reference(packed: np.ndarray, num_rows: int, slots: np.ndarray,
                              arena: SeqArena, block_size: int) -> np.ndarray:
    """``[2, M]`` source / destination cache slots, rows in order, depths increasing."""
    n = (packed.shape[1] - 1) // 3
    row_ids = packed[:num_rows, 2 * n:3 * n].astype(np.int64)
    num_accepted = packed[:num_rows, 3 * n].astype(np.int64)
    deepest = int(num_accepted.max(initial=0))
    depth = np.arange(1, deepest + 1)  # [D]
    node = row_ids[:, 1: deepest + 1]  # [B, D]: the accepted node at each depth
    moves = (depth[None, :] <= num_accepted[:, None]) & (node != depth[None, :])
    b, j = np.nonzero(moves)  # row-major: rows in order, depths increasing
    ctx = arena.lens[slots[:num_rows]][b] - 1
    tables = arena.block_ids[slots[:num_rows][b]]  # [M, width]

    def slot_of(pos: np.ndarray) -> np.ndarray:
        return tables[np.arange(len(pos)), pos // block_size].astype(np.int64) * block_size \
            + pos % block_size

    return np.stack([slot_of(ctx + node[b, j]), slot_of(ctx + depth[j])]).astype(np.int64)
