"""The host mirror of the batch state's block tables, one row per batch row, kept current
incrementally.

Row ``r`` holds the block table of the sequence in batch row ``r``. A row whose owner changed
(another sequence moved in, or the same one got a new table after preemption) is written
whole; a row whose table grew gets its new ids; rows past the batch are zeroed (a padded row
then reads block 0 and owns nothing). The owner (``core.batch.BatchState``) sends the mirror's
first rows with its step fields in one non-blocking copy.

Two ways in: the batch state's C++ staging pass writes whole rows from the running sequences'
tables in ``SeqArena.block_ids`` (no Python per row; :meth:`BlockRows.written` records it);
:meth:`BlockRows.sync` takes Python lists keyed by owner (sequences not in an arena).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class BlockRows:
    """Bookkeeping of ``host [capacity, max_blocks]`` int32, the page-locked mirror of a
    device block table (both owned by the caller, which sends the rows)."""

    def __init__(self, capacity: int, max_blocks: int, host: torch.Tensor) -> None:
        if tuple(host.shape) != (capacity, max_blocks) or host.dtype != torch.int32:
            raise ValueError(f"BlockRows host must be [{capacity}, {max_blocks}] int32, got "
                             f"{tuple(host.shape)} {host.dtype}")
        self.capacity, self.max_blocks = capacity, max_blocks
        self.host = host.numpy()
        # Owner of each row and the table list it mirrors (keyed syncs).
        self._keys: list[object] = [None] * capacity
        self._tables: list[list[int] | None] = [None] * capacity
        self.sent = np.zeros(capacity, dtype=np.int64)  # entries of each row the mirror has
        self._used = 0

    @property
    def num_used(self) -> int:
        """Rows the last sync made current (the rest are empty)."""
        return self._used

    def written(self, num_rows: int) -> None:
        """The owner wrote the mirror's rows itself (whole rows, ``sent`` kept current: the
        batch state's C++ staging pass) for a batch of ``num_rows`` rows: the keyed
        bookkeeping is void, so a later keyed sync writes every row whole."""
        self._used = num_rows
        if self._keys[0] is not _VOID:
            self._keys = [_VOID] * self.capacity

    def sync(self, rows: Sequence[tuple[int, list[int]]]) -> int:
        """Make row ``r`` hold ``rows[r] = (owner key, block table)``; rows past
        ``len(rows)`` become empty. Checks every row before writing any. Returns the number
        of leading mirror rows that hold every change (the rows to send)."""
        num_rows = len(rows)
        if num_rows > self.capacity:
            raise ValueError(f"{num_rows} rows exceed the capacity {self.capacity}")
        for r, (_, table) in enumerate(rows):
            if len(table) > self.max_blocks:
                raise ValueError(f"row {r} holds {len(table)} KV blocks, more than the "
                                 f"{self.max_blocks} of a block-table row")
        last = -1
        keys, tables, sent_ = self._keys, self._tables, self.sent
        for r, (key, table) in enumerate(rows):
            if tables[r] is table and keys[r] == key and len(table) == sent_[r]:
                continue  # the common case: nothing changed
            if tables[r] is not table or keys[r] != key:
                keys[r], tables[r], sent_[r] = key, table, 0
                self.host[r] = 0
            sent = int(sent_[r])
            self.host[r, sent:len(table)] = table[sent:]
            sent_[r] = len(table)
            last = r
        for r in range(num_rows, self._used):
            keys[r], tables[r], sent_[r] = None, None, 0
            self.host[r] = 0
            last = r
        self._used = num_rows
        return last + 1


_VOID = object()  # a key no owner has: the row is written whole at the next keyed sync


def slots_of(table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
             block_size: int) -> torch.Tensor:
    """Cache slot of each row's token at ``positions [rows, n]`` through ``table [rows,
    max_blocks]`` (int64), ``-1`` where ``valid`` is False (no KV write). Device ops only."""
    block_idx = (positions // block_size).clamp(0, table.shape[1] - 1)
    blocks = table.gather(1, block_idx).long()
    return torch.where(valid, blocks * block_size + positions % block_size, -1)
