"""The running batch as persistent device tensors, updated incrementally.

Every running sequence owns a row ``0 .. num_rows-1``. Per row the device holds its block
table, its step fields (tokens cached, newest token, the position its next emitted token
takes, drafts this step, active flag) and its sampling parameters. A step changes only what
moved: a sequence that joins gets its whole row written, one that grows gets its new block
ids, one that leaves is replaced by the last row (rows stay dense, so a step's batch is always
rows ``0 .. B-1`` and padding to a bucket is rows ``B ..``). Rows past ``num_rows`` are kept
neutral (inactive, greedy, zero blocks), so a padded row writes no KV and costs nothing in the
output.

Host mirrors are written in place and sent with non-blocking copies (page-locked on CUDA), at
most three per step: the step fields, the sampling fields, and the block-table rows that
changed (``core.block_rows``). The host writes a mirror again only after the step's one
blocking device→host copy, so a copy is always done before its source changes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

import specengine._C as _C
from specengine.core.block_rows import BlockRows
from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import Sequence
from specengine.sampling import MAX_STOP_TOKEN_IDS

# Rows of the int64 step-field array (one copy per step; csrc/stage_rows.h numbers its first
# four and the limits' rows the same).
CTX, LAST, OFFSET, NUM_DRAFT, ACTIVE, TOP_K, SEED, SLOT = range(8)
NUM_INT_FIELDS = 8
# Rows of the float32 sampling-field array (LOG_MIN_P: log(min_p), -inf = off).
TEMPERATURE, TOP_P, LOG_MIN_P = range(3)
NUM_FLOAT_FIELDS = 3
#: ids a row masks until ``min_tokens``: its stop ids (at most MAX_STOP_TOKEN_IDS, checked at
#: admission) and the checkpoint's EOS ids (a handful)
MAX_MASKED_IDS = MAX_STOP_TOKEN_IDS + 64
# Rows of the host-only limits (they plan draft lengths; the device never needs them).
MAX_TOKENS, PROMPT_LEN = range(2)
_NO_ROWS = np.zeros(0, dtype=np.int64)


def _pinned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    pin = device.type == "cuda"
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


class BatchState:
    """Row ``r`` of every field belongs to ``self.seqs[r]``; see the module docstring."""

    def __init__(self, capacity: int, max_blocks: int, device: torch.device) -> None:
        if capacity < 1 or max_blocks < 1:
            raise ValueError(f"BatchState needs capacity and max_blocks >= 1, got {capacity}, "
                             f"{max_blocks}")
        self.capacity, self.max_blocks, self.device = capacity, max_blocks, device
        # One host buffer (page-locked on CUDA) and one device buffer hold the step fields
        # (ints [8, R] int64) followed by the block tables ([R, max_blocks] int32), so a step
        # sends both with one copy: the fields and the table rows up to the last one changed.
        self._ints_bytes = NUM_INT_FIELDS * capacity * 8
        self._row_bytes = max_blocks * 4
        size = self._ints_bytes + capacity * self._row_bytes
        self._host_bytes = _pinned((size,), torch.uint8, device)
        self._dev_bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        self._host_ints_t, host_table = self._split(self._host_bytes)
        self.ints, self.block_tables = self._split(self._dev_bytes)
        self._host_floats_t = _pinned((NUM_FLOAT_FIELDS, capacity), torch.float32, device)
        # Restaged draft counts (a drafter proposed fewer than asked) go through their own
        # page-locked row: the step fields' non-blocking copy may still be reading the shared
        # buffer when a drafter returns, so it is never written again before the step's sync.
        self._host_restage_t = _pinned((capacity,), torch.int64, device)
        self._host_restage = self._host_restage_t.numpy()
        self.host_ints = self._host_ints_t.numpy()
        self.host_floats = self._host_floats_t.numpy()
        self.host_limits = np.zeros((2, capacity), dtype=np.int64)
        self.floats = torch.zeros(NUM_FLOAT_FIELDS, capacity, dtype=torch.float32,
                                  device=device)
        # min_tokens (``verify`` masks a row's stop ids at positions < min_pos): per row the
        # position its first unmaskable token takes (prompt + min_tokens; 0 = none) and the
        # ids it masks (padded with a repeat of its first). Sent only when such a row joins,
        # moves or leaves; a step reads them only while some row is under its min_tokens.
        self._host_mask_t = _pinned((capacity, MAX_MASKED_IDS + 1), torch.int64, device)
        self.host_mask = self._host_mask_t.numpy()  # column 0: min_pos, then the ids
        self.mask = torch.zeros(capacity, MAX_MASKED_IDS + 1, dtype=torch.int64, device=device)
        self.num_min_tokens_rows = 0  # rows with min_tokens > 0
        self.num_logprobs_rows = 0  # rows asking for top-N logprobs (SamplingParams.logprobs)
        self.num_sampled_rows = 0  # rows with temperature > 0 (a sampling drafter samples)
        self._mask_dirty = False
        self._send_views: dict[int, tuple[Tensor, Tensor]] = {}
        self.blocks = BlockRows(capacity, max_blocks, host_table)
        self.seqs: list[Sequence] = []
        self._rows: dict[int, int] = {}  # seq_id -> row
        # Each row's slot in the sequences' arena (``core.seq_arena``; -1: a detached one),
        # and the arena (None until an attached sequence joins).
        self.row_slots = np.full(capacity, -1, dtype=np.int64)
        self.row_seq_ids = np.full(capacity, -1, dtype=np.int64)
        self.row_epochs = np.zeros(capacity, dtype=np.int64)  # ``SeqArena.epoch`` at joining
        self.arena: SeqArena | None = None
        self._arranged: tuple[tuple[Sequence, ...] | None, tuple[Sequence, ...]] = (None, ())
        self._changed_rows: set[int] = set()  # rows whose owner changed since the last stage
        # Bumped by every membership change: a drafter may cache what it derived from the
        # rows (e.g. which rows have a root) until the next change.
        self.generation = 0
        self._all_attached = False  # every row's sequence sits in the arena
        self._floats_dirty = True  # sampling fields changed since they were last sent
        for r in range(capacity):
            self._neutral(r)

    def _split(self, buf: Tensor) -> tuple[Tensor, Tensor]:
        """(ints [8, R] int64, block tables [R, max_blocks] int32) views of a byte buffer."""
        ints = buf[: self._ints_bytes].view(torch.int64).view(NUM_INT_FIELDS, self.capacity)
        table = buf[self._ints_bytes:].view(torch.int32).view(self.capacity, self.max_blocks)
        return ints, table

    @property
    def num_rows(self) -> int:
        return len(self.seqs)

    # ---- membership ------------------------------------------------------------------------
    def arrange(self, seqs: tuple[Sequence, ...]) -> tuple[Sequence, ...]:
        """Make ``seqs`` the batch: drop rows of sequences not in it, add the new ones, and
        return ``seqs`` in row order (the order every buffer of the step uses)."""
        if self._arranged[0] is seqs:  # the scheduler's unchanged batch: rows are as they were
            return self._arranged[1]
        if len(seqs) > self.capacity:
            raise ValueError(f"{len(seqs)} sequences exceed the batch capacity {self.capacity}")
        live = {s.seq_id for s in seqs}
        for sid in [sid for sid in self._rows if sid not in live]:
            self._remove(sid)
        for seq in seqs:
            r = self._rows.get(seq.seq_id)
            if r is None:
                self._add(seq)
            elif self.row_slots[r] != seq.slot or (  # preempted and admitted again meanwhile
                    seq.arena is not None and self.row_epochs[r] != seq.arena.epoch[seq.slot]):
                self.row_slots[r] = self.host_ints[SLOT, r] = seq.slot
                self.row_epochs[r] = seq.arena.epoch[seq.slot] if seq.arena is not None else 0
                self._changed_rows.add(r)
        arranged = tuple(self.seqs)
        self._arranged = (seqs, arranged)
        n = len(arranged)
        self._all_attached = (self.arena is not None and n > 0
                              and bool((self.row_slots[:n] >= 0).all()))
        self.generation += 1
        return arranged

    def clear(self) -> None:
        """Forget every row (after an aborted generate)."""
        for sid in list(self._rows):
            self._remove(sid)
        self._arranged = (None, ())
        self._all_attached = False
        self.generation += 1

    def _add(self, seq: Sequence) -> None:
        r = len(self.seqs)
        self.seqs.append(seq)
        self._rows[seq.seq_id] = r
        self.row_slots[r] = self.host_ints[SLOT, r] = seq.slot
        self.row_seq_ids[r] = seq.seq_id
        self._changed_rows.add(r)
        if seq.arena is not None:
            self.arena = seq.arena
            self.row_epochs[r] = seq.arena.epoch[seq.slot]
        p = seq.params
        self.host_ints[TOP_K, r] = p.top_k
        self.host_ints[SEED, r] = seq.seed
        self.host_ints[ACTIVE, r] = 1
        self.host_floats[TEMPERATURE, r] = p.temperature
        self.host_floats[TOP_P, r] = p.top_p
        self.host_floats[LOG_MIN_P, r] = np.log(np.float32(p.min_p)) if p.min_p > 0 else -np.inf
        self._floats_dirty = True
        self.host_limits[:, r] = (p.max_tokens, seq.num_prompt_tokens)
        if p.logprobs is not None:
            self.num_logprobs_rows += 1
        if p.temperature > 0:
            self.num_sampled_rows += 1
        if p.min_tokens > 0 and seq.stop_token_ids:
            ids = sorted(seq.stop_token_ids)
            self.host_mask[r, 0] = seq.num_prompt_tokens + p.min_tokens
            self.host_mask[r, 1:] = ids[0]
            self.host_mask[r, 1: len(ids) + 1] = ids
            self.num_min_tokens_rows += 1
            self._mask_dirty = True

    def _remove(self, seq_id: int) -> None:
        r = self._rows.pop(seq_id)
        last = len(self.seqs) - 1
        if self.seqs[r].params.logprobs is not None:
            self.num_logprobs_rows -= 1
        if self.seqs[r].params.temperature > 0:
            self.num_sampled_rows -= 1
        if self.host_mask[r, 0]:
            self.num_min_tokens_rows -= 1
            self._mask_dirty = True
        if self.host_mask[last, 0]:  # it moves to row r
            self._mask_dirty = True
        if r != last:  # the last row fills the hole: rows stay dense
            moved = self.seqs[last]
            self.seqs[r] = moved
            self._rows[moved.seq_id] = r
            self.host_ints[:, r] = self.host_ints[:, last]
            self.host_floats[:, r] = self.host_floats[:, last]
            self._floats_dirty = True
            self.host_limits[:, r] = self.host_limits[:, last]
            self.host_mask[r] = self.host_mask[last]
            self.row_slots[r] = self.row_slots[last]
            self.row_seq_ids[r] = self.row_seq_ids[last]
            self.row_epochs[r] = self.row_epochs[last]
            self._changed_rows.add(r)
        self.seqs.pop()
        self.row_slots[last] = self.row_seq_ids[last] = -1
        self._changed_rows.discard(last)
        self._neutral(last)

    def _neutral(self, r: int) -> None:
        self._floats_dirty = True
        self.host_ints[:, r] = 0
        self.host_ints[TOP_K, r] = -1
        self.host_ints[SLOT, r] = -1  # no arena slot: a padded row
        self.host_floats[TEMPERATURE, r] = 0.0  # greedy: the cheapest row for the sampler
        self.host_floats[TOP_P, r] = 1.0
        self.host_floats[LOG_MIN_P, r] = -np.inf
        self.host_mask[r] = 0

    # ---- per step ----------------------------------------------------------------------------
    def lengths(self) -> np.ndarray:
        """``len(seq)`` of rows ``0 .. B-1``."""
        n = len(self.seqs)
        if self._all_attached:
            return self.arena.lens[self.row_slots[:n]]  # type: ignore[union-attr]
        return np.fromiter((len(s) for s in self.seqs), dtype=np.int64, count=len(self.seqs))

    def chain_drafts(self, k: int, lens: np.ndarray, max_model_len: int) -> np.ndarray:
        """``core.step.num_drafts_for`` of every row at once: ``k``, cut so a step emits
        nothing past ``max_tokens`` (it emits drafts + 1) nor feeds past ``max_model_len``."""
        n = len(lens)
        remaining = self.host_limits[MAX_TOKENS, :n] - (lens - self.host_limits[PROMPT_LEN, :n])
        return np.maximum(0, np.minimum(np.minimum(k, remaining - 1), max_model_len - lens))

    def stage(self, num_drafts: np.ndarray, lens: np.ndarray | None = None) -> None:
        """Write the step fields of rows ``0 .. B-1`` (in row order, after :meth:`arrange`)
        with the given draft counts and send them, with the changed block-table rows, to the
        device (``lens`` = :meth:`lengths` when the caller has them). Rows past ``B`` are
        neutral, so any bucket's padded rows read neutral fields."""
        n = len(self.seqs)
        if num_drafts.shape != (n,):
            raise ValueError(f"num_drafts has shape {num_drafts.shape}, expected ({n},)")
        self._stage(np.ascontiguousarray(num_drafts, dtype=np.int64), 0, -1, 0, lens)

    def stage_step(self, k: int, tree_drafts: int, max_model_len: int
                   ) -> tuple[np.ndarray, int]:
        """:meth:`stage` with the step's draft plan made here: a chain of ``k`` drafts cut per
        row as ``core.step.num_drafts_for``, or (``tree_drafts >= 0``) a tree's for every
        row, none for all when a row would feed past ``max_model_len``. Returns the counts
        and the largest."""
        max_drafts = self._stage(None, k, tree_drafts, max_model_len, None)
        # A view: the host writes this row again only at the next stage, after this step.
        return self.host_ints[NUM_DRAFT, : len(self.seqs)], max_drafts

    def _stage(self, num_drafts: np.ndarray | None, k: int, tree_drafts: int,
               max_model_len: int, lens: np.ndarray | None) -> int:
        """Write and send the step fields; returns the largest draft count staged."""
        seqs = self.seqs
        n = len(seqs)
        blocks = self.blocks
        if self._all_attached:  # one C++ pass over the rows, reading the arena
            arena = self.arena
            changed = (np.fromiter(self._changed_rows, np.int64, len(self._changed_rows))
                       if self._changed_rows else _NO_ROWS)
            max_drafts, send_rows = _C.stage_rows(
                self.host_ints, self.host_limits, self.row_slots, n, arena.lens,  # type: ignore
                arena.tokens, arena.num_blocks, num_drafts, k, tree_drafts,  # type: ignore
                max_model_len, arena.block_ids, blocks.host, blocks.sent, changed,  # type: ignore
                blocks.num_used)
            blocks.written(n)
        else:  # detached sequences (tests): the same fields from their lists
            lens = self.lengths() if lens is None else lens
            if num_drafts is None:
                num_drafts = (self.chain_drafts(k, lens, max_model_len) if tree_drafts < 0
                              else np.full(n, tree_drafts if (lens + tree_drafts
                                                              <= max_model_len).all() else 0))
            self.host_ints[CTX, :n] = lens - 1
            self.host_ints[OFFSET, :n] = lens
            self.host_ints[LAST, :n] = np.fromiter((s.last_token for s in seqs), np.int64, n)
            self.host_ints[NUM_DRAFT, :n] = num_drafts
            max_drafts = int(num_drafts.max(initial=0))
            send_rows = blocks.sync([(s.seq_id, s.block_table) for s in seqs])
        self._changed_rows.clear()
        nb = self.device.type == "cuda"
        views = self._send_views.get(send_rows)
        if views is None:  # (device, host) bytes of the fields and the first table rows
            end = self._ints_bytes + send_rows * self._row_bytes
            views = self._send_views[send_rows] = (self._dev_bytes[:end], self._host_bytes[:end])
        views[0].copy_(views[1], non_blocking=nb)
        if self._floats_dirty:  # sampling fields change only when rows join or leave
            self.floats.copy_(self._host_floats_t, non_blocking=nb)
            self._floats_dirty = False
        if self._mask_dirty:  # min_tokens rows joined, moved or left: every row is sent, so a
            # row that held one and was cleared holds zeros on the device too
            self.mask.copy_(self._host_mask_t, non_blocking=nb)
            self._mask_dirty = False
        return max_drafts

    def masks_stops(self) -> bool:
        """Whether some row of ``0 .. B-1`` is still under its ``min_tokens``: its next
        emitted token (at position ``len(seq)``) must not be a stop id (no work unless some
        row has ``min_tokens``)."""
        if not self.num_min_tokens_rows:
            return False
        lens = self.lengths()
        return bool((self.host_mask[: len(lens), 0] > lens).any())

    def restage_num_drafts(self, num_drafts: np.ndarray) -> None:
        """Send new draft counts of rows ``0 .. B-1`` (a drafter proposed fewer than asked),
        from their own host row: the step fields' host buffer, whose copy this step's
        :meth:`stage` started and may still be in flight, is not written (its ``NUM_DRAFT``
        row keeps the staged plan until the next stage rewrites it). One restage per step at
        most, so this row's previous copy finished at the last step's sync."""
        n = len(self.seqs)
        if num_drafts.shape != (n,):
            raise ValueError(f"num_drafts has shape {num_drafts.shape}, expected ({n},)")
        self._host_restage[:n] = num_drafts
        self.ints[NUM_DRAFT, :n].copy_(self._host_restage_t[:n],
                                       non_blocking=self.device.type == "cuda")
