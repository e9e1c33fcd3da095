"""Device block tables with one row per batch row, sent incrementally.

The target's batch state and each drafter's own paged cache keep one of these, row-aligned
with the batch: row ``r`` holds the block table of the sequence in batch row ``r``. A row whose
owner changed (another sequence moved in, or the same one got a new table after preemption) is
sent whole; a row whose table grew sends its new ids; rows past the batch are zeroed (a padded
row then reads block 0 and owns nothing). All changed rows go in one non-blocking copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specengine.core.transfer import to_device


class BlockRows:
    """``table [capacity, max_blocks]`` int32 on the device and its host mirror."""

    def __init__(self, capacity: int, max_blocks: int, device: torch.device) -> None:
        if capacity < 1 or max_blocks < 1:
            raise ValueError(f"BlockRows needs capacity and max_blocks >= 1, got {capacity}, "
                             f"{max_blocks}")
        self.capacity, self.max_blocks, self.device = capacity, max_blocks, device
        self.host = np.zeros((capacity, max_blocks), dtype=np.int32)
        self.table = torch.zeros(capacity, max_blocks, dtype=torch.int32, device=device)
        self._keys: list[int | None] = [None] * capacity  # owner of each row
        self._tables: list[list[int] | None] = [None] * capacity  # the table list it mirrors
        self.sent = np.zeros(capacity, dtype=np.int64)  # ids of that table the device has
        self._used = 0

    @property
    def num_used(self) -> int:
        """Rows the last sync made current (the rest are empty)."""
        return self._used

    def sync(self, rows: Sequence[tuple[int, list[int]]]) -> None:
        """Make row ``r`` hold ``rows[r] = (owner key, block table)``; rows past
        ``len(rows)`` become empty."""
        self.sync_some(len(rows), [(r, key, table) for r, (key, table) in enumerate(rows)])

    def sync_some(self, num_rows: int, changed: Sequence[tuple[int, int, list[int]]]) -> None:
        """Like :meth:`sync` for ``num_rows`` rows of which only ``changed = [(row, owner
        key, block table)]`` may differ from what the device has (the others are unchanged
        owners whose tables did not grow)."""
        if num_rows > self.capacity:
            raise ValueError(f"{num_rows} rows exceed the capacity {self.capacity}")
        dirty: list[int] = []
        keys, tables, sent_ = self._keys, self._tables, self.sent
        for r, key, table in changed:
            if tables[r] is table and keys[r] == key and len(table) == sent_[r]:
                continue  # the common case: nothing changed
            if tables[r] is not table or keys[r] != key:
                keys[r], tables[r], sent_[r] = key, table, 0
                self.host[r] = 0
                dirty.append(r)
            sent = int(sent_[r])
            if len(table) > sent:
                if len(table) > self.max_blocks:
                    raise ValueError(f"row {r} holds {len(table)} KV blocks, more than the "
                                     f"{self.max_blocks} of a block-table row")
                self.host[r, sent:len(table)] = table[sent:]
                sent_[r] = len(table)
                if not dirty or dirty[-1] != r:
                    dirty.append(r)
        for r in range(num_rows, self._used):
            keys[r], tables[r], sent_[r] = None, None, 0
            self.host[r] = 0
            dirty.append(r)
        self._used = num_rows
        if dirty:
            idx = np.asarray(dirty, dtype=np.int64)
            self.table[to_device(idx, self.device)] = to_device(self.host[idx], self.device)


def slots_of(table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
             block_size: int) -> torch.Tensor:
    """Cache slot of each row's token at ``positions [rows, n]`` through ``table [rows,
    max_blocks]`` (int64), ``-1`` where ``valid`` is False (no KV write). Device ops only."""
    block_idx = (positions // block_size).clamp(0, table.shape[1] - 1)
    blocks = table.gather(1, block_idx).long()
    return torch.where(valid, blocks * block_size + positions % block_size, -1)
