"""n-gram (prompt-lookup) drafter: the longest suffix of the sequence that occurred before
proposes the tokens that followed it."""

from __future__ import annotations

from collections import Counter

import torch

from specengine.drafters.base import Drafter, DraftProposal
from specengine.sequence import Sequence
from specengine.tree import DraftTree


def continuations(tokens: list[int], min_n: int, max_n: int, limit: int) -> list[list[int]]:
    """For the longest suffix (``max_n`` down to ``min_n`` tokens) that also occurs earlier, the
    token runs (up to ``limit`` long) that followed its occurrences, most recent first."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        runs = []
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                runs.append(tokens[start + n:start + n + limit])
        if runs:
            return runs
    return []


class NgramDrafter(Drafter):
    """Point-mass drafts from prompt + output. Chains take the run after the most recent match;
    tree node of rank r takes the r-th most frequent next token after its path (nodes with no
    candidate repeat the best one: a wasted but harmless draft)."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram drafter needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                tree: DraftTree | None) -> DraftProposal:
        width = max(num_drafts)
        ids = torch.zeros(len(seqs), width, dtype=torch.int64)
        counts = []
        for b, (seq, n) in enumerate(zip(seqs, num_drafts)):
            if tree is None:
                runs = continuations(seq.token_ids, self.min_n, self.max_n, n)
                run = runs[0] if runs else []
                ids[b, : len(run)] = torch.tensor(run, dtype=torch.int64)
                counts.append(len(run))
            else:
                node_tokens = self._tree_tokens(seq.token_ids, tree)
                ids[b, : tree.num_nodes - 1] = torch.tensor(node_tokens, dtype=torch.int64)
                counts.append(tree.num_nodes - 1)
        return DraftProposal(ids, torch.tensor(counts, dtype=torch.int32), None)

    def _tree_tokens(self, tokens: list[int], tree: DraftTree) -> list[int]:
        node_tokens = [tokens[-1]]  # node 0 is the root
        paths: list[list[int]] = [[]]
        for i in range(1, tree.num_nodes):
            parent = int(tree.parents[i])
            path = paths[parent]
            runs = continuations(tokens + path, self.min_n, self.max_n, 1)
            ranked = [t for t, _ in Counter(r[0] for r in runs if r).most_common()]
            rank = int(tree.ranks[i])
            token = ranked[rank] if rank < len(ranked) else (ranked[0] if ranked else tokens[-1])
            node_tokens.append(token)
            paths.append(path + [token])
        return node_tokens[1:]
