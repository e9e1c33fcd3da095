"""The small-LM drafter's per-sequence draft-cache state, by arena slot, in arrays.

A running sequence sits in one slot of the engine's ``SeqArena`` (``seq.slot``) until it
finishes or is preempted; the small LM (``draft_model.DraftModelDrafter``) keeps what it knows
about that sequence's draft cache in the same row of a few arrays, so a decode step updates
every row with numpy / one C++ pass instead of visiting sequences in Python:

- ``num_cached[s]``: positions ``0 .. num_cached-1`` of the draft cache hold the K/V of the
  sequence's first ``num_cached`` tokens;
- ``num_pending[s]``: draft tokens fed speculatively right after them (their K/V is written);
- ``block_ids[s, :num_blocks[s]]``: the draft cache's own block table (its own allocator).

Slots are reused by other sequences, so a row's state names its holder: ``owner[s]`` (the
sequence id) and ``epoch[s]`` (``SeqArena.epoch[s]`` when it was claimed: the same sequence
preempted and admitted again into the same slot is a new take). A row whose holder does not
match is stale: :meth:`LMSlots.claim` frees its blocks and starts it empty. The drafter frees a
row on release (finished, aborted or preempted sequences), keyed by ``owner``, since the
sequence has already left its slot by then.

Rows changed since the static path last sent its device table are tracked as one range
(:meth:`LMSlots.take_changed`), so the table goes to the device in one contiguous copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

import specengine._C as _C
from specengine.core.kv_cache import KVCache

if TYPE_CHECKING:
    from specengine.core.seq_arena import SeqArena


class LMSlots:
    """Draft-cache state of up to ``capacity`` arena slots (see the module docstring)."""

    def __init__(self, capacity: int, kv_cache: KVCache, block_width: int = 16) -> None:
        if capacity < 1 or block_width < 1:
            raise ValueError(f"LMSlots needs capacity and block_width >= 1, got {capacity}, "
                             f"{block_width}")
        self.capacity, self.kv_cache = capacity, kv_cache
        self.owner = np.full(capacity, -1, dtype=np.int64)
        self.epoch = np.zeros(capacity, dtype=np.int64)
        self.num_cached = np.zeros(capacity, dtype=np.int64)
        self.num_pending = np.zeros(capacity, dtype=np.int64)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)
        self.block_ids = np.zeros((capacity, block_width), dtype=np.int32)
        self._need = np.zeros(capacity, dtype=np.int64)  # grow_tables' "lens": tokens to hold
        self._zeros = np.zeros(capacity, dtype=np.int64)  # its lookahead: none
        self._lo, self._hi = capacity, 0  # rows changed since take_changed: [lo, hi)

    # ---- holders ---------------------------------------------------------------------------
    def claim(self, slots: np.ndarray, seq_ids: np.ndarray, epochs: np.ndarray) -> np.ndarray:
        """Make row ``slots[i]`` belong to ``(seq_ids[i], epochs[i])``; a row held by anyone
        else (or nobody) is freed and starts empty. Returns which rows were (re)started."""
        stale = (self.owner[slots] != seq_ids) | (self.epoch[slots] != epochs)
        if stale.any():
            rows = slots[stale]
            self._free_rows(rows)
            self.owner[rows], self.epoch[rows] = seq_ids[stale], epochs[stale]
        return stale

    def holds(self, slots: np.ndarray, seq_ids: np.ndarray, epochs: np.ndarray) -> bool:
        """Whether every row ``slots[i]`` is held by ``(seq_ids[i], epochs[i])``."""
        return bool(((self.owner[slots] == seq_ids) & (self.epoch[slots] == epochs)).all())

    def release(self, seq_id: int) -> None:
        """Free the row held by ``seq_id`` (it may already have left its slot), if any."""
        rows = np.flatnonzero(self.owner == seq_id)
        if len(rows):
            self._free_rows(rows)

    def _free_rows(self, rows: np.ndarray) -> None:
        counts = self.num_blocks[rows]
        if counts.any():
            cols = np.arange(self.block_ids.shape[1])
            held = self.block_ids[rows][cols[None, :] < counts[:, None]]
            self.kv_cache.allocator.free(np.ascontiguousarray(held, dtype=np.int32))
            if self.kv_cache.prefix is not None:  # named blocks only the cache holds now
                self.kv_cache.prefix.released(held.tolist())
        self.block_ids[rows] = 0
        self.num_blocks[rows] = self.num_cached[rows] = self.num_pending[rows] = 0
        self.owner[rows] = -1
        self._mark(rows)

    @property
    def num_held(self) -> int:
        """Rows held by a sequence."""
        return int((self.owner >= 0).sum())

    def held_slots(self) -> np.ndarray:
        return np.flatnonzero(self.owner >= 0)

    def blocks_of(self, slot: int) -> list[int]:
        return self.block_ids[slot, : self.num_blocks[slot]].tolist()

    def adopt(self, slot: int, blocks: list[int]) -> None:
        """Start the empty row ``slot`` with ``blocks`` (cached draft KV of the sequence's
        first tokens, referenced for it: ``drafters.draft_prefix``)."""
        assert self.num_blocks[slot] == 0, "a row adopts cached blocks only when empty"
        if len(blocks) > self.block_ids.shape[1]:
            self._widen(len(blocks))
        self.block_ids[slot, : len(blocks)] = blocks
        self.num_blocks[slot] = len(blocks)
        self._mark(np.array([slot], dtype=np.int64))

    # ---- the step --------------------------------------------------------------------------
    def grow(self, slots: np.ndarray, need: np.ndarray) -> None:
        """Grow the table of each row ``slots[i]`` (distinct) to hold ``need[i]`` tokens, all
        from one allocation (one C++ pass, ``_C.grow_tables``). Raises ``RuntimeError`` with
        nothing allocated when the draft cache's free blocks do not cover them."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        self._need[slots] = need
        before = self.num_blocks[slots]
        while True:
            # lens = need and no lookahead: each row needs exactly need[i] tokens (the context
            # cap of grow_tables never applies with max_model_len 0: room 0, lookahead 0).
            status, value = _C.grow_tables(self.kv_cache.allocator, slots, len(slots),
                                           self._need, self._zeros, self.num_blocks,
                                           self.block_ids, 0, self.kv_cache.block_size)
            if status == 0:
                break
            if status == 2:  # a table outgrew the columns: widen by doubling, then grow
                self._widen(value)
                continue
            self._make_room(value)
        if value:
            self._mark(slots[self.num_blocks[slots] != before])

    def stage(self, slots: np.ndarray, num_rows: int, seq_ids: np.ndarray,
              num_drafts: np.ndarray, arena: SeqArena, max_blocks: int,
              out: np.ndarray) -> tuple[int, int] | None:
        """The static chain's step for rows ``0 .. num_rows-1`` (arena ``slots``, held by
        ``seq_ids``; new holders are claimed): every table grown to ``len + k - 1`` tokens
        (``k = max(num_drafts)``), the counters set, and row ``r`` of ``out`` holding its
        catch-up tokens, start and count (one C++ pass, ``_C.lm_stage``). Returns the
        catch-up width and ``k``, or None with nothing changed when the static pass cannot take the
        batch (a sequence outside the arena, a catch-up wider than ``out``'s token columns,
        a table wider than ``max_blocks``). Raises ``RuntimeError`` (nothing allocated) when
        the draft cache's free blocks do not cover the growth."""
        while True:
            status, value, lo, hi, k = _C.lm_stage(
                self.kv_cache.allocator, slots, num_rows, seq_ids, num_drafts, arena.epoch,
                arena.lens, arena.tokens, self.owner, self.epoch, self.num_cached,
                self.num_pending, self._need, self._zeros, self.num_blocks, self.block_ids,
                self.kv_cache.block_size, max_blocks, out)
            if status == 0:
                if lo < hi:
                    self._lo, self._hi = min(self._lo, lo), max(self._hi, hi)
                return value, k
            if status == 1:  # a new holder (claim every row: one array pass) or no slot
                if slots[value] < 0:
                    return None
                self.claim(slots[:num_rows], seq_ids[:num_rows], arena.epoch[slots[:num_rows]])
            elif status == 3:
                self._widen(value)
            elif status == 4:
                self._make_room(value)
            else:  # 2: too wide a catch-up, 5: too wide a table
                return None

    def observe_rows(self, slots: np.ndarray, num_rows: int, seq_ids: np.ndarray,
                     num_accepted: np.ndarray, arena: SeqArena) -> bool:
        """:meth:`observe` for rows ``0 .. num_rows-1`` if each slot is held by its
        ``seq_ids`` entry (one C++ pass, ``_C.lm_observe``); False with nothing changed if
        one is not."""
        return _C.lm_observe(slots, num_rows, seq_ids, num_accepted, arena.epoch, self.owner,
                             self.epoch, self.num_cached, self.num_pending)

    def observe(self, slots: np.ndarray, num_accepted: np.ndarray) -> None:
        """After a verify step: the target kept ``num_accepted[i]`` drafts of row
        ``slots[i]``; the pending ones among them are now cached, the rest are dropped (a
        rejected draft is never re-emitted at its position, so the first
        ``min(num_pending, num_accepted)`` pending entries hold the sequence's tokens)."""
        self.num_cached[slots] += np.minimum(self.num_pending[slots], num_accepted)
        self.num_pending[slots] = 0

    def drop_caches(self) -> None:
        """Every row's K/V is recomputed from scratch at its next proposal (weights changed);
        the blocks stay with their holders."""
        self.num_cached[:] = 0
        self.num_pending[:] = 0

    def _make_room(self, need: int) -> None:
        """Free ``need`` blocks by evicting cached ones nobody holds (prefix caching), else
        raise: nothing was allocated."""
        prefix = self.kv_cache.prefix
        short = need - int(self.kv_cache.allocator.num_free)
        if prefix is None or short > len(prefix.evictable):
            self._out_of_blocks(need)
        prefix.evict(short)  # type: ignore[union-attr]

    def _out_of_blocks(self, need: int) -> None:
        raise RuntimeError(f"the draft model's KV cache is out of blocks: the step needs {need} "
                           f"more but {int(self.kv_cache.allocator.num_free)} are free (raise "
                           "kv_cache_tokens or lower max_batch_size)")

    def _widen(self, need: int) -> None:
        width = self.block_ids.shape[1]
        while width < need:
            width *= 2
        new = np.zeros((self.capacity, width), dtype=np.int32)
        new[:, : self.block_ids.shape[1]] = self.block_ids
        self.block_ids = new

    # ---- rows to send ------------------------------------------------------------------------
    def _mark(self, rows: np.ndarray) -> None:
        if len(rows):
            self._lo = min(self._lo, int(rows.min()))
            self._hi = max(self._hi, int(rows.max()) + 1)

    def take_changed(self) -> tuple[int, int]:
        """``[lo, hi)``: the rows whose table changed since the last call (empty: lo >= hi)."""
        lo, hi = self._lo, self._hi
        self._lo, self._hi = self.capacity, 0
        return lo, hi


class SlotState:
    """Row ``slot`` of ``rows`` seen as one sequence's state (``block_table``, ``num_cached``,
    ``num_pending``: the attributes of ``draft_model._State``), for the eager passes."""

    __slots__ = ("rows", "slot")

    def __init__(self, rows: LMSlots, slot: int) -> None:
        self.rows, self.slot = rows, slot

    @property
    def block_table(self) -> list[int]:
        return self.rows.blocks_of(self.slot)

    @property
    def num_cached(self) -> int:
        return int(self.rows.num_cached[self.slot])

    @num_cached.setter
    def num_cached(self, value: int) -> None:
        self.rows.num_cached[self.slot] = value

    @property
    def num_pending(self) -> int:
        return int(self.rows.num_pending[self.slot])

    @num_pending.setter
    def num_pending(self, value: int) -> None:
        self.rows.num_pending[self.slot] = value


__all__ = ["LMSlots", "SlotState"]
