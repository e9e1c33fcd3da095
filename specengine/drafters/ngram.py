"""n-gram (prompt-lookup) drafter: the longest suffix of the sequence that occurred before
proposes the tokens that followed it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from specengine.core.sequence import Sequence
from specengine.core.step_types import DraftProposal
from specengine.core.transfer import to_device
from specengine.drafters.base import Drafter
from specengine.tree import DraftTree


def suffix_matches(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, np.ndarray]:
    """``(n, starts)``: the longest suffix (``max_n`` down to ``min_n`` tokens) that also
    occurs earlier (overlaps allowed), and where its earlier occurrences start, most recent
    first; ``(0, [])`` when none does. One vectorised pass finds the earlier copies of the
    last token; each longer suffix only filters those candidates."""
    length = len(tokens)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # occurrence ends
    best_n, best = 0, np.zeros(0, dtype=np.int64)
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if not ends.size:
            break
        if n >= min_n:
            best_n, best = n, ends
    return best_n, best[::-1] - (best_n - 1)


def continuations(tokens: list[int], min_n: int, max_n: int, limit: int) -> list[list[int]]:
    """For the longest suffix (``max_n`` down to ``min_n`` tokens) that also occurs earlier, the
    token runs (up to ``limit`` long) that followed its occurrences, most recent first."""
    n, starts = suffix_matches(np.asarray(tokens, dtype=np.int64), min_n, max_n)
    return [tokens[s + n: s + n + limit] for s in starts.tolist()]


class NgramDrafter(Drafter):
    """Point-mass drafts from prompt + output. Chains take the run after the most recent match;
    tree node of rank r takes the r-th most frequent next token after its path (nodes with no
    candidate repeat the best one: a wasted but harmless draft)."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram drafter needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        #: where proposals go (set by ``make_drafter`` to the engine's device)
        self.device = torch.device("cpu")

    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                tree: DraftTree | None) -> DraftProposal:
        width = max(num_drafts)
        ids = np.zeros((len(seqs), width), dtype=np.int64)
        counts = []
        for b, (seq, n) in enumerate(zip(seqs, num_drafts)):
            if tree is None:
                m, starts = suffix_matches(np.asarray(seq.token_ids, dtype=np.int64),
                                           self.min_n, self.max_n)
                first = int(starts[0]) + m if starts.size else len(seq)
                run = seq.token_ids[first: first + n]
                ids[b, : len(run)] = run
                counts.append(len(run))
            else:
                node_tokens = self._tree_tokens(seq.token_ids, tree)
                ids[b, : tree.num_nodes - 1] = node_tokens
                counts.append(tree.num_nodes - 1)
        return DraftProposal(to_device(ids, self.device), np.asarray(counts, np.int64), None)

    def _tree_tokens(self, tokens: list[int], tree: DraftTree) -> list[int]:
        node_tokens = [tokens[-1]]  # node 0 is the root
        paths: list[list[int]] = [[]]
        for i in range(1, tree.num_nodes):
            parent = int(tree.parents[i])
            path = paths[parent]
            ctx = np.asarray(tokens + path, dtype=np.int64)
            m, starts = suffix_matches(ctx, self.min_n, self.max_n)
            ranked = [t for t, _ in Counter(ctx[starts + m].tolist()).most_common()]
            rank = int(tree.ranks[i])
            token = ranked[rank] if rank < len(ranked) else (ranked[0] if ranked else tokens[-1])
            node_tokens.append(token)
            paths.append(path + [token])
        return node_tokens[1:]
