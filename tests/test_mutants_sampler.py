"""Issue 29: the tree rejection sampler's law, exactly, including duplicate siblings.

The reference tree walk (``kernels/reference_sampling.py``) tries each child of a node as a
point mass on the residual of the node's law minus its earlier siblings' tokens, so a sibling
that repeats an earlier sibling's token has residual 0 and is never taken. The older tests drew
their duplicates from a token top-p had already removed (residual 0 either way), so a walk that
ignored duplicates passed. Here the duplicated token is always the row's most likely one (kept
by every top-k / top-p), and the whole walk is compared with its law, enumerated exactly in
float64 for a 5-token vocabulary: the path of (node, token) pairs it emits.

The seeds are fixed, so each case is deterministic; the chi-square bound (p > 1e-3) is there
only to make the exact law the reference of the comparison, not to tolerate bugs: a walk that
takes a duplicate emits a path outside the support, which fails on its own.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from lossless import processed_law

from specengine.kernels import reference as ref

VOCAB = 5
DRAWS = 20_000
P_MIN = 1e-3
# node:       0   1  2  3  4  5  6     0 -> {1, 2, 3}, 1 -> {4, 5}, 3 -> {6}
PARENTS = [-1, 0, 0, 0, 1, 1, 3]
SETTINGS = [(1.0, -1, 1.0), (0.8, 3, 1.0), (1.0, -1, 0.8), (1.3, 4, 0.9), (0.0, -1, 1.0)]

Path = tuple[tuple[int, int], ...]


def processed(logits: torch.Tensor, temp: float, top_k: int, top_p: float) -> list[float]:
    """The target law of one row in float64 (sort-based, independent of the reference)."""
    return processed_law(logits, temp, top_k, top_p).tolist()


def walk_law(laws: list[list[float]], tokens: list[int], node: int = 0) -> dict[Path, float]:
    """Exact law of the emitted path from ``node``: each distinct child token x is taken with
    probability p(x) (by its first sibling only), every other token t ends the walk with p(t);
    a child's token is therefore never emitted as the end token of its parent."""
    law: dict[Path, float] = {}
    seen: set[int] = set()
    for c in range(1, len(PARENTS)):
        if PARENTS[c] != node or tokens[c] in seen:
            continue  # a duplicate sibling: the residual holds nothing of its token
        seen.add(tokens[c])
        px = laws[node][tokens[c]]
        if px > 0:
            for sub, q in walk_law(laws, tokens, c).items():
                law[((node, tokens[c]),) + sub] = law.get(((node, tokens[c]),) + sub, 0.0) + px * q
    for t in range(VOCAB):
        if t not in seen and laws[node][t] > 0:
            law[((node, t),)] = laws[node][t]
    return law


def chi2_pvalue(observed: list[int], expected: list[float]) -> float:
    """Upper tail of Pearson's statistic (Wilson-Hilferty's normal approximation of the
    chi-square law: close enough at p ~ 1e-3, and no scipy needed)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    if dof == 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def tree_case(seed: int) -> tuple[torch.Tensor, list[int]]:
    """Logits [7, 5] and node tokens: node 2 repeats node 1's token and node 5 node 4's, each
    the most likely token of its parent's row; node 3 has the second most likely one."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(PARENTS), VOCAB, generator=g)
    order = logits.argsort(-1, descending=True)
    first, second = order[:, 0].tolist(), order[:, 1].tolist()
    tokens = [0, first[0], first[0], second[0], first[1], first[1], first[3]]
    return logits, tokens


def run_walk(logits: torch.Tensor, tokens: list[int], temp: float, top_k: int, top_p: float
             ) -> list[Path]:
    draws = DRAWS if temp > 0 else 64  # greedy is one path: a few rows show it
    out, acc, _, rows = ref.rejection_sample(
        logits[None].expand(draws, -1, -1), torch.tensor([tokens[1:]]).expand(draws, -1),
        torch.full((draws,), len(PARENTS) - 1, dtype=torch.int32), None,
        torch.full((draws,), temp), torch.full((draws,), top_k, dtype=torch.int32),
        torch.full((draws,), top_p), torch.arange(draws, dtype=torch.int64) * 7919 + 3,
        torch.full((draws,), 11, dtype=torch.int64),
        torch.tensor(PARENTS, dtype=torch.int32))
    assert torch.equal((out >= 0).sum(1), acc.long() + 1)  # accepted tokens plus one
    return [tuple(zip(r[r >= 0].tolist(), o[o >= 0].tolist())) for r, o in zip(rows, out)]


@pytest.mark.parametrize(("temp", "top_k", "top_p"), SETTINGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_walk_with_duplicate_siblings_follows_the_exact_law(
        seed: int, temp: float, top_k: int, top_p: float) -> None:
    logits, tokens = tree_case(seed)
    laws = [processed(row, temp, top_k, top_p) for row in logits]
    law = walk_law(laws, tokens)
    assert math.isclose(sum(law.values()), 1.0, rel_tol=1e-9)
    counts = Counter(run_walk(logits, tokens, temp, top_k, top_p))
    # Outside the support: a duplicate sibling (node 2 or 5) taken, a child's token emitted as
    # its parent's end token, or a filtered token.
    stray = {path: n for path, n in counts.items() if path not in law}
    assert not stray, stray
    assert not any(row in (2, 5) for path in counts for row, _ in path)
    if temp == 0:
        assert list(counts) == [max(law, key=law.get)]
        return
    paths = sorted(law)
    total = sum(counts.values())
    pvalue = chi2_pvalue([counts[p] for p in paths], [law[p] * total for p in paths])
    assert pvalue > P_MIN, (pvalue, counts, law)


def test_duplicate_of_a_rejected_likely_token_is_refused() -> None:
    """The case the old test missed: the first sibling is rejected in many rows (its token
    is likely but not certain), so the walk does try the duplicate, which must never pass:
    a row whose node 1 was rejected (its acceptance uniform, recomputed here, exceeds p(x))
    never emits x at the root, through node 2 or otherwise."""
    logits, tokens = tree_case(0)
    x = tokens[1]
    p_x = processed(logits[0], 1.0, -1, 1.0)[x]
    seeds = torch.arange(DRAWS, dtype=torch.int64) * 7919 + 3  # as in run_walk
    u1 = ref.uniform_from_bits(ref.philox4x32(seeds, torch.full_like(seeds, 11), 1, 0, 0)[0])
    rejected = (u1 > p_x + 1e-6).tolist()
    assert sum(rejected) > DRAWS * (1 - p_x) * 0.9  # node 2 is tried in thousands of rows
    paths = run_walk(logits, tokens, 1.0, -1, 1.0)
    emitted_x = [path[0][1] == x for path in paths]
    assert not any(r and e for r, e in zip(rejected, emitted_x))
    assert sum(emitted_x) == DRAWS - sum(rejected) - sum(  # node 1 taken in every other row
        abs(u - p_x) <= 1e-6 for u in u1.tolist())
