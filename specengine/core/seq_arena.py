"""Running sequences' tokens, log-probabilities, weight versions and counters in host arrays.

A sequence takes a slot when it starts running (prefill) and gives it back when it finishes or
is preempted (``Sequence.attach`` / ``Sequence.detach`` copy its lists in and out). While it
runs, its slot is the only copy of its tokens, so a step appends every row's emitted tokens
in one C++ pass (:meth:`SeqArena.append_packed`) instead of a Python loop over sequences:
the stop-token, ``max_tokens`` and ``max_model_len`` cuts, the counters and the per-token
weight versions are all vectorised. Slots are stable while a sequence runs (batch rows are
not: ``core.batch`` moves rows when sequences leave), so drafters may key per-sequence device
state by slot too.

Columns are token positions: ``tokens[s, :lens[s]]`` are the sequence's tokens (prompt
first), ``logprobs`` and ``versions`` are meaningful from ``num_prompt[s]`` on. The width grows
by doubling when a sequence needs more (amortised; never in a steady step).

A running sequence's KV block table lives here too: ``block_ids[s, :num_blocks[s]]`` (the rest
of the row is zero). The scheduler grows every short table of a step in one C++ pass
(``KVCache.ensure_running``), and the batch state sends grown rows by copying arena rows, so no
step visits a sequence in Python to grow or send its table.
"""

from __future__ import annotations

import numpy as np

import specengine._C as _C

# Counter rows of ``SeqArena.counters``.
NUM_STEPS, NUM_DRAFT, NUM_ACCEPTED = range(3)


class SeqArena:
    """Host storage for up to ``capacity`` running sequences (see the module docstring)."""

    def __init__(self, capacity: int, max_model_len: int, width: int = 256,
                 block_width: int = 16) -> None:
        if capacity < 1 or max_model_len < 1:
            raise ValueError(f"SeqArena needs capacity and max_model_len >= 1, got {capacity}, "
                             f"{max_model_len}")
        self.capacity, self.max_model_len = capacity, max_model_len
        width = max(1, min(width, max_model_len))
        self.tokens = np.zeros((capacity, width), dtype=np.int64)
        self.logprobs = np.zeros((capacity, width), dtype=np.float64)
        self.versions = np.zeros((capacity, width), dtype=np.int64)
        self.lens = np.zeros(capacity, dtype=np.int64)
        self.num_prompt = np.zeros(capacity, dtype=np.int64)
        # The length a sequence ends at: prompt + max_tokens, capped by max_model_len.
        self.limit = np.zeros(capacity, dtype=np.int64)
        self.counters = np.zeros((3, capacity), dtype=np.int64)
        # Scheduling: draft tokens a verify step feeds after the newest token (uncapped), and
        # KV blocks owned (kept current by the scheduler; the batch state sends grown rows).
        self.lookahead = np.zeros(capacity, dtype=np.int64)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)
        # [capacity, block_width] int32: slot s's block table in its first num_blocks[s]
        # columns, zeros after (widened by doubling, like the token columns).
        self.block_ids = np.zeros((capacity, max(1, block_width)), dtype=np.int32)
        self.done = np.zeros(capacity, dtype=bool)  # ended in its last step (not released yet)
        self.num_done = 0  # slots flagged in ``done`` (0: no running sequence has ended)
        # Takes of each slot so far: a sequence that left and came back to the same slot
        # (preempted, prefilled again) is told apart from one that stayed.
        self.epoch = np.zeros(capacity, dtype=np.int64)
        self.stop_ids = np.full((capacity, 1), -1, dtype=np.int64)  # -1 pads (never a token)
        # Slots whose sequence has stop strings (``stop_strings.cut_at_stop_strings`` visits
        # only these rows after a step; set by ``Sequence.attach``).
        self.has_stop_strings = np.zeros(capacity, dtype=bool)
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ---- slots -----------------------------------------------------------------------------
    def take(self, tokens: list[int], num_prompt: int, max_tokens: int,
             stop_ids: frozenset[int]) -> int:
        """A slot holding ``tokens`` (prompt + generated so far); the caller writes the
        generated tokens' logprobs / versions and the counters."""
        if not self._free:
            raise RuntimeError(f"SeqArena: all {self.capacity} slots are taken")
        n = len(tokens)
        self._grow(n)
        s = self._free.pop()
        self.tokens[s, :n] = tokens
        self.lens[s] = n
        self.num_prompt[s] = num_prompt
        self.limit[s] = min(num_prompt + max_tokens, self.max_model_len)
        self.counters[:, s] = 0
        self.lookahead[s] = self.num_blocks[s] = 0
        self.block_ids[s] = 0
        self.done[s] = False
        self.epoch[s] += 1
        if len(stop_ids) > self.stop_ids.shape[1]:
            pad = np.full((self.capacity, len(stop_ids) - self.stop_ids.shape[1]), -1, np.int64)
            self.stop_ids = np.concatenate([self.stop_ids, pad], axis=1)
        self.stop_ids[s] = -1
        self.stop_ids[s, :len(stop_ids)] = sorted(stop_ids)
        return s

    def give_back(self, slot: int) -> None:
        self.has_stop_strings[slot] = False
        if self.done[slot]:
            self.done[slot] = False
            self.num_done -= 1
        self.lens[slot] = 0
        self.num_blocks[slot] = 0
        self.block_ids[slot] = 0
        self._free.append(slot)

    # ---- block tables ------------------------------------------------------------------------
    def blocks_of(self, slot: int) -> list[int]:
        """Slot ``slot``'s block table (a copy)."""
        return self.block_ids[slot, : self.num_blocks[slot]].tolist()

    def set_blocks(self, slot: int, ids: list[int] | np.ndarray) -> None:
        """Make ``ids`` slot ``slot``'s whole block table."""
        n = len(ids)
        self.grow_block_columns(n)
        self.block_ids[slot] = 0
        self.block_ids[slot, :n] = ids
        self.num_blocks[slot] = n

    def add_blocks(self, slots: np.ndarray, counts: np.ndarray, ids: np.ndarray) -> None:
        """Append ``counts[i]`` blocks to the table of ``slots[i]`` (distinct slots), taking
        them in order from ``ids`` (``len(ids) == counts.sum()``): one scatter for all."""
        counts = np.asarray(counts, dtype=np.int64)
        if len(ids) != int(counts.sum()):
            raise ValueError(f"{len(ids)} block ids for {int(counts.sum())} new entries")
        start = self.num_blocks[slots]
        self.grow_block_columns(int((start + counts).max(initial=0)))
        # entry j of the flat ids goes to row slots[i], column start[i] + (j - first[i]) where
        # i is the slot it belongs to and first[i] = counts[:i].sum()
        row_of = np.repeat(np.arange(len(slots)), counts)
        first = np.cumsum(counts) - counts
        cols = start[row_of] + np.arange(len(ids)) - first[row_of]
        self.block_ids[np.asarray(slots)[row_of], cols] = ids
        self.num_blocks[slots] = start + counts

    def grow_block_columns(self, need: int) -> None:
        """Widen ``block_ids`` to at least ``need`` columns (by doubling)."""
        width = self.block_ids.shape[1]
        if need <= width:
            return
        while width < need:
            width *= 2
        new = np.zeros((self.capacity, width), dtype=np.int32)
        new[:, : self.block_ids.shape[1]] = self.block_ids
        self.block_ids = new

    def _grow(self, need: int) -> None:
        if need <= self.width:
            return
        width = self.width
        while width < need:
            width *= 2
        width = min(width, max(need, self.max_model_len))
        for name in ("tokens", "logprobs", "versions"):
            old = getattr(self, name)
            new = np.zeros((self.capacity, width), dtype=old.dtype)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    # ---- the step ----------------------------------------------------------------------------
    def append_packed(self, packed: np.ndarray, num_rows: int, slots: np.ndarray,
                      num_drafts: np.ndarray, depths: np.ndarray, stats: np.ndarray,
                      version: int) -> tuple[int, list[tuple[int, int]]]:
        """Append one step's packed sampler output (``packed [rows, 3N + 1]`` float64,
        ``sampler.SamplerOutput.pack``; rows ``0 .. num_rows-1`` belong to ``slots``): row
        ``b`` emitted ``ids[b, :num_accepted[b] + 1]``, kept up to and including the first
        stop token and at most up to ``limit``; each kept token records ``version``; the
        counters count the step and its drafts (``num_drafts``); ``stats [2, P]`` (proposed,
        accepted per draft position, for rows proposing ``depths[b]`` positions) is
        accumulated. Returns ``(tokens kept, [(row, 1: a stop token | 2: the length limit)]``
        for the rows whose sequence ended) and sets ``done``.

        One pass of ``specengine._C.append_step`` (no Python loop over rows; the reference
        it is tested against is ``tests/arena_reference.py``)."""
        while True:
            width, kept, ended = _C.append_step(
                self.tokens, self.logprobs, self.versions, self.lens, self.limit,
                self.stop_ids, self.done, self.counters, packed, num_rows, slots, num_drafts,
                depths, stats, version)
            if width == 0:
                self.num_done += len(ended)
                return kept, ended
            self._grow(width)  # nothing was written: widen and append again


__all__ = ["NUM_ACCEPTED", "NUM_DRAFT", "NUM_STEPS", "SeqArena"]
