"""The k-step chain loop of a hidden-state drafter (EAGLE-3, MTP) on static buffers.

Same passes as ``FeatureDrafter``'s eager chain, shaped for a CUDA graph: every row of the
padded batch drafts ``k`` tokens (rows asked for fewer draft extra tokens nobody verifies; rows
past the batch are inactive and write no KV), the inputs are the persistent batch state (the
target's rows: position, seed, sampling parameters), a block table of the drafter's own cache
kept row-aligned with it (``core.block_rows``) and a root-hidden buffer; the outputs are static
tensors. ``GraphRunner.run_graph`` captures one graph per (bucket, k) on CUDA.

Draft ``j`` of a row comes from the logits after entry ``len - 2 + j`` (entry ``len - 2`` is
the root written by ``observe``; entry ``len - 2 + j``, j >= 1, reads the previous output
hidden and draft ``j - 1``). An entry a row writes past its own drafts is rewritten before it
is ever read (``observe`` rewrites from the first unverified position on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specengine.core.batch import ACTIVE, CTX, OFFSET, SEED, TEMPERATURE, TOP_K, TOP_P
from specengine.core.block_rows import BlockRows
from specengine.core.graphs import GraphRunner
from specengine.core.transfer import to_device
from specengine.drafters.base import DraftProposal
from specengine.drafters.drafting import choose_from
from specengine.model.attention import AttentionMetadata
from specengine.sequence import Sequence

if TYPE_CHECKING:
    from specengine.drafters.feature_drafter import FeatureDrafter


class StaticFeatureChain:
    """Chain proposals of ``drafter`` through ``graphs`` (see the module docstring)."""

    def __init__(self, drafter: FeatureDrafter, graphs: GraphRunner) -> None:
        self.drafter, self.graphs = drafter, graphs
        state = graphs.verifier.state
        self.state = state
        self.blocks = BlockRows(state.capacity, state.max_blocks, drafter.device)
        self.root: Tensor | None = None  # [capacity, H]: each row's root hidden
        self._indptr: dict[int, Tensor] = {}

    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int]) -> DraftProposal:
        """``seqs`` in batch-row order (the step arranged them); every row drafts
        ``max(num_drafts)`` tokens, ``num_draft_tokens`` says how many count."""
        d = self.drafter
        k = max(num_drafts)
        states = [d._states[s.seq_id] for s in seqs]
        for st in states:  # room for the k - 1 entries the loop writes after the root
            d.kv_cache.ensure(st, st.num_cached + k)  # type: ignore[arg-type]
        self.blocks.sync([(s.seq_id, st.block_table) for s, st in zip(seqs, states)])
        roots = torch.stack([st.hidden for st in states])  # type: ignore[misc]
        if self.root is None:
            self.root = roots.new_zeros(self.state.capacity, roots.shape[-1])
        self.root[: len(seqs)] = roots
        rows = self.graphs.padded_rows(len(seqs))
        ids, probs = self.graphs.run_graph(("draft", rows, k, d.sample), rows,
                                           lambda: self._loop(rows, k))
        b = len(seqs)
        return DraftProposal(ids[:b], np.asarray(num_drafts, dtype=np.int64),
                             None if probs is None else probs[:b])

    @torch.inference_mode()
    def _loop(self, rows: int, k: int) -> tuple[Tensor, Tensor | None]:
        d, st = self.drafter, self.state
        ints = st.ints[:, :rows]
        base = ints[CTX] - 1  # the root entry's position: len - 2
        active = ints[ACTIVE] > 0
        table = self.blocks.table[:rows]
        bs = d.kv_cache.block_size
        if rows not in self._indptr:
            self._indptr[rows] = to_device(np.arange(rows + 1, dtype=np.int32), d.device)
        hidden = self.root[:rows]  # type: ignore[index]
        ids = torch.zeros(rows, k, dtype=torch.int64, device=d.device)
        probs = None
        tokens = ids[:, 0]
        for j in range(k):
            if j > 0:  # entry len - 2 + j: (previous output hidden, draft j - 1)
                pos = base + j
                block = table.gather(1, (pos // bs).clamp_max(st.max_blocks - 1)[:, None])
                slots = torch.where(active, block[:, 0].long() * bs + pos % bs, -1)
                meta = AttentionMetadata(slot_mapping=slots, block_tables=table,
                                         context_lens=pos.to(torch.int32),
                                         qo_indptr=self._indptr[rows], max_q_len=1)
                hidden, _ = d.module(tokens, hidden, pos, d.kv_cache.kv, meta,
                                     d.runner.backend)
            logits = d.module.compute_logits(hidden)
            tokens, q = choose_from(logits, d.sample, st.floats[TEMPERATURE, :rows],
                                    ints[TOP_K], st.floats[TOP_P, :rows], ints[SEED],
                                    ints[OFFSET] + j)
            ids[:, j] = tokens
            if q is not None:
                if probs is None:
                    probs = q.new_zeros(rows, k, q.shape[-1])
                probs[:, j] = q
        return ids, probs
