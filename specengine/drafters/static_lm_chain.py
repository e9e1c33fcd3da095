"""The small-LM drafter's chain on static buffers: catch-up pass + k-step loop, one graph.

Same passes as ``DraftModelDrafter``'s eager chain, shaped for a CUDA graph. Each row first
feeds the ``count`` tokens its draft cache has not seen (``start .. len - 1``: in steady state
the newest token and at most one accepted draft, so ``count`` <= 2) as a ragged-in-a-fixed-width
pass of ``C`` slots per row (padding gets slot -1); the logits after its last one give draft 0.
Then every row drafts ``k`` tokens one pass at a time, feeding draft ``j - 1`` at position
``len - 1 + j``. Rows past the batch have ``count = 0``: no KV write, ignored outputs. A
catch-up wider than :data:`MAX_CATCH_UP` (a draft whose cache was dropped by a weight update)
returns None and the drafter runs that proposal eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specengine.core.batch import SLOT
from specengine.core.block_rows import slots_of
from specengine.core.graphs import GraphRunner, Pass
from specengine.core.sequence import Sequence
from specengine.core.step_types import DraftProposal
from specengine.drafters.static_drafts import StaticDrafts
from specengine.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from specengine.drafters.draft_model import DraftModelDrafter

MAX_CATCH_UP = 4
#: catch-up widths captured at start: a steady chain step feeds the newest token and at most
#: the last accepted draft (wider ones, after a cache was dropped, are captured when met)
STARTUP_WIDTHS = (1, 2)
_START, _COUNT = MAX_CATCH_UP, MAX_CATCH_UP + 1  # columns of the inputs after the fed tokens


class StaticLMChain(StaticDrafts):
    """Chain proposals of a small-LM ``drafter`` through ``graphs``.

    The draft cache's state lives in ``drafter.slots`` (``LMSlots``, by arena slot), so a step
    reads it with array ops: the catch-up tokens are gathered from ``SeqArena.tokens``, every
    table is grown in one C++ pass, and the device table is indexed by arena slot (the pass
    gathers each row's through the batch state's ``SLOT`` field), so only the slot rows that
    changed are sent, in one contiguous copy."""

    def __init__(self, drafter: DraftModelDrafter, graphs: GraphRunner) -> None:
        super().__init__(graphs, drafter.device)
        self.drafter = drafter
        dev, cap, width = drafter.device, self.state.capacity, self.state.max_blocks
        pin = dev.type == "cuda"  # page-locked mirrors: the copies never block the host
        # The small LM's own block tables by arena slot (arena slots < max_batch_size <=
        # capacity); the spare last row (zeros) is the padded rows'.
        self._host_table_t = torch.zeros(cap + 1, width, dtype=torch.int32, pin_memory=pin)
        self._host_table = self._host_table_t.numpy()
        self.table = torch.zeros(cap + 1, width, dtype=torch.int32, device=dev)
        # Per batch row: the fed tokens (MAX_CATCH_UP columns), start, count; one copy.
        self._host_in_t = torch.zeros(cap, MAX_CATCH_UP + 2, dtype=torch.int64, pin_memory=pin)
        self._host_in = self._host_in_t.numpy()
        self.inputs = torch.zeros(cap, MAX_CATCH_UP + 2, dtype=torch.int64, device=dev)

    def propose(self, seqs: tuple[Sequence, ...], num_drafts: np.ndarray
                ) -> DraftProposal | None:
        """``seqs`` in batch-row order, ``num_drafts`` int64; None (the drafter proposes
        eagerly) when a catch-up is too wide for the static pass, a row's sequence is not in
        an arena or its table is wider than a device row."""
        d, st = self.drafter, self.state
        b, arena = len(seqs), st.arena
        if arena is None:
            return None
        # Drafts 0 .. n-2 are the ones the target may keep (observe counts them); entries
        # written past them are rewritten by a later catch-up before they are read.
        staged = d.slots_for(arena).stage(st.row_slots, b, st.row_seq_ids, num_drafts, arena,
                                          self.table.shape[1], self._host_in)
        if staged is None:
            return None
        width, k = staged
        self._send_tables()
        rows = self.graphs.padded_rows(b)
        self._host_in[b:rows] = 0  # padded rows: count 0, no KV write
        self.inputs[:rows].copy_(self._host_in_t[:rows], non_blocking=d.device.type == "cuda")
        key, fn = self._draft_pass(rows, width, k, self.samples_now)
        ids, probs = self.graphs.run_graph(key, rows, fn)
        return DraftProposal(ids[:b], num_drafts, None if probs is None else probs[:b])

    def _draft_pass(self, rows: int, width: int, k: int, sample: bool) -> Pass:
        return (("lm-draft", rows, width, k, sample), lambda: self._loop(rows, width, k, sample))

    def startup_draft(self, rows: int, k: int) -> list[Pass]:
        """Every :data:`STARTUP_WIDTHS` catch-up width (``GraphRunner.capture_startup``; the
        neutral rows' inputs say count 0: no KV write)."""
        return [self._draft_pass(rows, w, k, self.samples) for w in STARTUP_WIDTHS]

    def observe(self, num_rows: int, num_accepted: np.ndarray) -> bool:
        """``LMSlots.observe`` for batch rows ``0 .. num_rows-1``; False when a row's
        sequence is outside an arena or has no state (the drafter then observes eagerly)."""
        st, lm = self.state, self.drafter.slots
        if lm is None or st.arena is None:
            return False
        return lm.observe_rows(st.row_slots, num_rows, st.row_seq_ids,
                               np.ascontiguousarray(num_accepted, dtype=np.int64), st.arena)

    def _send_tables(self) -> None:
        """The slot rows whose table changed since the last send, in one copy."""
        lm = self.drafter.slots
        lo, hi = lm.take_changed()  # type: ignore[union-attr]
        if lo >= hi:
            return
        src = lm.block_ids[lo:hi, : self.table.shape[1]]  # type: ignore[union-attr]
        self._host_table[lo:hi] = 0
        self._host_table[lo:hi, : src.shape[1]] = src
        self.table[lo:hi].copy_(self._host_table_t[lo:hi],
                                non_blocking=self.table.device.type == "cuda")

    def _pass(self, ids: Tensor, positions: Tensor, valid: Tensor, context: Tensor,
              table: Tensor) -> Tensor:
        """One draft-model pass: ``ids``/``positions``/``valid`` ``[rows, n]``, the first at
        ``context`` tokens of cache; returns final hidden ``[rows, n, H]``."""
        d = self.drafter
        rows, n = ids.shape
        meta = AttentionMetadata(
            slot_mapping=slots_of(table, positions, valid, d.kv_cache.block_size).reshape(-1),
            block_tables=table, context_lens=context.to(torch.int32),
            qo_indptr=self.qo_indptr(rows, n), max_q_len=n)
        hidden, _ = d.module(ids.reshape(-1), positions.reshape(-1), d.kv_cache.kv, meta,
                             d.runner.backend)
        return hidden.view(rows, n, -1)

    @torch.inference_mode()
    def _loop(self, rows: int, width: int, k: int, sample: bool
              ) -> tuple[Tensor, Tensor | None]:
        d = self.drafter
        slot = self.state.ints[SLOT, :rows]
        table = self.table[torch.where(slot < 0, self.table.shape[0] - 1, slot)]
        start, count = self.inputs[:rows, _START], self.inputs[:rows, _COUNT]
        j = torch.arange(width, device=start.device)
        hidden = self._pass(self.inputs[:rows, :width], start[:, None] + j[None, :],
                            j[None, :] < count[:, None], start, table)
        last = hidden[torch.arange(rows, device=start.device), (count - 1).clamp_min(0)]
        logits = d.module.compute_logits(last)
        length, active = start + count, (count > 0)[:, None]
        ids = torch.zeros(rows, k, dtype=torch.int64, device=start.device)
        probs = None
        tokens = ids[:, 0]
        for i in range(k):
            if i > 0:  # feed draft i - 1 at position len - 1 + i
                pos = length - 1 + i
                h = self._pass(tokens[:, None], pos[:, None], active, pos, table)
                logits = d.module.compute_logits(h[:, 0])
            tokens, probs = self.choose(logits, sample, i, ids, probs)
        return ids, probs
