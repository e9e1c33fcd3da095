"""``DraftTree.best``: the static tree with the most expected accepted drafts for given path
probabilities, against an exhaustive search over every prefix-closed tree; its objective
against the exact expectation of a step's accepted drafts; refusals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from specengine.tree import MAX_TREE_NODES, DraftTree

NONE = -1  # a depth whose token is outside the draft's ranks: the path ends


def path_probs(rank_rows: np.ndarray) -> dict[tuple[int, ...], float]:
    """Empirical path probabilities of sampled rank tuples (``NONE`` ends a tuple)."""
    out: dict[tuple[int, ...], float] = {}
    for row in rank_rows.tolist():
        for d in range(len(row)):
            if row[d] == NONE:
                break
            key = tuple(row[: d + 1])
            out[key] = out.get(key, 0.0) + 1.0 / len(rank_rows)
    return out


def sampled_ranks(rng: np.random.Generator, num: int, depth: int, ranks: int) -> np.ndarray:
    """Rank tuples with correlated depths: an anchor's difficulty shifts every depth."""
    easy = rng.random(num) < 0.5
    rows = []
    for _ in range(depth):
        sharp = np.where(easy, 0.7, 0.2)
        top = rng.random(num) < sharp
        other = rng.integers(0, ranks + 1, num)  # ranks: outside
        rows.append(np.where(top, 0, np.where(other == ranks, NONE, other)))
    return np.stack(rows, 1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("depth", "ranks", "n"), [(2, 3, 4), (3, 2, 5), (2, 3, 7), (3, 2, 3)])
def test_best_tree_is_the_most_probable_prefix_closed_set(seed: int, depth: int, ranks: int,
                                                          n: int) -> None:
    rng = np.random.default_rng(seed)
    probs = path_probs(sampled_ranks(rng, 200, depth, ranks))
    tree = DraftTree.best(probs, n)
    assert len(tree.paths) == n
    best = -1.0
    for subset in itertools.combinations(sorted(probs), n):
        have = set(subset)
        if all(len(p) == 1 or p[:-1] in have for p in subset):
            best = max(best, sum(probs[p] for p in subset))
    assert sum(probs[p] for p in tree.paths) == pytest.approx(best)


def test_the_objective_is_a_steps_expected_accepted_drafts() -> None:
    """A step keeps the longest path of the tree that the anchor's ranks begin with; over
    the anchors, its mean is the sum of the tree's path probabilities."""
    rows = sampled_ranks(np.random.default_rng(9), 500, 3, 3)
    probs = path_probs(rows)
    for n in (1, 3, 6, 10):
        tree = DraftTree.best(probs, n)
        have = set(tree.paths)
        kept = 0
        for row in rows.tolist():
            d = 0
            while d < 3 and row[d] != NONE and tuple(row[: d + 1]) in have:
                d += 1
            kept += d
        assert kept / len(rows) == pytest.approx(sum(probs[p] for p in tree.paths))


def test_a_sharp_draft_gets_a_chain_and_a_flat_one_a_bush() -> None:
    sharp = {(0,): 0.9, (1,): 0.05, (0, 0): 0.8, (0, 1): 0.05, (0, 0, 0): 0.7}
    assert DraftTree.best(sharp, 3).paths == DraftTree.chain(3).paths
    flat = {(0,): 0.3, (1,): 0.3, (2,): 0.3, (0, 0): 0.1, (1, 0): 0.1}
    tree = DraftTree.best(flat, 3)
    assert tree.paths == ((0,), (1,), (2,)) and tree.max_depth == 1
    # ties: a child as probable as its parent comes after it
    assert DraftTree.best({(0,): 0.5, (0, 0): 0.5, (1,): 0.5}, 2).paths == ((0,), (1,))


@pytest.mark.parametrize(("probs", "n", "says"), [
    ({(0,): 0.5, (0, 0): 0.6}, 2, "more probable"),
    ({(0,): 0.5, (1, 0): 0.1}, 1, "its parent \\(1,\\) is not"),
    ({(0,): 1.5}, 1, "not in \\[0, 1\\]"),
    ({(0,): float("nan")}, 1, "not in \\[0, 1\\]"),
    ({(): 0.5}, 1, "non-empty tuple"),
    ({(0,): 0.5}, 0, "num_drafts must be in"),
    ({(0,): 0.5}, MAX_TREE_NODES, "num_drafts must be in"),
    ({(0,): 0.5, (1,): 0.2}, 3, "only 2 paths given"),
])
def test_bad_path_probabilities_are_refused(probs: dict, n: int, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        DraftTree.best(probs, n)
