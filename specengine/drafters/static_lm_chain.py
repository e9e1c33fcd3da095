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

from specengine.core.block_rows import BlockRows, slots_of
from specengine.core.graphs import GraphRunner
from specengine.core.transfer import to_device
from specengine.drafters.base import DraftProposal
from specengine.drafters.static_drafts import StaticDrafts
from specengine.model.attention import AttentionMetadata
from specengine.sequence import Sequence

if TYPE_CHECKING:
    from specengine.drafters.draft_model import DraftModelDrafter

MAX_CATCH_UP = 4


class StaticLMChain(StaticDrafts):
    """Chain proposals of a small-LM ``drafter`` through ``graphs``."""

    def __init__(self, drafter: DraftModelDrafter, graphs: GraphRunner) -> None:
        super().__init__(graphs, drafter.device)
        # The small LM's own cache: its block table, row-aligned with the batch.
        self.blocks = BlockRows(self.state.capacity, self.state.max_blocks, drafter.device)
        self.drafter = drafter
        dev, capacity = drafter.device, self.state.capacity
        self.fed = torch.zeros(capacity, MAX_CATCH_UP, dtype=torch.int64, device=dev)
        self.fields = torch.zeros(2, capacity, dtype=torch.int64, device=dev)  # start, count

    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int]) -> DraftProposal | None:
        """``seqs`` in batch-row order; None when a catch-up is too wide for the static pass."""
        d = self.drafter
        states = [d._state(s) for s in seqs]
        lens = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
        starts = np.minimum([st.num_cached for st in states], lens - 1)
        counts = lens - starts
        width = int(counts.max())
        if width > MAX_CATCH_UP:
            return None
        k = max(num_drafts)
        fed = np.zeros((len(seqs), width), dtype=np.int64)
        for b, (seq, st, n) in enumerate(zip(seqs, states, num_drafts)):
            fed[b, : counts[b]] = seq.token_ids[starts[b]:]
            d.kv_cache.ensure(st, len(seq) + k - 1)  # type: ignore[arg-type]
            # Drafts 0 .. n-2 are the ones the target may keep (observe counts them); entries
            # written past them are rewritten by a later catch-up before they are read.
            st.num_cached, st.num_pending = len(seq), max(n - 1, 0)
        self.blocks.sync([(s.seq_id, st.block_table) for s, st in zip(seqs, states)])
        b = len(seqs)
        rows = self.graphs.padded_rows(b)
        self.fed[:b, :width].copy_(to_device(fed, d.device))
        self.fields[:, :b].copy_(to_device(np.stack([starts, counts]), d.device))
        self.fields[:, b:rows] = 0
        ids, probs = self.graphs.run_graph(("lm-draft", rows, width, k, d.sample), rows,
                                           lambda: self._loop(rows, width, k))
        return DraftProposal(ids[:b], np.asarray(num_drafts, dtype=np.int64),
                             None if probs is None else probs[:b])

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
    def _loop(self, rows: int, width: int, k: int) -> tuple[Tensor, Tensor | None]:
        d = self.drafter
        table = self.blocks.table[:rows]
        start, count = self.fields[0, :rows], self.fields[1, :rows]
        j = torch.arange(width, device=start.device)
        hidden = self._pass(self.fed[:rows, :width], start[:, None] + j[None, :],
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
            tokens, probs = self.choose(logits, d.sample, i, ids, probs)
        return ids, probs
