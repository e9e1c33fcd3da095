"""Small-LM drafter: a second model with the target's vocabulary, run autoregressively on its
own paged KV cache (docs/design.md §7).

KV bookkeeping per sequence: positions ``0 .. num_cached-1`` of the draft cache hold the K/V
of ``seq.token_ids[:num_cached]``; ``pending`` are the draft tokens fed speculatively right
after them. ``observe`` keeps the pending tokens the target accepted (the K/V the draft wrote
for them is exactly what it would write now) and drops the rest; ``propose`` first feeds the
tokens the draft has not seen (the newest token, and at most one accepted draft more), so the
cache is rewritten from the first divergence on.

A sequence running in the engine's arena keeps that state in its slot's row of ``LMSlots``
(arrays, so the static path's step visits no sequence in Python); one outside an arena keeps a
``_State`` object. The eager passes see both through the same attributes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

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
from specengine.drafters.lm_slots import LMSlots, SlotState
from specengine.model.attention import make_attention_backend
from specengine.model.config import ModelConfig
from specengine.tree import DraftTree

if TYPE_CHECKING:
    from specengine.core.graphs import GraphRunner
    from specengine.core.kv_cache import KVCache
    from specengine.core.seq_arena import SeqArena
    from specengine.core.step_types import VerifyOutput, VerifyShape
    from specengine.drafters.context import DraftContext
    from specengine.drafters.draft_prefix import DraftPrefix
    from specengine.drafters.static_lm_chain import StaticLMChain

logger = logging.getLogger(__name__)


@dataclass
class _State:
    """Draft-cache state of a sequence outside an arena."""

    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    num_pending: int = 0  # drafts fed after num_cached (their K/V is in the draft cache)


_AnyState = _State | SlotState


class DraftModelDrafter(Drafter):
    """A small causal LM with the target's vocabulary proposes drafts autoregressively.

    ``sample=False`` (default): greedy point-mass drafts (``probs`` None). ``sample=True``:
    chain drafts are drawn from the request's temperature / top-k / top-p distribution on the
    drafter's own seeded stream and ``probs`` holds those distributions (a chain of greedy
    requests only is the argmax chain, ``probs`` None: ``drafting.samples_drafts``; a greedy
    row next to sampled ones gets one-hot rows). Trees: with ``sample`` on and a sampled
    request in the batch, each node's children are drawn from that distribution without
    replacement and ``probs`` holds each node's (its parent's, ``drafting.sample_children``:
    the verify pass judges them by recursive rejection sampling); else each node's rank-r
    most likely child (point masses). ``module`` is the draft ``CausalLM``
    (checkpoint names); :meth:`load_weights` updates it in place.
    """

    def __init__(self, path: str | Path, ctx: DraftContext, *, sample: bool = False) -> None:
        from specengine.model.loader import build_model

        cfg, target = ctx.config, ctx.model_config
        dcfg = ModelConfig.from_dir(path)
        if dcfg.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {path} has vocab_size {dcfg.vocab_size} but the target "
                             f"has {target.vocab_size}: a draft LM needs the target's vocabulary")
        _check_tokenizers(Path(path), Path(cfg.model))
        if dcfg.max_position_embeddings < cfg.max_model_len:
            logger.warning("draft max_position_embeddings %d < max_model_len %d",
                           dcfg.max_position_embeddings, cfg.max_model_len)
        self.sample = bool(sample)
        self.point_mass = not self.sample
        self.device = ctx.device
        self.module = build_model(path, cfg.torch_dtype, self.device)
        self.kv_cache = draft_kv_cache(ctx, dcfg.num_layers, dcfg.num_kv_heads, dcfg.head_dim)
        self.runner = ModelRunner(self.module, self.kv_cache,
                                  make_attention_backend(cfg.kernel_backend), self.device)
        self._detached: dict[int, _State] = {}  # seq_id -> state, sequences outside an arena
        self.slots: LMSlots | None = None  # running sequences' states by arena slot
        self._static: StaticLMChain | None = None
        self.prefix: DraftPrefix | None = None  # names of its cached blocks (prefix caching)
        # seq_id -> the draft prefix cache's epoch when the sequence's state started: its
        # blocks are named at release only if no weight update came since
        self._epoch_of: dict[int, int] = {}

    def bind_prefix_cache(self, kv_cache: KVCache) -> None:
        """Name the draft cache's full blocks like the target's (its KV depends on the tokens
        only): a new sequence's prompt pass starts after the draft's own longest cached
        prefix (``drafters.draft_prefix``)."""
        if kv_cache.prefix is not None:
            from specengine.drafters.draft_prefix import DraftPrefix

            self.prefix = DraftPrefix(self.kv_cache, next_token=False)

    def clear_prefix_cache(self) -> None:
        if self.prefix is not None:
            self.prefix.clear()

    def bind_static(self, graphs: GraphRunner) -> None:
        """Chains then run as ``StaticLMChain`` (catch-up + k steps, one graph)."""
        if graphs.static:
            from specengine.drafters.static_lm_chain import StaticLMChain

            self._static = StaticLMChain(self, graphs)

    # ---------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: object) -> list[str]:
        """In-place update of (a subset of) the draft's weights, by checkpoint name; the draft
        KV of live sequences is recomputed from scratch at their next proposal."""
        from specengine.model.loader import load_named_tensors, tied_names

        names = load_named_tensors(self.module, named_tensors,  # type: ignore[arg-type]
                                   strict=False, tied=tied_names(self.module))
        for st in self._detached.values():
            st.num_cached, st.num_pending = 0, 0
        if self.slots is not None:
            self.slots.drop_caches()
        return names

    def release(self, seq: Sequence) -> None:
        epoch = self._epoch_of.pop(seq.seq_id, None)
        name = self.prefix is not None and epoch == self.prefix.cache.epoch
        st = self._detached.pop(seq.seq_id, None)
        if st is not None:
            if name:
                self._name_blocks(seq, st.block_table, st.num_cached)
            self.kv_cache.free(st)  # type: ignore[arg-type]
        if self.slots is not None:  # (the sequence has already left its slot)
            if name:
                for r in np.flatnonzero(self.slots.owner == seq.seq_id).tolist():
                    self._name_blocks(seq, self.slots.blocks_of(r),
                                      int(self.slots.num_cached[r]))
            self.slots.release(seq.seq_id)

    def _name_blocks(self, seq: Sequence, table: list[int], num_cached: int) -> None:
        """Name the full blocks of a released sequence's K/V of its first ``num_cached``
        tokens, generated ones included (a conversation's next turn reuses them). Pending
        drafts and the newest tokens are past ``num_cached``; a stop token inside the
        accepted drafts can end the sequence before it, hence the cut at its length."""
        num_blocks = min(min(num_cached, len(seq)) // self.kv_cache.block_size, len(table))
        self.prefix.register(table, seq.token_ids, num_blocks)  # type: ignore[union-attr]

    @property
    def num_states(self) -> int:
        """Sequences the drafter holds draft-cache state for."""
        return len(self._detached) + (self.slots.num_held if self.slots is not None else 0)

    @property
    def _states(self) -> dict[int, _AnyState]:
        """Every held state by sequence id (a fresh dict: for accounting and tests)."""
        states: dict[int, _AnyState] = dict(self._detached)
        if self.slots is not None:
            for s in self.slots.held_slots().tolist():
                states[int(self.slots.owner[s])] = SlotState(self.slots, s)
        return states

    def observe_step(self, seqs: tuple[Sequence, ...], out: VerifyOutput, shape: VerifyShape,
                     num_accepted: np.ndarray) -> bool:
        """The static path: every row's counters from ``num_accepted`` in one array update
        (False, and the step calls :meth:`observe`, when a row has no state to update)."""
        if self._static is None:
            return False
        return self._static.observe(len(seqs), num_accepted)

    def observe(self, seqs: tuple[Sequence, ...], target: ForwardOutput,
                accepted_rows: list[list[int]]) -> None:
        """Keep the accepted speculative K/V; prefill the draft on new sequences' prompts."""
        new = []
        for seq, acc in zip(seqs, accepted_rows):
            st = self._find(seq)
            if st is None:
                if seq.status is not SeqStatus.FINISHED:
                    new.append(seq)
                continue
            # The pending drafts are the chain's drafts 0 .. num_pending-1. The target kept the
            # first len(acc) - 1 of this step's drafts and never re-emits a rejected draft at
            # its position (its residual gives that token probability 0), so exactly
            # min(num_pending, len(acc) - 1) pending entries hold the sequence's tokens.
            st.num_cached += min(st.num_pending, len(acc) - 1)
            st.num_pending = 0
        if new:
            states = [self._state(s) for s in new]
            if self.prefix is not None:  # every cached prefix taken before any allocation
                for seq, st in zip(new, states):  # (the catch-up feeds at least one token)
                    self._adopt(st, self.prefix.take(seq.token_ids, len(seq) - 2))
            self._catch_up(new, states, upto_last=False)
            if self.prefix is not None:  # K/V of every token but the newest is written
                for seq, st in zip(new, states):
                    self._epoch_of[seq.seq_id] = self.prefix.cache.epoch
                    n = len(seq) - 1
                    self.prefix.register(st.block_table, seq.token_ids[:n],
                                         n // self.kv_cache.block_size)

    # ---------------------------------------------------------------------------------------
    def slots_for(self, arena: SeqArena) -> LMSlots:
        """The state rows of ``arena``'s slots (made at the first running sequence)."""
        if self.slots is None:
            self.slots = LMSlots(arena.capacity, self.kv_cache)
        elif self.slots.capacity != arena.capacity:
            raise ValueError(f"the draft model follows an arena of {self.slots.capacity} "
                             f"slots, not one of {arena.capacity}: one drafter per engine")
        return self.slots

    def _state(self, seq: Sequence) -> _AnyState:
        """``seq``'s state, started empty if it has none."""
        a = seq.arena
        if a is None:
            return self._detached.setdefault(seq.seq_id, _State())
        rows, slot = self.slots_for(a), np.array([seq.slot], dtype=np.int64)
        rows.claim(slot, np.array([seq.seq_id], dtype=np.int64), a.epoch[slot])
        return SlotState(rows, seq.slot)

    def _find(self, seq: Sequence) -> _AnyState | None:
        """``seq``'s state, or None if it has none."""
        a, rows = seq.arena, self.slots
        if a is None:
            return self._detached.get(seq.seq_id)
        s = seq.slot
        if rows is None or rows.owner[s] != seq.seq_id or rows.epoch[s] != a.epoch[s]:
            return None
        return SlotState(rows, s)

    def _adopt(self, st: _AnyState, blocks: list[int]) -> None:
        """Start the empty ``st`` with ``blocks`` holding the K/V of its first tokens."""
        if not blocks:
            return
        if isinstance(st, SlotState):
            st.rows.adopt(st.slot, blocks)
        else:
            st.block_table = list(blocks)
        st.num_cached = len(blocks) * self.kv_cache.block_size

    def _ensure(self, st: _AnyState, num_tokens: int) -> None:
        """Grow ``st``'s table to hold ``num_tokens`` tokens."""
        if isinstance(st, SlotState):
            st.rows.grow(np.array([st.slot], dtype=np.int64),
                         np.array([num_tokens], dtype=np.int64))
        else:
            self.kv_cache.ensure(st, num_tokens)  # type: ignore[arg-type]

    @torch.inference_mode()
    def _forward(self, states: list[_AnyState], ctx: list[int], ids: Tensor,
                 positions: list[np.ndarray], tree_mask: Tensor | None = None) -> Tensor:
        """One draft pass; sequence b feeds its ``len(positions[b])`` tokens of ``ids [T]``
        (on the device, back to back) into slots ``ctx[b]..`` at ``positions[b]``. Returns the
        final hidden states ``[T, H]``."""
        q_lens = [len(p) for p in positions]
        slots = [c + np.arange(n, dtype=np.int64) for c, n in zip(ctx, q_lens)]
        meta = self.runner.metadata(states, ctx, q_lens, slots, tree_mask)  # type: ignore
        pos = to_device(np.concatenate(positions), self.device)
        hidden, _ = self.module(ids, pos, self.kv_cache.kv, meta, self.runner.backend)
        return hidden

    def _catch_up(self, seqs: list[Sequence], states: list[_AnyState], upto_last: bool,
                  extra: list[int] | None = None) -> Tensor:
        """Feed every token the draft has not cached (all but the newest unless ``upto_last``),
        reserving ``extra[b]`` more slots; returns the logits after each last fed token."""
        ctx, tokens, positions = [], [], []
        for b, (seq, st) in enumerate(zip(seqs, states)):
            end = len(seq) if upto_last else len(seq) - 1
            start = min(st.num_cached, end - 1)
            self._ensure(st, end + (extra[b] if extra else 0))
            ctx.append(start)
            tokens.append(seq.token_ids[start:end])
            positions.append(np.arange(start, end, dtype=np.int64))
            st.num_cached, st.num_pending = end, 0
        ids = to_device(np.array([t for ts in tokens for t in ts], np.int64), self.device)
        hidden = self._forward(states, ctx, ids, positions)
        last = to_device(np.cumsum([len(t) for t in tokens]) - 1, self.device)
        return self.module.compute_logits(hidden[last])

    # ---------------------------------------------------------------------------------------
    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                tree: DraftTree | None) -> DraftProposal:
        counts = np.asarray(num_drafts, dtype=np.int64)
        if tree is not None:
            return tree_proposal(*self._propose_tree(seqs, tree), counts)
        if self._static is not None:
            proposal = self._static.propose(seqs, counts)
            if proposal is not None:
                return proposal
        active = [b for b, n in enumerate(num_drafts) if n > 0]
        act_seqs = [seqs[b] for b in active]
        logits = self._catch_up(act_seqs, [self._state(s) for s in act_seqs], upto_last=True,
                                extra=[num_drafts[b] - 1 for b in active])

        def advance(keep: list[int], rows: list[int], fed: Tensor, j: int) -> Tensor:
            pos = [len(seqs[b]) - 1 + j for b in rows]  # feed draft j - 1
            hidden = self._forward([self._state(seqs[b]) for b in rows], pos,
                                   fed, [np.array([p], dtype=np.int64) for p in pos])
            return self.module.compute_logits(hidden)

        ids, probs = run_chain(seqs, num_drafts, logits, advance, self.sample, self.device)
        for b in active:  # drafts 0 .. k-2 were fed; their tokens stay on the device
            self._state(seqs[b]).num_pending = num_drafts[b] - 1
        return DraftProposal(ids, counts, probs)

    def _propose_tree(self, seqs: tuple[Sequence, ...], tree: DraftTree
                      ) -> tuple[Tensor, Tensor | None]:
        """Level by level: each pass feeds the tree's nodes down to depth d (root in the
        context, ancestor mask) and ranks (or, sampling, draws) the children of the depth-d
        nodes: the node tokens ``[B, N-1]`` and each node's ``q`` or None."""
        states = [self._state(s) for s in seqs]
        root_logits = self._catch_up(list(seqs), states, upto_last=True,
                                     extra=[tree.num_nodes - 1] * len(seqs))
        ctx = [len(s) for s in seqs]

        def run_level(n: int, node_ids: Tensor) -> Tensor:
            positions = [c - 1 + tree.depths[1:n].astype(np.int64) for c in ctx]
            hidden = self._forward(states, ctx, node_ids.reshape(-1), positions,
                                   tree_level_mask(tree, n, len(seqs), self.device))
            return hidden.view(len(seqs), n - 1, -1)

        choose = tree_chooser(seqs, tree.max_rank + 1, self.device) \
            if samples_drafts(self.sample, list(seqs)) else None
        node_ids, probs = expand_tree(tree, root_logits, run_level, self.module.compute_logits,
                                      choose=choose)
        for st, c in zip(states, ctx):
            st.num_cached, st.num_pending = c, 0  # tree slots are not linear positions
        return node_ids, probs


def _check_tokenizers(draft: Path, target: Path) -> None:
    """Both dirs have a tokenizer.json → their vocabularies must agree."""
    files = [p / "tokenizer.json" for p in (draft, target)]
    if not all(f.is_file() for f in files):
        return
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return
    vocabs = [Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True) for f in files]
    if vocabs[0] != vocabs[1]:
        diff = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()))[:3]
        raise ValueError(f"draft tokenizer {files[0]} differs from the target's ({diff} ...): "
                         "a draft LM needs the target's vocabulary")
