"""Hidden-state-conditioned draft layers with their own one-layer paged KV cache (MTP, EAGLE-3).

Both read, for the entry at position ``i``, features of the target at position ``i`` and the
next token ``x_{i+1}`` (rope position ``i``); the entry's output hidden ``g_i`` gives logits
for ``x_{i+2}``, and drafting feeds ``g_i`` back in place of the target's features of
position ``i + 1``. Entries written with a drafted hidden are overwritten with the target's
features once the target has verified the position. Subclasses give the module (``forward``
/ ``compute_logits``) and :meth:`FeatureDrafter.features` (which target features it reads).

KV bookkeeping per sequence: slots ``0 .. num_cached-1`` hold the entries of positions
``0 .. num_cached-1``, written from the target's features (``num_cached = len(seq) - 1``
after each ``observe``); ``hidden`` is ``g`` of the last one, the root of the next proposal.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from specengine.core.kv_cache import KVCache
from specengine.core.model_runner import ModelRunner
from specengine.core.sequence import SeqStatus, Sequence
from specengine.core.step_types import DraftProposal, ForwardOutput
from specengine.core.transfer import to_device
from specengine.drafters.base import Drafter
from specengine.drafters.drafting import (
    draft_kv_cache,
    expand_tree,
    run_chain,
    samples_drafts,
    tree_chooser,
    tree_level_mask,
    tree_proposal,
)
from specengine.model.attention import make_attention_backend
from specengine.tree import DraftTree

if TYPE_CHECKING:
    from specengine.core.graphs import GraphRunner
    from specengine.core.step_types import VerifyOutput, VerifyShape
    from specengine.drafters.adapt import FeatureBuffer
    from specengine.drafters.context import DraftContext
    from specengine.drafters.draft_prefix import DraftPrefix
    from specengine.drafters.static_chain import StaticFeatureChain

logger = logging.getLogger(__name__)


@dataclass
class FeatureState:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # entries 0..num_cached-1 were written with the target's features
    hidden: Tensor | None = None  # g at position num_cached - 1
    # Entries 0..num_valid-1 were all written from the target's features (num_cached can
    # jump past a skipped stretch); the prefix cache's epoch when the state started.
    num_valid: int = 0
    epoch: int = -1


class FeatureDrafter(Drafter):
    """Shared state / observe / propose / tree logic. ``module(input_ids, hidden, positions,
    kv_cache, meta, backend)`` returns ``(g [T, H], [])``; ``module.compute_logits(g)`` returns
    float32 logits over the target vocabulary (``-inf`` where the drafter cannot propose)."""

    module: nn.Module

    def __init__(self, ctx: DraftContext, module: nn.Module, num_kv_heads: int, head_dim: int,
                 *, sample: bool = False) -> None:
        cfg = ctx.config
        self.sample = bool(sample)
        self.point_mass = not self.sample
        self.device = ctx.device
        self.module = module.eval().requires_grad_(False)
        self.kv_cache = draft_kv_cache(ctx, 1, num_kv_heads, head_dim)
        self.runner = ModelRunner(self.module, self.kv_cache,  # type: ignore[arg-type]
                                  make_attention_backend(cfg.kernel_backend), self.device)
        self._states: dict[int, FeatureState] = {}
        self._static: StaticFeatureChain | None = None
        self.max_model_len = cfg.max_model_len
        # True once bound to the static path: entries use the target's block tables (the
        # sequences' own), roots live in ``_static.root`` by arena slot; no own allocation.
        self.shared_tables = False
        # Online adaptation (drafters/adapt.py): when set, every catch-up pass also copies its
        # entries (features, fed tokens) into this ring on the device. None: nothing is kept.
        self.capture: FeatureBuffer | None = None
        # Prefix caching (drafters.draft_prefix): the names of this drafter's own blocks
        # (eager path), and the target cache whose named blocks must serve it.
        self.prefix: DraftPrefix | None = None
        self._target_kv: KVCache | None = None

    def bind_static(self, graphs: GraphRunner) -> None:
        """Chains then run as ``StaticFeatureChain`` (one CUDA graph per bucket and k); the
        verify pass reads sampled chains' distributions in the draft vocabulary, if any."""
        if self.draft_vocab is not None:
            graphs.verifier.set_draft_vocab(self.draft_vocab.to_draft, self.draft_vocab.size)
        if graphs.static:
            from specengine.drafters.static_chain import StaticFeatureChain

            self._static = StaticFeatureChain(self, graphs)

    def share_block_tables(self, num_blocks: int) -> None:
        """Use the target's block tables from now on; the cache gets ``num_blocks`` blocks
        (the target's count) if it has fewer. Called before any sequence is observed."""
        if self.kv_cache.num_blocks < num_blocks:
            kv = self.kv_cache.kv
            self.kv_cache = KVCache(num_blocks, self.kv_cache.block_size, kv.shape[1],
                                    kv.shape[4], kv.shape[5], kv.dtype, kv.device)
            self.runner.kv_cache = self.kv_cache
        self.shared_tables = True

    def bind_prefix_cache(self, kv_cache: KVCache) -> None:
        """The target cache names blocks: make them serve this drafter too (called after
        :meth:`bind_static`; ``drafters.draft_prefix``). Blocks are named with their next
        token (an entry reads it). On the static path the entries live in the target's blocks,
        named only after a prefill the drafter caught up on; eagerly the drafter's own blocks
        get the same names and a target hit is cut to the blocks both hold. With a rollout
        buffer for online adaptation, hits are refused: adaptation trains on sequences from
        position 0, whose features a hit would skip."""
        if kv_cache.prefix is None:
            return
        self._target_kv = kv_cache
        if self.capture is not None:
            logger.info("prefix cache hits are off: the %s drafter keeps a rollout buffer for "
                        "online adaptation, which needs the target's features of every prompt "
                        "position (GRPO groups still share prompt KV)", type(self).__name__)
            kv_cache.follow_drafter(name_next_token=True, names_need_draft=True,
                                    draft_hits=lambda names: 0)
        elif self.shared_tables:
            kv_cache.follow_drafter(name_next_token=True, names_need_draft=True,
                                    draft_hits=None)
        else:
            from specengine.drafters.draft_prefix import DraftPrefix

            self.prefix = DraftPrefix(self.kv_cache, next_token=True)
            kv_cache.follow_drafter(name_next_token=True, names_need_draft=False,
                                    draft_hits=self.prefix.num_hits)

    def clear_prefix_cache(self) -> None:
        if self.prefix is not None:
            self.prefix.clear()

    def draft_weights_changed(self) -> None:
        """The head changed in place outside a weight update (online adaptation): no cached
        block, the drafter's own or a target block holding its entries, may be reused."""
        self.clear_prefix_cache()
        if self._target_kv is not None:
            self._target_kv.invalidate_prefix_cache()

    def chain_logits(self, hidden: Tensor) -> Tensor:
        """float32 logits a chain's draft is chosen from: over ``draft_vocab`` when the
        drafter has one (its columns), else ``module.compute_logits`` (the target's)."""
        return self.module.compute_logits(hidden)

    @abstractmethod
    def features(self, target: ForwardOutput, rows: Tensor) -> Tensor:
        """The target features the module reads for the fed ``rows`` of a target pass."""

    def drop_states(self) -> None:
        """Forget every sequence's entries (after a weight update they are stale): the next
        ``observe`` of a sequence rewrites them from the target's features it gets then."""
        if self.shared_tables:
            self._static.drop_roots()  # type: ignore[union-attr]
        for st in self._states.values():
            self.kv_cache.free(st)  # type: ignore[arg-type]
        self._states.clear()

    @property
    def num_states(self) -> int:
        """Sequences the drafter holds state for (a root and cache entries)."""
        if self.shared_tables:
            return self._static.num_roots  # type: ignore[union-attr]
        return len(self._states)

    def release(self, seq: Sequence) -> None:
        if self.shared_tables:
            self._static.release(seq.seq_id)  # type: ignore[union-attr]
        st = self._states.pop(seq.seq_id, None)
        if self.capture is not None:
            self.capture.forget(seq.seq_id)
        if st is None:
            return
        if self.prefix is not None and st.epoch == self.prefix.cache.epoch:
            # Name the blocks of entries written from the target's features, generated
            # positions included (a conversation's next turn reuses them). The entries of the
            # finishing step are not written (observe skips finished sequences) and those of
            # its drafts past them never count; entry p reads token p + 1, which exists
            # since num_valid <= len - 1.
            num_blocks = min(st.num_valid // self.kv_cache.block_size, len(st.block_table))
            self.prefix.register(st.block_table, seq.token_ids, num_blocks)
        self.kv_cache.free(st)  # type: ignore[arg-type]

    @torch.inference_mode()
    def _forward(self, states: list[FeatureState], ctx: list[int], ids: Tensor,
                 hidden: Tensor, positions: list[np.ndarray],
                 tree_mask: Tensor | None = None) -> Tensor:
        """One pass: entry j of sequence b (slot ``ctx[b] + j``, ``len(positions[b])`` entries
        each, back to back) reads its token of ``ids [T]`` (on the device) and its row of
        ``hidden``; returns the output hidden states ``g [T, H]``."""
        q_lens = [len(p) for p in positions]
        slots = [c + np.arange(n, dtype=np.int64) for c, n in zip(ctx, q_lens)]
        meta = self.runner.metadata(states, ctx, q_lens, slots, tree_mask)  # type: ignore
        pos = to_device(np.concatenate(positions), self.device)
        out, _ = self.module(ids, hidden, pos, self.kv_cache.kv, meta, self.runner.backend)
        return out

    def observe_step(self, seqs: tuple[Sequence, ...], out: VerifyOutput, shape: VerifyShape,
                     num_accepted: np.ndarray) -> bool:
        if self._static is None:
            return False
        if not self._static.observe(seqs, out, shape, num_accepted):
            return False
        if self.capture is not None:
            from specengine.drafters.adapt import capture_static

            st = self._static.state
            live = ~st.arena.done[st.row_slots[: len(seqs)]]  # type: ignore[union-attr]
            capture_static(self.capture, self, seqs, out, shape, num_accepted, live)
        return True

    def observe(self, seqs: tuple[Sequence, ...], target: ForwardOutput,
                accepted_rows: list[list[int]]) -> None:
        """Write the entries of the positions the target just verified (its features of the
        accepted rows, each with the token that followed)."""
        live = [b for b, s in enumerate(seqs) if s.status is not SeqStatus.FINISHED]
        if self.capture is not None and len(live) < len(seqs):
            from specengine.drafters.adapt import capture_finished

            capture_finished(self.capture, self, seqs, target, accepted_rows)
        if not live:
            return
        shared = self.shared_tables
        # A sequence new to the drafter whose prefill reused a cached prefix (its first fed
        # row is past 0) takes the drafter's blocks of that prefix first, for every sequence
        # before any allocation (which could evict one); its blocks are named after the pass.
        fresh = [] if shared else self._start_states(seqs, live, accepted_rows)
        states, ctx, tokens, positions, rows = [], [], [], [], []
        intact: list[bool] = []
        for b in live:
            seq, acc = seqs[b], accepted_rows[b]
            start = len(seq) - len(acc) - 1  # position of the first accepted row
            if shared:  # entries go where the target's tokens are
                states.append(seq)
            else:
                st = self._states[seq.seq_id]
                if st.num_cached < start:
                    logger.debug("%s: seq %d misses entries %d..%d", type(self).__name__,
                                 seq.seq_id, st.num_cached, start)
                intact.append(st.num_valid >= start)  # no stretch skipped before start
                self.kv_cache.ensure(st, len(seq) - 1)  # type: ignore[arg-type]
                states.append(st)
            ctx.append(start)
            tokens.append(seq.token_slice(start + 1))
            positions.append(np.arange(start, len(seq) - 1, dtype=np.int64))
            rows.extend(target.qo_indptr[b] + r for r in acc)
        feats = self.features(target, to_device(np.array(rows, np.int64), target.hidden.device))
        ids = to_device(np.array([t for ts in tokens for t in ts], np.int64), self.device)
        out = self._forward(states, ctx, ids, feats, positions)  # feats: on the engine device
        if self.capture is not None:
            from specengine.drafters.adapt import capture_eager

            capture_eager(self.capture, [seqs[b] for b in live], positions, feats, ids)
        ends = to_device(np.cumsum([len(t) for t in tokens]) - 1, self.device)
        last = out[ends]  # a copy: the states must not keep the whole pass alive
        if shared:
            self._static.set_roots([seqs[b] for b in live], last)  # type: ignore[union-attr]
            return
        for i, (st, b) in enumerate(zip(states, live)):
            st.num_cached = len(seqs[b]) - 1
            st.hidden = last[i]
            if intact[i]:  # entries 0..len-2 all written from the target's features
                st.num_valid = st.num_cached
        for b in fresh:  # entries 0..len-2 written: name the blocks followed by a prompt token
            seq = seqs[b]
            n = len(seq) - 1  # tokens before the one the prefill sampled
            self.prefix.register(self._states[seq.seq_id].block_table,  # type: ignore
                                 seq.token_ids[:n], (n - 1) // self.kv_cache.block_size)

    def _start_states(self, seqs: tuple[Sequence, ...], live: list[int],
                      accepted_rows: list[list[int]]) -> list[int]:
        """Make a state for each of ``live`` that has none; one whose first accepted row is
        past position 0 (a reused prefix) starts with the drafter's named blocks of it.
        Returns the new ones that hold every entry before their first row (named later)."""
        fresh = []
        for b in live:
            seq = seqs[b]
            if seq.seq_id in self._states:
                continue
            st = self._states[seq.seq_id] = FeatureState()
            start = len(seq) - len(accepted_rows[b]) - 1
            if self.prefix is not None:
                st.epoch = self.prefix.cache.epoch
            if start > 0 and self.prefix is not None:
                st.block_table = self.prefix.take(seq.token_ids, start)
                st.num_cached = st.num_valid = len(st.block_table) * self.kv_cache.block_size
            if self.prefix is not None and st.num_cached == start:
                fresh.append(b)
        return fresh

    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                tree: DraftTree | None) -> DraftProposal:
        if (not self._static.has_roots(len(seqs)) if self.shared_tables  # type: ignore
                else any(s.seq_id not in self._states for s, n in zip(seqs, num_drafts) if n > 0)):
            # A draft update between steps dropped the states: no drafts this step (a plain
            # decode step); the observe after it starts the states again.
            return DraftProposal(torch.zeros(len(seqs), max(num_drafts), dtype=torch.int64,
                                             device=self.device),
                                 np.zeros(len(seqs), dtype=np.int64), None)
        if tree is None and self._static is not None:
            return self._static.propose(seqs, num_drafts)
        if self.shared_tables:  # a tree on the static path: every row drafts the whole tree
            return self._static.propose_tree(seqs, num_drafts, tree)  # type: ignore
        counts = np.asarray(num_drafts, dtype=np.int64)
        rows = [b for b, n in enumerate(num_drafts) if n > 0]
        for b in rows:  # the last proposals' entries sit after num_cached; room for k - 1 more
            st = self._states[seqs[b].seq_id]
            self.kv_cache.ensure(st, st.num_cached + num_drafts[b])  # type: ignore[arg-type]
        hidden = torch.stack([self._states[seqs[b].seq_id].hidden for b in rows])  # type: ignore
        if tree is not None:
            return self._propose_tree(seqs, tree, hidden, counts)
        logits = self.chain_logits(hidden)

        def advance(keep: list[int], rows: list[int], fed: Tensor, j: int) -> Tensor:
            nonlocal hidden  # entry at position len - 2 + j: (g of the previous one, draft j-1)
            pos = [len(seqs[b]) - 2 + j for b in rows]
            hidden = self._forward([self._states[seqs[b].seq_id] for b in rows], pos,
                                   fed, hidden[keep],
                                   [np.array([p], dtype=np.int64) for p in pos])
            return self.chain_logits(hidden)

        vocab = self.draft_vocab
        ids, probs = run_chain(seqs, num_drafts, logits, advance, self.sample, self.device,
                               None if vocab is None else vocab.to_target)
        return DraftProposal(ids, counts, probs)

    def _propose_tree(self, seqs: tuple[Sequence, ...], tree: DraftTree, root_hidden: Tensor,
                      counts: np.ndarray) -> DraftProposal:
        """Level by level: each pass feeds the entries of the nodes down to depth d (ancestor
        mask; entry of node i reads its parent's g and its own token). With
        ``sample`` on and a sampled request in the batch, children are drawn from the
        head's ``q`` (over its draft vocabulary) and the proposal carries each node's ``q``."""
        states = [self._states[s.seq_id] for s in seqs]  # (the static path: static_chain)
        choose = None
        logits_of = self.module.compute_logits
        if samples_drafts(self.sample, list(seqs)):
            logits_of = self.chain_logits  # over the draft vocabulary when there is one
            vocab = self.draft_vocab
            choose = tree_chooser(seqs, tree.max_rank + 1, self.device,
                                  None if vocab is None else vocab.to_target)
        batch = len(seqs)
        ctx = [len(s) - 1 for s in seqs]
        g = {0: root_hidden}

        def run_level(n: int, node_ids: Tensor) -> Tensor:
            parent_g = torch.stack([g[int(tree.parents[i])] for i in range(1, n)], dim=1)
            positions = [c - 1 + tree.depths[1:n].astype(np.int64) for c in ctx]
            out = self._forward(states, ctx, node_ids.reshape(-1),
                                parent_g.reshape(batch * (n - 1), parent_g.shape[-1]), positions,
                                tree_level_mask(tree, n, batch, self.device))
            out = out.view(batch, n - 1, -1)
            g.update({i: out[:, i - 1] for i in range(1, n)})
            return out

        nodes, probs = expand_tree(tree, logits_of(root_hidden), run_level, logits_of,
                                   choose=choose)
        return tree_proposal(nodes, probs, counts)
