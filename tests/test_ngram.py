"""n-gram drafter: suffix matching, and greedy losslessness through the engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from lossless import assert_greedy_lossless, ragged_requests

from specengine import SpecEngine
from specengine.core.sequence import Sequence
from specengine.drafters.ngram import NgramDrafter, continuations
from specengine.tree import DraftTree


def test_longest_suffix_wins_and_most_recent_first() -> None:
    tokens = [1, 2, 3, 9, 2, 3, 7, 5, 2, 3]
    # suffix (2, 3) occurs at 4 and 1 (most recent first); 3-gram (5, 2, 3) never occurred
    assert continuations(tokens, 1, 4, 2) == [[7, 5], [9, 2]]
    assert continuations([1, 2, 3], 1, 4, 3) == []
    assert continuations([4, 4], 1, 1, 3) == [[4]]


def plain_scan(tokens: list[int], min_n: int, max_n: int, limit: int) -> list[list[int]]:
    """The definition, one window at a time."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        runs = [tokens[s + n: s + n + limit] for s in range(len(tokens) - n - 1, -1, -1)
                if tokens[s: s + n] == tokens[len(tokens) - n:]]
        if runs:
            return runs
    return []


def test_vectorised_matching_equals_the_plain_scan() -> None:
    rng = random.Random(0)
    for _ in range(300):
        vocab = rng.choice((2, 3, 8))
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        assert continuations(tokens, min_n, max_n, 3) == plain_scan(tokens, min_n, max_n, 3)


def test_chain_and_tree_proposals() -> None:
    from specengine.sampling import SamplingParams

    seq = Sequence(0, [5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6], SamplingParams(), 0, ())
    drafter = NgramDrafter(min_n=1, max_n=3)
    chain = drafter.propose((seq,), [3], None)
    # the longest suffix that occurred before is (7, 5, 6), at 2..4, followed by 8, 5, 6
    assert chain.token_ids[0].tolist() == [8, 5, 6]
    assert chain.num_draft_tokens.tolist() == [3]  # host data (numpy)
    tree = DraftTree([(0,), (1,), (0, 0)])
    t = NgramDrafter(min_n=1, max_n=2).propose((seq,), [3], tree).token_ids[0].tolist()
    # after the 2-gram (5, 6): 7 twice, 8 once → rank 0 is 7, rank 1 is 8
    assert t[:2] == [7, 8]
    assert t[2] == 5  # after ... 5, 6, 7 comes 5


def test_bad_ngram_sizes() -> None:
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafter(min_n=3, max_n=2)


def test_greedy_lossless(tiny_checkpoint: Path) -> None:
    engine = SpecEngine(tiny_checkpoint, draft="ngram", device="cpu", dtype="float32",
                        max_model_len=96, max_batch_size=16, kv_cache_tokens=4096)
    prompts, params = ragged_requests(128, stop_pool=(3, 17, 64, 99))
    assert_greedy_lossless(engine, prompts, params)
    assert engine.stats.num_accepted_tokens > 0
