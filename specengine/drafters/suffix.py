"""Group-aware suffix drafter: drafts from the completions already produced for the same
prompt (siblings of a GRPO group while they run, and earlier ``generate`` calls / epochs).

Every sequence is a document ``prompt tail + completion`` in its prompt's depth-bounded
suffix trie (``suffix_index``); running sequences are indexed token by token as their tokens
are accepted (every step, before anything is proposed), finished ones stay indexed across
calls within the token budget (LRU over prompts). A chain draft is the most frequent
continuation of the longest suffix of the sequence that occurred before with a continuation,
extended while the chain's estimated probability (the product of the chosen tokens' shares
among the continuations seen) stays above ``suffix_min_prob``, up to k tokens. Drafts are
point masses, so rejection sampling keeps the policy's distribution exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from specengine.core.model_runner import ForwardOutput
from specengine.core.sequence import SeqStatus, Sequence
from specengine.core.transfer import to_device
from specengine.drafters.base import Drafter, DraftProposal
from specengine.drafters.suffix_index import (
    Chain,
    Doc,
    Node,
    SuffixIndex,
    SuffixStore,
    advance,
    deepest_with_continuation,
)
from specengine.tree import DraftTree


def _tokens(seq: Sequence, start: int, end: int | None = None) -> list[int]:
    """``seq.token_ids[start:end]`` without copying the rest where the sequence can."""
    sliced = getattr(seq, "token_slice", None)  # sequences stored in the engine's arena
    return sliced(start, end) if sliced is not None else seq.token_ids[start:end]


class SuffixDrafter(Drafter):
    """Point-mass drafts from the prompt's earlier and sibling completions.

    Args (``draft_options`` keys):
        suffix_max_tokens: indexed tokens kept over all prompts (documents of running
            sequences are never evicted; finished ones go least recently used prompt first).
        suffix_max_depth: longest context matched (trie depth).
        suffix_min_prob: stop extending a chain once its estimated probability falls below.
        suffix_smoothing: a token's estimated probability is its count over the context's
            continuations + this (a lone observation is less sure than eight that agree).
        suffix_prompt_tokens: how many of the prompt's last tokens start each document (so
            the first tokens of a completion match on the prompt's end too).
    """

    def __init__(self, *, suffix_max_tokens: int = 1 << 18, suffix_max_depth: int = 16,
                 suffix_min_prob: float = 0.1, suffix_smoothing: float = 0.25,
                 suffix_prompt_tokens: int = 8) -> None:
        if not 2 <= suffix_max_depth <= 256:
            raise ValueError(f"suffix_max_depth must be in 2..256, got {suffix_max_depth}")
        if not 0.0 <= suffix_min_prob <= 1.0:
            raise ValueError(f"suffix_min_prob must be in [0, 1], got {suffix_min_prob}")
        if not 0.0 <= suffix_smoothing <= 1e6:
            raise ValueError(f"suffix_smoothing must be in [0, 1e6], got {suffix_smoothing}")
        if suffix_prompt_tokens < 0:
            raise ValueError(f"suffix_prompt_tokens must be >= 0, got {suffix_prompt_tokens}")
        self.store = SuffixStore(suffix_max_depth, suffix_max_tokens)
        self.min_prob = suffix_min_prob
        self.smoothing = suffix_smoothing
        self.prompt_tokens = suffix_prompt_tokens
        #: where proposals go (set by ``make_drafter`` to the engine's device)
        self.device = torch.device("cpu")
        #: per row of the last chain ``propose``: its chain (estimates, match lengths), read
        #: by the hybrid drafter
        self.last_chains: list[Chain | None] = []

    # ---- indexing ------------------------------------------------------------------------
    def _doc(self, seq: Sequence) -> Doc:
        """``seq``'s document, caught up with its tokens (opened on first sight)."""
        store = self.store
        doc = store.by_seq.get(seq.seq_id)
        if doc is None or doc.evicted:
            key = tuple(_tokens(seq, 0, seq.num_prompt_tokens))
            start = max(0, seq.num_prompt_tokens - self.prompt_tokens)
            doc = store.open(seq.seq_id, key, start)
        elif not doc.live:  # a preempted sequence resumes its document
            doc.live = True
        if doc.seq_end < len(seq):
            store.append(doc, _tokens(seq, doc.seq_end))
        return doc

    def catch_up(self, seqs: tuple[Sequence, ...]) -> list[Doc]:
        """Index every sequence's new tokens (all of them first, so each proposal sees its
        siblings' tokens of this very step)."""
        return [self._doc(s) for s in seqs]

    def observe(self, seqs: tuple[Sequence, ...], target: ForwardOutput,
                accepted_rows: list[list[int]]) -> None:
        self.catch_up(seqs)

    def release(self, seq: Sequence) -> None:
        """The sequence left the batch: its last tokens are indexed and its document stays
        (a finished completion serves later epochs; a preempted one resumes it)."""
        doc = self.store.by_seq.get(seq.seq_id)
        if doc is None or doc.evicted:
            return
        if doc.seq_end < len(seq):
            self.store.append(doc, _tokens(seq, doc.seq_end))
        self.store.close(doc, finished=seq.status is SeqStatus.FINISHED)

    # ---- proposals -----------------------------------------------------------------------
    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                tree: DraftTree | None) -> DraftProposal:
        docs = self.catch_up(seqs)
        width = max(num_drafts, default=0)
        ids = np.zeros((len(seqs), width), dtype=np.int64)
        counts = np.zeros(len(seqs), dtype=np.int64)
        chains: list[Chain | None] = [None] * len(seqs)
        for b, (doc, n) in enumerate(zip(docs, num_drafts)):
            if n <= 0:
                continue
            idx = doc.index
            self.store.touch(idx)
            if tree is None:
                chain = chains[b] = idx.continuation(doc.frontier, n, self.min_prob,
                                                     self.smoothing)
                ids[b, : len(chain.tokens)] = chain.tokens
                counts[b] = len(chain.tokens)
            else:
                ids[b, : tree.num_nodes - 1] = self._tree_tokens(idx, doc, tree)
                counts[b] = tree.num_nodes - 1
        self.last_chains = chains
        return DraftProposal(to_device(ids, self.device), counts, None)

    @staticmethod
    def _tree_tokens(idx: SuffixIndex, doc: Doc, tree: DraftTree) -> list[int]:
        """Node of rank r: the r-th most frequent continuation after its path (a node with no
        such candidate repeats the best one, or the newest token: verified, never kept
        wrongly)."""
        fallback = doc.tokens[-1] if doc.tokens else 0
        frontiers: list[list[Node]] = [doc.frontier]
        tokens: list[int] = []
        for i in range(1, tree.num_nodes):
            frontier = frontiers[int(tree.parents[i])]
            node, _ = deepest_with_continuation(frontier)
            ranked = node.ranked() if node is not None else []
            rank = int(tree.ranks[i])
            token = ranked[rank][0] if rank < len(ranked) else (
                ranked[0][0] if ranked else fallback)
            tokens.append(token)
            frontiers.append(advance(frontier, idx.root, token, idx.max_depth))
        return tokens


__all__ = ["SuffixDrafter"]
