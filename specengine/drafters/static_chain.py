"""The k-step chain loop and the catch-up of a hidden-state drafter (EAGLE-3, MTP) on static
buffers.

Same passes as ``FeatureDrafter``'s eager chain, shaped for a CUDA graph: every row of the
padded batch drafts ``k`` tokens (rows asked for fewer draft extra tokens nobody verifies; rows
past the batch are inactive and write no KV), the inputs are the persistent batch state (the
target's rows: position, seed, sampling parameters, block tables, which the drafter's cache
shares) and a root-hidden buffer indexed by arena slot; the outputs are static
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

from specengine.core.batch import ACTIVE, CTX, SLOT
from specengine.core.block_rows import slots_of
from specengine.core.graphs import GraphRunner, Pass
from specengine.core.sequence import Sequence
from specengine.core.step_types import DraftProposal, ForwardOutput, VerifyOutput, VerifyShape
from specengine.core.transfer import to_device
from specengine.drafters.drafting import expand_tree
from specengine.drafters.static_drafts import StaticDrafts
from specengine.model.attention import AttentionMetadata
from specengine.tree import DraftTree

if TYPE_CHECKING:
    from specengine.drafters.feature_drafter import FeatureDrafter


class StaticFeatureChain(StaticDrafts):
    """Chain proposals of ``drafter`` through ``graphs`` (see the module docstring).

    Bound to the engine's static path, the drafter's one-layer cache shares the target's
    block tables (entry ``p`` of a sequence sits in the slot of the target's token ``p``; the
    draft cache has as many blocks as the target's), so a step allocates nothing for the
    drafter and sends no table of its own. Each sequence's root hidden state lives in row
    ``slot`` of ``root`` (its slot in the arena, ``core.seq_arena``), valid while
    ``root_owner[slot]`` is the sequence's id; the catch-up pass writes the new roots there."""

    def __init__(self, drafter: FeatureDrafter, graphs: GraphRunner) -> None:
        super().__init__(graphs, drafter.device)
        self.drafter = drafter
        drafter.share_block_tables(graphs.verifier.runner.kv_cache.num_blocks)
        cap = self.state.capacity  # arena slots are < max_batch_size <= capacity
        self.root: Tensor | None = None  # [capacity + 1, H]; the last row takes padded rows
        self.root_owner = np.full(cap + 1, -1, dtype=np.int64)
        self._roots_version = 0  # bumped whenever root_owner changes
        self._has_roots: tuple[int, int, int, bool] = (-1, -1, -1, False)  # has_roots cache

    # ---- roots by slot ---------------------------------------------------------------------
    def set_roots(self, seqs: list[Sequence], hidden: Tensor) -> None:
        """Roots of attached ``seqs`` (``hidden [len(seqs), H]``), e.g. after a prefill."""
        self._ensure_root(hidden.shape[-1], hidden.dtype)
        slots = np.fromiter((s.slot for s in seqs), np.int64, len(seqs))
        self.root[to_device(slots, self._device)] = hidden
        self.root_owner[slots] = [s.seq_id for s in seqs]
        self._roots_version += 1

    def _ensure_root(self, size: int, dtype: torch.dtype) -> Tensor:
        """``root``, made once: captured passes read it, so it is never replaced."""
        if self.root is None:
            self.root = torch.zeros(self.state.capacity + 1, size, dtype=dtype,
                                    device=self._device)
        return self.root

    def has_roots(self, num_rows: int) -> bool:
        """Whether batch rows ``0 .. num_rows-1`` (arranged) all have a root."""
        st = self.state
        key = (st.generation, self._roots_version, num_rows)
        if self._has_roots[:3] == key:  # rows and roots unchanged since the last answer
            return self._has_roots[3]
        ok = bool((self.root_owner[st.row_slots[:num_rows]] == st.row_seq_ids[:num_rows]).all())
        self._has_roots = (*key, ok)
        return ok

    def drop_roots(self) -> None:
        self.root_owner[:] = -1
        self._roots_version += 1

    def release(self, seq_id: int) -> None:
        """Forget the root of ``seq_id`` (finished, aborted or preempted; it may already have
        left its slot)."""
        self.root_owner[self.root_owner == seq_id] = -1
        self._roots_version += 1

    @property
    def num_roots(self) -> int:
        return int((self.root_owner >= 0).sum())

    def _slot_rows(self, rows: int) -> Tensor:
        """Each padded row's row of ``root`` (padded rows share the spare last one)."""
        slot = self.state.ints[SLOT, :rows]
        return torch.where(slot < 0, self.state.capacity, slot)

    # ---- the passes --------------------------------------------------------------------------
    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int]) -> DraftProposal:
        """``seqs`` in batch-row order (the step arranged them); every row drafts
        ``max(num_drafts)`` tokens, ``num_draft_tokens`` says how many count."""
        k = max(num_drafts)
        rows = self.graphs.padded_rows(len(seqs))
        key, fn = self._draft_pass(rows, k, self.samples_now)
        ids, probs = self.graphs.run_graph(key, rows, fn)
        b = len(seqs)
        if b < rows:  # a batch padded to its bucket: its own rows
            ids, probs = ids[:b], None if probs is None else probs[:b]
        # Greedy drafts are in the verify pass's buffer already; sampled ones bring their
        # distributions, which the step copies into the pass's probs buffer.
        return DraftProposal(ids, np.asarray(num_drafts, dtype=np.int64), probs,
                             as_asked=True, in_place=probs is None)

    def _draft_pass(self, rows: int, k: int, sample: bool) -> Pass:
        return ("draft", rows, k, sample), lambda: self._loop(rows, k, sample)

    def _observe_pass(self, shape: VerifyShape, out: VerifyOutput) -> Pass:
        return shape.graph_keys["observe"], lambda: self._observe(shape, out)

    # ---- capture at start (GraphRunner.capture_startup) -------------------------------------
    def startup_draft(self, rows: int, k: int) -> list[Pass]:
        self._ensure_root(*self._root_layout())  # the passes read it: made before capture
        return [self._draft_pass(rows, k, self.samples)]

    def startup_observe(self, shape: VerifyShape, out: VerifyOutput) -> list[Pass]:
        self._ensure_root(*self._root_layout())
        return [self._observe_pass(shape, out)]

    def _root_layout(self) -> tuple[int, torch.dtype]:
        """A root's width and dtype: the head's output hidden state (the target's width)."""
        param = next(self.drafter.module.parameters())
        return self.graphs.verifier.runner.model.config.hidden_size, param.dtype

    @torch.inference_mode()
    def _loop(self, rows: int, k: int, sample: bool) -> tuple[Tensor, Tensor | None]:
        d, st = self.drafter, self.state
        ints = st.ints[:, :rows]
        base = ints[CTX] - 1  # the root entry's position: len - 2
        active = ints[ACTIVE] > 0
        table = st.block_tables[:rows]
        bs = d.kv_cache.block_size
        indptr = self.qo_indptr(rows, 1)
        hidden = self.root[self._slot_rows(rows)]  # type: ignore[index]
        # Drafts land straight in the verify pass's draft buffer (its load is then a no-op).
        ids = self.graphs.verifier.draft_ids[:rows, :k]
        probs = None
        tokens = ids[:, 0]
        for j in range(k):
            if j > 0:  # entry len - 2 + j: (previous output hidden, draft j - 1)
                pos = base + j
                # A row asked for fewer drafts near the context limit writes no entry past it
                # (the target's table covers min(len + k, max_model_len) positions).
                ok = active & (pos < d.max_model_len)
                slots = slots_of(table, pos[:, None], ok[:, None], bs)[:, 0]
                meta = AttentionMetadata(slot_mapping=slots, block_tables=table,
                                         context_lens=pos.to(torch.int32),
                                         qo_indptr=indptr, max_q_len=1)
                hidden, _ = d.module(tokens, hidden, pos, d.kv_cache.kv, meta,
                                     d.runner.backend)
            tokens, probs = self.choose(d.chain_logits(hidden), sample, j, ids, probs,
                                        None if d.draft_vocab is None else d.draft_vocab.to_target)
        return ids, probs

    def propose_tree(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                     tree: DraftTree) -> DraftProposal:
        """Every row drafts the whole ``tree`` (``seqs`` in batch-row order), in one static
        pass: ``FeatureDrafter._propose_tree`` on the batch state's rows."""
        rows = self.graphs.padded_rows(len(seqs))
        sample = self.samples_now
        ids, probs = self.graphs.run_graph(("draft-tree", rows, tree.paths, sample), rows,
                                           lambda: self._tree(rows, tree, sample))
        b = len(seqs)
        if b < rows:
            ids, probs = ids[:b], None if probs is None else probs[:b]
        return DraftProposal(ids, np.asarray(num_drafts, dtype=np.int64), probs, as_asked=True,
                             in_place=probs is None)

    @torch.inference_mode()
    def _tree(self, rows: int, tree: DraftTree, sample: bool) -> tuple[Tensor, Tensor | None]:
        """Level by level (``drafting.expand_tree``): the pass of depth ``d`` feeds nodes
        ``1 .. n-1`` (every node down to ``d``); node ``i``'s entry sits at position
        ``len - 2 + i`` (after the root's), reads its parent's output hidden and its own
        token, attends to the context and its ancestors (the tree's prefix mask). ``sample``:
        the children are drawn (``FeatureDrafter._propose_tree``) and each node's ``q`` goes
        to the verify pass's probability buffer."""
        d, st = self.drafter, self.state
        ints = st.ints[:, :rows]
        ctx = ints[CTX]  # len - 1: the entries before the tree's (root's included)
        active = ints[ACTIVE] > 0
        table = st.block_tables[:rows]
        bs = d.kv_cache.block_size
        hidden = self.root[self._slot_rows(rows)]  # type: ignore[index]
        g = {0: hidden}

        def run_level(n: int, node_ids: Tensor) -> Tensor:
            parent_g = torch.stack([g[int(p)] for p in tree.parents[1:n]], dim=1)
            j = self.const(np.arange(n - 1, dtype=np.int64))
            entry = ctx[:, None] + j[None, :]  # [rows, n-1]: node j + 1's entry
            depth = self.const(tree.depths[1:n].astype(np.int64))
            pos = (ctx - 1)[:, None] + depth[None, :]  # the root sits at len - 2
            ok = active[:, None] & (entry < d.max_model_len)
            mask = self.const(lambda: np.tile(tree.prefix_masks_host[n], (rows, 1)),
                              ("tree-mask", tree.paths, n, rows))
            meta = AttentionMetadata(
                slot_mapping=slots_of(table, entry, ok, bs).reshape(-1), block_tables=table,
                context_lens=ctx.to(torch.int32), qo_indptr=self.qo_indptr(rows, n - 1),
                max_q_len=n - 1, tree_mask=mask)
            out, _ = d.module(node_ids.reshape(-1), parent_g.reshape(-1, parent_g.shape[-1]),
                              pos.reshape(-1), d.kv_cache.kv, meta, d.runner.backend)
            out = out.view(rows, n - 1, -1)
            g.update({i: out[:, i - 1] for i in range(1, n)})
            return out

        logits_of, choose = d.module.compute_logits, None
        if sample:
            logits_of = d.chain_logits  # over the draft vocabulary when there is one
            choose = self.tree_chooser(rows, tree.max_rank + 1, None if d.draft_vocab is None
                                       else d.draft_vocab.to_target)
        nodes, q = expand_tree(tree, logits_of(hidden), run_level, logits_of, self.const,
                               choose)
        # Straight into the verify pass's draft buffer (its load is then a no-op).
        ids = self.graphs.verifier.draft_ids[:rows, : tree.num_nodes - 1]
        ids.copy_(nodes)
        probs = None
        if q is not None:  # and the distributions into its probability buffer
            probs = self.graphs.verifier.probs_view(rows, tree.num_nodes - 1)
            probs.copy_(q)
        return ids, probs

    def observe(self, seqs: tuple[Sequence, ...], out: VerifyOutput, shape: VerifyShape,
                num_accepted: np.ndarray) -> bool:
        """Catch up after the verify pass ``out`` (``seqs`` in row order, already extended
        by this step's tokens). False (the caller observes eagerly) if a row has no root yet
        (a draft update dropped them)."""
        if not self.has_roots(len(seqs)):
            return False
        key, fn = self._observe_pass(shape, out)
        self.graphs.run_graph(key, shape.num_rows, fn)
        return True

    @torch.inference_mode()
    def _observe(self, shape: VerifyShape, out: VerifyOutput) -> None:
        d, st = self.drafter, self.state
        rows, n = shape.num_rows, shape.num_tokens
        start = st.ints[CTX, :rows]
        # Entries each row writes: its accepted drafts + 1 (padded rows: none). A row that
        # ended this step writes them too; they sit in slots the verify pass already wrote
        # and its root is dropped when it is released.
        counts = torch.where(st.ints[ACTIVE, :rows] > 0,
                             out.sampled.num_accepted[:rows].long() + 1, 0)
        j = torch.arange(n, device=start.device)
        pos = start[:, None] + j[None, :]  # [rows, N]: the accepted path is a chain
        sampled = out.sampled
        fed_rows = (torch.arange(rows, device=start.device)[:, None] * n
                    + sampled.row_ids.clamp_min(0).long())  # target row of accepted j
        feats = d.features(ForwardOutput(out.hidden, out.aux_hidden, []), fed_rows.reshape(-1))
        table = st.block_tables[:rows]
        bs = d.kv_cache.block_size
        slots = slots_of(table, pos, j[None, :] < counts[:, None], bs)
        meta = AttentionMetadata(slot_mapping=slots.reshape(-1), block_tables=table,
                                 context_lens=start.to(torch.int32),
                                 qo_indptr=self.qo_indptr(rows, n), max_q_len=n)
        tokens = sampled.output_ids.clamp_min(0).reshape(-1)
        g, _ = d.module(tokens, feats, pos.reshape(-1), d.kv_cache.kv, meta, d.runner.backend)
        last = (counts - 1).clamp_min(0)  # the last entry written: the next root
        new = g.view(rows, n, -1)[torch.arange(rows, device=g.device), last]
        at = self._slot_rows(rows)
        # Rows that wrote nothing (finished, padded) keep their root.
        self.root[at] = torch.where((counts > 0)[:, None], new, self.root[at])  # type: ignore
