"""Device block tables with one row per batch row, sent incrementally.

The target's batch state and each drafter's own paged cache keep one of these, row-aligned
with the batch: row ``r`` holds the block table of the sequence in batch row ``r``. A row whose
owner changed (another sequence moved in, or the same one got a new table after preemption) is
sent whole; a row whose table grew sends its new ids; rows past the batch are zeroed (a padded
row then reads block 0 and owns nothing). All changed rows go in one non-blocking copy.

Two ways in: the batch state's C++ staging pass writes whole mirror rows from the running
sequences' tables in ``SeqArena.block_ids`` (no Python per row) and sends them with its step
fields (:meth:`BlockRows.written`); :meth:`BlockRows.sync` / :meth:`BlockRows.sync_some` take
Python lists keyed by owner (sequences not in an arena, and drafters' own caches).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class BlockRows:
    """``table [capacity, max_blocks]`` int32 on the device and its host mirror ``host``
    (given as views when an owner sends them with its own data, as ``core.batch`` does)."""

    def __init__(self, capacity: int, max_blocks: int, device: torch.device,
                 host: torch.Tensor | None = None, table: torch.Tensor | None = None) -> None:
        if capacity < 1 or max_blocks < 1:
            raise ValueError(f"BlockRows needs capacity and max_blocks >= 1, got {capacity}, "
                             f"{max_blocks}")
        self.capacity, self.max_blocks, self.device = capacity, max_blocks, device
        # The host mirror is page-locked on CUDA, so :meth:`_send` never blocks the host.
        self._host_t = host if host is not None else torch.zeros(
            capacity, max_blocks, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host = self._host_t.numpy()
        self.table = table if table is not None else torch.zeros(
            capacity, max_blocks, dtype=torch.int32, device=device)
        for name, t in (("host", self._host_t), ("table", self.table)):
            if tuple(t.shape) != (capacity, max_blocks) or t.dtype != torch.int32:
                raise ValueError(f"BlockRows {name} must be [{capacity}, {max_blocks}] int32, "
                                 f"got {tuple(t.shape)} {t.dtype}")
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

    def sync(self, rows: Sequence[tuple[int, list[int]]], send: bool = True) -> int:
        """Make row ``r`` hold ``rows[r] = (owner key, block table)``; rows past
        ``len(rows)`` become empty."""
        return self.sync_some(len(rows), [(r, key, table) for r, (key, table) in enumerate(rows)],
                              send)

    def sync_some(self, num_rows: int, changed: Sequence[tuple[int, int, list[int]]],
                  send: bool = True) -> int:
        """Like :meth:`sync` for ``num_rows`` rows of which only ``changed = [(row, owner
        key, block table)]`` may differ from what the device has (the others are unchanged
        owners whose tables did not grow). Checks every row before writing any. Sends the
        mirror's rows up to the last one written (``send=False``: the owner sends them) and
        returns their number."""
        if num_rows > self.capacity:
            raise ValueError(f"{num_rows} rows exceed the capacity {self.capacity}")
        for r, _, table in changed:
            if len(table) > self.max_blocks:
                raise ValueError(f"row {r} holds {len(table)} KV blocks, more than the "
                                 f"{self.max_blocks} of a block-table row")
        last = -1
        keys, tables, sent_ = self._keys, self._tables, self.sent
        for r, key, table in changed:
            if tables[r] is table and keys[r] == key and len(table) == sent_[r]:
                continue  # the common case: nothing changed
            if tables[r] is not table or keys[r] != key:
                keys[r], tables[r], sent_[r] = key, table, 0
                self.host[r] = 0
            sent = int(sent_[r])
            self.host[r, sent:len(table)] = table[sent:]
            sent_[r] = len(table)
            last = max(last, r)
        for r in range(num_rows, self._used):
            keys[r], tables[r], sent_[r] = None, None, 0
            self.host[r] = 0
            last = max(last, r)
        self._used = num_rows
        if send:
            self._send(last + 1)
        return last + 1

    def _send(self, num_rows: int) -> None:
        """Copy the first ``num_rows`` rows of the mirror to the device, non-blocking: one
        contiguous copy (as vLLM commits its block table) is cheaper to issue than an
        indexed scatter of the changed rows, and a few KB more of H2D traffic is free next to
        the step. The host writes the mirror again only after the step's blocking read-back,
        so the copy has run by then."""
        if num_rows:
            self.table[:num_rows].copy_(self._host_t[:num_rows],
                                        non_blocking=self.device.type == "cuda")


_VOID = object()  # a key no owner has: the row is written whole at the next keyed sync


def slots_of(table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
             block_size: int) -> torch.Tensor:
    """Cache slot of each row's token at ``positions [rows, n]`` through ``table [rows,
    max_blocks]`` (int64), ``-1`` where ``valid`` is False (no KV write). Device ops only."""
    block_idx = (positions // block_size).clamp(0, table.shape[1] - 1)
    blocks = table.gather(1, block_idx).long()
    return torch.where(valid, blocks * block_size + positions % block_size, -1)
