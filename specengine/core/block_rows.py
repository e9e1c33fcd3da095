"""Device block tables with one row per batch row, sent incrementally.

The target's batch state and each drafter's own paged cache keep one of these, row-aligned
with the batch: row ``r`` holds the block table of the sequence in batch row ``r``. A row whose
owner changed (another sequence moved in, or the same one got a new table after preemption) is
sent whole; a row whose table grew sends its new ids; rows past the batch are zeroed (a padded
row then reads block 0 and owns nothing). All changed rows go in one non-blocking copy.

Two ways in: :meth:`BlockRows.sync_from` takes whole rows from arrays (the running sequences'
tables in ``SeqArena.block_ids``: no Python per row), :meth:`BlockRows.sync` /
:meth:`BlockRows.sync_some` take Python lists keyed by owner (sequences not in an arena, and
drafters' own caches).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class BlockRows:
    """``table [capacity, max_blocks]`` int32 on the device and its host mirror."""

    def __init__(self, capacity: int, max_blocks: int, device: torch.device) -> None:
        if capacity < 1 or max_blocks < 1:
            raise ValueError(f"BlockRows needs capacity and max_blocks >= 1, got {capacity}, "
                             f"{max_blocks}")
        self.capacity, self.max_blocks, self.device = capacity, max_blocks, device
        # The host mirror is page-locked on CUDA, so :meth:`_send` never blocks the host.
        self._host_t = torch.zeros(capacity, max_blocks, dtype=torch.int32,
                                   pin_memory=device.type == "cuda")
        self.host = self._host_t.numpy()
        self.table = torch.zeros(capacity, max_blocks, dtype=torch.int32, device=device)
        # Owner of each row and the table list it mirrors (keyed syncs); None after a sync
        # from arrays, so the next keyed sync sends the row whole.
        self._keys = np.full(capacity, None, dtype=object)
        self._tables = np.full(capacity, None, dtype=object)
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
        self._send(max(dirty) + 1 if dirty else 0)
        self._used = num_rows


    def sync_from(self, num_rows: int, rows: np.ndarray, ids: np.ndarray,
                  counts: np.ndarray) -> None:
        """Make rows ``rows`` hold ``ids[i, :counts[i]]`` (``ids [len(rows), w]``, zeros past
        each count, as ``SeqArena.block_ids`` rows are) for a batch of ``num_rows`` rows whose
        other rows are unchanged; rows past ``num_rows`` become empty. Array ops only."""
        if num_rows > self.capacity:
            raise ValueError(f"{num_rows} rows exceed the capacity {self.capacity}")
        if len(counts) and int(counts.max()) > self.max_blocks:
            r = int(rows[int(np.argmax(counts))])
            raise ValueError(f"row {r} holds {int(counts.max())} KV blocks, more than the "
                             f"{self.max_blocks} of a block-table row")
        stale = np.arange(num_rows, self._used, dtype=np.int64)
        w = min(ids.shape[1], self.max_blocks)
        self.host[rows, :w] = ids[:, :w]
        self.host[rows, w:] = 0
        self.host[stale] = 0
        self.sent[rows], self.sent[stale] = counts, 0
        self._keys[rows] = self._tables[rows] = None
        self._keys[stale] = self._tables[stale] = None
        self._send(max(num_rows, self._used) if len(rows) or len(stale) else 0)
        self._used = num_rows

    def _send(self, num_rows: int) -> None:
        """Copy the first ``num_rows`` rows of the mirror to the device, non-blocking: one
        contiguous copy (as vLLM commits its block table) is cheaper to issue than an
        indexed scatter of the changed rows, and a few KB more of H2D traffic is free next to
        the step. The host writes the mirror again only after the step's blocking read-back,
        so the copy has run by then."""
        if num_rows:
            self.table[:num_rows].copy_(self._host_t[:num_rows],
                                        non_blocking=self.device.type == "cuda")


def slots_of(table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
             block_size: int) -> torch.Tensor:
    """Cache slot of each row's token at ``positions [rows, n]`` through ``table [rows,
    max_blocks]`` (int64), ``-1`` where ``valid`` is False (no KV write). Device ops only."""
    block_idx = (positions // block_size).clamp(0, table.shape[1] - 1)
    blocks = table.gather(1, block_idx).long()
    return torch.where(valid, blocks * block_size + positions % block_size, -1)
