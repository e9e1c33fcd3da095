"""Issue 29: the exact edges of request admission (``specengine.core.requests.validate_requests``).

A request is admitted only if, alone, it fits the KV cache with its draft slots: ``prompt +
max_tokens`` (capped by ``max_model_len``) tokens, plus ``k`` draft tokens and the bonus token
a verify step writes past them, plus a tree's nodes. Each bound is tested on both sides, so
dropping a term (or the check) or moving a bound by one fails. The cache is a real one of 4
blocks of 16 tokens: 64 token slots.
"""

from __future__ import annotations

import pytest
import torch

from specengine.config import MAX_K
from specengine.core.kv_cache import KVCache, KVCacheFullError
from specengine.core.requests import validate_requests
from specengine.sampling import SamplingParams
from specengine.tree import DraftTree

VOCAB = 100
SLOTS = 64
MAX_MODEL_LEN = 1000  # far above the cache: the cache is the bound here


@pytest.fixture(scope="module")
def cache() -> KVCache:
    return KVCache(SLOTS // 16, 16, 1, 1, 2, torch.float32, "cpu")


def admit(cache: KVCache, prompt_len: int = 10, max_tokens: int = 10, k: int = 0, tree=None,
          has_drafter: bool = True, max_model_len: int = MAX_MODEL_LEN, prompt=None,
          stop: tuple[int, ...] = ()):
    return validate_requests(
        [list(range(1, prompt_len + 1)) if prompt is None else prompt], k,
        SamplingParams(max_tokens=max_tokens, stop_token_ids=stop), tree, tokenizer=None,
        vocab_size=VOCAB, max_model_len=max_model_len, kv_cache=cache, has_drafter=has_drafter)


@pytest.mark.parametrize("k", [0, 1, 3, MAX_K])
def test_kv_room_counts_draft_slots_and_the_bonus_token(cache: KVCache, k: int) -> None:
    # prompt + max_tokens + k + 1 == 64 fits exactly; one more token of output does not.
    fits = SLOTS - 1 - k - 10
    assert admit(cache, max_tokens=fits, k=k).k == k
    with pytest.raises(KVCacheFullError, match=f"up to {SLOTS + 1} tokens"):
        admit(cache, max_tokens=fits + 1, k=k)


def test_kv_room_counts_tree_nodes(cache: KVCache) -> None:
    tree = DraftTree([(0,), (1,), (0, 0), (0, 1)])  # depth 2, 5 nodes with the root
    fits = SLOTS - 1 - tree.max_depth - tree.num_nodes - 10
    batch = admit(cache, max_tokens=fits, tree=tree)
    assert batch.k == 2 and batch.tree is tree
    with pytest.raises(KVCacheFullError):
        admit(cache, max_tokens=fits + 1, tree=tree)


def test_max_model_len_caps_the_room_needed(cache: KVCache) -> None:
    """A huge max_tokens is fine when max_model_len stops the sequence first."""
    admit(cache, max_tokens=2**31 - 1, k=4, max_model_len=SLOTS - 5)
    with pytest.raises(KVCacheFullError):
        admit(cache, max_tokens=2**31 - 1, k=4, max_model_len=SLOTS - 4)


def test_k_bounds(cache: KVCache) -> None:
    assert admit(cache, k=MAX_K, max_tokens=1).k == MAX_K  # the largest k is allowed
    for bad in (MAX_K + 1, -1, True, False, 2.0):
        with pytest.raises(ValueError, match="k \\(draft length\\)"):
            admit(cache, k=bad)  # type: ignore[arg-type]


def test_any_k_needs_a_drafter(cache: KVCache) -> None:
    assert admit(cache, k=0, has_drafter=False).k == 0
    for k in (1, 2):
        with pytest.raises(ValueError, match="needs a drafter"):
            admit(cache, k=k, has_drafter=False)


def test_tree_depth_must_agree_with_k(cache: KVCache) -> None:
    tree = DraftTree([(0,), (0, 0)])
    assert admit(cache, k=0, tree=tree).k == 2 and admit(cache, k=2, tree=tree).k == 2
    with pytest.raises(ValueError, match="disagrees with the tree's depth"):
        admit(cache, k=1, tree=tree)


def test_token_ids_must_lie_in_the_vocabulary(cache: KVCache) -> None:
    admit(cache, prompt=[0, VOCAB - 1], stop=(0, VOCAB - 1))  # both ends of the vocabulary
    with pytest.raises(ValueError, match="outside the vocabulary"):
        admit(cache, prompt=[1, VOCAB])
    with pytest.raises(ValueError, match="stop_token_ids of prompt 0 are outside"):
        admit(cache, stop=(VOCAB,))


def test_prompt_ids_refuse_bools(cache: KVCache) -> None:
    with pytest.raises(ValueError, match="list of int token ids"):
        admit(cache, prompt=[1, True, 3])


def test_prompt_must_leave_room_to_generate(cache: KVCache) -> None:
    admit(cache, prompt_len=19, max_tokens=1, max_model_len=20)
    with pytest.raises(ValueError, match="leaves no room to generate"):
        admit(cache, prompt_len=20, max_tokens=1, max_model_len=20)
