"""The k-step chain loop and the catch-up of a hidden-state drafter (EAGLE-3, MTP) on static
buffers.

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

:meth:`StaticFeatureChain.observe` is ``FeatureDrafter.observe`` after a verify pass, fed
from that pass's device outputs (accepted rows' target features, emitted tokens): entry
``start + j`` (``start = len - 1`` before the step, ``j = 0 .. accepted``) reads the target's
features of the ``j``-th accepted row and the ``j``-th emitted token; the last one's output is
the next root. One graph per verify shape (its outputs are this pass's inputs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specengine.core.batch import ACTIVE, CTX
from specengine.core.block_rows import slots_of
from specengine.core.graphs import GraphRunner
from specengine.core.transfer import to_device
from specengine.core.verify import VerifyOutput, VerifyShape
from specengine.drafters.base import DraftProposal
from specengine.drafters.static_drafts import StaticDrafts
from specengine.model.attention import AttentionMetadata
from specengine.model_runner import ForwardOutput
from specengine.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from specengine.drafters.feature_drafter import FeatureDrafter


class StaticFeatureChain(StaticDrafts):
    """Chain proposals of ``drafter`` through ``graphs`` (see the module docstring)."""

    def __init__(self, drafter: FeatureDrafter, graphs: GraphRunner) -> None:
        super().__init__(graphs, drafter.device)
        self.drafter = drafter
        self.root: Tensor | None = None  # [capacity, H]: each row's root hidden
        # [capacity]: entries each row writes in the catch-up pass (0: none, a finished row)
        self.counts = torch.zeros(self.state.capacity, dtype=torch.int64, device=drafter.device)

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
        indptr = self.qo_indptr(rows, 1)
        hidden = self.root[:rows]  # type: ignore[index]
        ids = torch.zeros(rows, k, dtype=torch.int64, device=d.device)
        probs = None
        tokens = ids[:, 0]
        for j in range(k):
            if j > 0:  # entry len - 2 + j: (previous output hidden, draft j - 1)
                pos = base + j
                slots = slots_of(table, pos[:, None], active[:, None], bs)[:, 0]
                meta = AttentionMetadata(slot_mapping=slots, block_tables=table,
                                         context_lens=pos.to(torch.int32),
                                         qo_indptr=indptr, max_q_len=1)
                hidden, _ = d.module(tokens, hidden, pos, d.kv_cache.kv, meta,
                                     d.runner.backend)
            tokens, probs = self.choose(d.module.compute_logits(hidden), d.sample, j, ids, probs)
        return ids, probs

    def observe(self, seqs: tuple[Sequence, ...], out: VerifyOutput, shape: VerifyShape,
                num_accepted: np.ndarray) -> bool:
        """Catch up after the verify pass ``out`` (``seqs`` in row order, already extended
        by this step's tokens). False (the caller observes eagerly) if a sequence has no
        state yet."""
        d = self.drafter
        states = [d._states.get(s.seq_id) for s in seqs]
        if any(st is None for st in states):
            return False
        live = np.fromiter((s.status is not SeqStatus.FINISHED for s in seqs), bool, len(seqs))
        counts = np.where(live, num_accepted + 1, 0)
        for seq, st, ok in zip(seqs, states, live):
            if ok:  # entries 0 .. len - 2 (the newest token is the next step's root input)
                d.kv_cache.ensure(st, len(seq) - 1)  # type: ignore[arg-type]
        self.blocks.sync([(s.seq_id, st.block_table)  # type: ignore[union-attr]
                          for s, st in zip(seqs, states)])
        self.counts[: len(seqs)].copy_(to_device(counts, d.device))
        self.counts[len(seqs): shape.num_rows] = 0
        roots = self.graphs.run_graph(("observe", *shape.key), shape.num_rows,
                                      lambda: self._observe(shape, out))
        # A later replay overwrites the pass's outputs: keep a copy, one view per row.
        roots = roots[: len(seqs)].clone().unbind(0)
        for seq, st, root, ok in zip(seqs, states, roots, live):
            if ok:
                st.num_cached = len(seq) - 1  # type: ignore[union-attr]
                st.hidden = root  # type: ignore[union-attr]
        return True

    @torch.inference_mode()
    def _observe(self, shape: VerifyShape, out: VerifyOutput) -> Tensor:
        d, st = self.drafter, self.state
        rows, n = shape.num_rows, shape.num_tokens
        start = st.ints[CTX, :rows]
        counts = self.counts[:rows]
        j = torch.arange(n, device=start.device)
        pos = start[:, None] + j[None, :]  # [rows, N]: the accepted path is a chain
        sampled = out.sampled
        fed_rows = (torch.arange(rows, device=start.device)[:, None] * n
                    + sampled.row_ids.clamp_min(0).long())  # target row of accepted j
        feats = d.features(ForwardOutput(out.hidden, out.aux_hidden, []), fed_rows.reshape(-1))
        table = self.blocks.table[:rows]
        bs = d.kv_cache.block_size
        slots = slots_of(table, pos, j[None, :] < counts[:, None], bs)
        meta = AttentionMetadata(slot_mapping=slots.reshape(-1), block_tables=table,
                                 context_lens=start.to(torch.int32),
                                 qo_indptr=self.qo_indptr(rows, n), max_q_len=n)
        tokens = sampled.output_ids.clamp_min(0).reshape(-1)
        g, _ = d.module(tokens, feats, pos.reshape(-1), d.kv_cache.kv, meta, d.runner.backend)
        last = (counts - 1).clamp_min(0)  # the last entry written: the next root
        return g.view(rows, n, -1)[torch.arange(rows, device=g.device), last]
