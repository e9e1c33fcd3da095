"""Prefix-cache behaviours no earlier test pinned (issue 37), written from the behaviour:

- a block's name covers every one of its tokens, the last included: two prompts that differ
  only in a block's last token must not share that block (they would read each other's KV);
- the free-block count (what admission trusts) counts a cached block as reclaimable only while
  no sequence holds it: blocks a running sequence shares are neither free nor evictable, and a
  plan reusing them needs only its fresh blocks.

No model: the real ``KVCache`` and ``PrefixCache`` with simulated prefills.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from specengine import SamplingParams
from specengine.core.kv_cache import KVCache
from specengine.core.prefix_cache import block_hashes
from specengine.core.sequence import Sequence

BS = 16


def cache(num_blocks: int) -> KVCache:
    return KVCache(num_blocks, BS, 1, 1, 2, torch.float32, "cpu", prefix_caching=True)


def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, list(tokens), SamplingParams(), 0, ())


def prefill(kv: KVCache, s: Sequence) -> None:
    plan = kv.plan(s)
    assert kv.can_admit(plan)
    kv.admit(plan)
    kv.finish_prefill([s])


@pytest.mark.parametrize("next_token", [False, True])
def test_every_token_of_a_block_changes_its_name(next_token: bool) -> None:
    """Changing any one token of block i (first, middle or last) renames block i and every
    later block, and no earlier one; named with the next token, the first token of block i
    also renames block i - 1."""
    base = list(range(1, 3 * BS + 2))
    names = block_hashes(base, BS, 3, next_token=next_token)
    for pos in (0, 7, BS - 1, BS, 2 * BS - 1, 3 * BS - 1, 3 * BS):
        other = list(base)
        other[pos] += 1000
        got = block_hashes(other, BS, 3, next_token=next_token)
        block = (pos - 1) // BS if next_token and pos % BS == 0 and pos else pos // BS
        if block >= 3:  # only a next token: block 2's name alone covers it
            assert got[:2] == names[:2]
            assert (got[2] != names[2]) == next_token
            continue
        assert got[:block] == names[:block], pos
        assert all(a != b for a, b in zip(got[block:], names[block:])), pos


def test_next_token_names_cover_the_token_after_the_block() -> None:
    base = list(range(1, 2 * BS + 2))
    other = base[:BS] + [999] + base[BS + 1:]  # token BS: block 0's next token
    assert block_hashes(base, BS, 1) == block_hashes(other, BS, 1)
    assert block_hashes(base, BS, 1, next_token=True) != block_hashes(other, BS, 1,
                                                                       next_token=True)


@pytest.mark.parametrize("last", [BS - 1, 2 * BS - 1])
def test_prompts_differing_only_in_a_blocks_last_token_share_no_such_block(last: int) -> None:
    """A prompt is cached; a second one equal but for the last token of block ``last // BS``
    reuses only the blocks before it, and computes that block itself."""
    kv = cache(16)
    first = list(range(1, 3 * BS + 5))
    prefill(kv, seq(0, first))
    second = list(first)
    second[last] = 500
    plan = kv.plan(seq(1, second))
    assert plan.num_cached == (last // BS) * BS
    assert len(plan.shared) == last // BS
    # The unchanged prompt still hits all three full blocks.
    assert kv.plan(seq(2, first)).num_cached == 3 * BS


def test_blocks_held_by_a_running_sequence_are_neither_free_nor_evictable() -> None:
    """A and B share a cached 2-block prefix; A finishes while B runs: the shared blocks stay
    held (not evictable), so the free count is exactly the blocks nobody holds, and admission
    takes a request of exactly that many blocks and refuses one more."""
    kv = cache(8)
    prompt = list(range(1, 2 * BS + 2))  # 2 full blocks + 1 token
    a, b = seq(0, prompt), seq(1, prompt)
    prefill(kv, a)
    prefill(kv, b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    kv.free(a)
    assert len(kv.prefix.evictable) == 0  # both named blocks are still B's
    assert kv.num_free_blocks == 8 - len(b.block_table) == 5
    fits = seq(2, [7] * (5 * BS))
    assert kv.can_admit(kv.plan(fits))
    assert not kv.can_admit(kv.plan(seq(3, [7] * (5 * BS + 1))))
    kv.admit(kv.plan(fits))  # and the allocation really is there
    assert b.block_table[:2] == shared and kv.allocator.num_free == 0
    kv.free(b)  # now only the cache holds the prefix: both evictable
    assert len(kv.prefix.evictable) == 2 and kv.num_free_blocks == 3


def test_reusing_blocks_a_running_sequence_holds_needs_only_the_fresh_blocks() -> None:
    """C extends the prompt that B (running) holds: the 2 shared blocks cost nothing free, so
    C fits when its fresh blocks equal the free count exactly; once B is gone the same blocks
    are evictable and are taken out of the free count C may use."""
    kv = cache(8)
    prompt = list(range(1, 2 * BS + 2))
    b = seq(0, prompt)
    prefill(kv, b)  # 3 blocks held, 2 of them named
    assert kv.num_free_blocks == 5
    c_tokens = prompt[:2 * BS] + [9] * (5 * BS)  # 7 blocks: 2 shared + 5 fresh
    plan = kv.plan(seq(1, c_tokens))
    assert len(plan.shared) == 2
    assert kv.can_admit(plan)
    assert not kv.can_admit(kv.plan(seq(2, c_tokens + [9])))  # 6 fresh
    kv.free(b)  # the 2 named blocks: evictable; B's third block: free
    assert kv.num_free_blocks == 8
    plan = kv.plan(seq(3, prompt[:2 * BS] + [9] * (6 * BS)))  # 2 shared + 6 fresh = 8
    assert len(plan.shared) == 2 and kv.can_admit(plan)
    assert not kv.can_admit(kv.plan(seq(4, prompt[:2 * BS] + [9] * (6 * BS + 1))))


# ---- names are the documented chained hash, whatever the tokens' container ---------------------
def spec_names(tokens: list[int], num_blocks: int, next_token: bool = False) -> list[bytes]:
    """The module docstring's definition: ``h_i = blake2b(h_{i-1} || int64 bytes of block i)``
    (16-byte digests, ``h_{-1}`` empty), or with ``next_token`` ``blake2b(h_i || the int64
    bytes of token (i + 1) * block_size)``."""
    out, prev = [], b""
    for i in range(num_blocks):
        block = b"".join(t.to_bytes(8, "little", signed=True)
                         for t in tokens[i * BS:(i + 1) * BS])
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        nxt = tokens[(i + 1) * BS].to_bytes(8, "little", signed=True) if next_token else None
        out.append(prev if nxt is None else hashlib.blake2b(prev + nxt, digest_size=16).digest())
    return out


@pytest.mark.parametrize("next_token", [False, True])
def test_block_names_are_the_documented_chained_blake2b(next_token: bool) -> None:
    tokens = [(7 * i + 3) % 50_000 for i in range(3 * BS + 3)]
    assert block_hashes(tokens, BS, 3, next_token) == spec_names(tokens, 3, next_token)
    # only the one token after a block is in its next-token name
    other = tokens[:BS + 1] + [49_999] + tokens[BS + 2:]
    assert block_hashes(other, BS, 1, True) == block_hashes(tokens, BS, 1, True)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_block_names_depend_on_token_values_not_their_array_type(dtype: type) -> None:
    """A list and an array of any integer type name the same blocks (the plan hashes a list of
    ids, the finished-sequence path an array)."""
    tokens = list(range(100, 100 + 2 * BS + 1))
    for next_token in (False, True):
        assert block_hashes(np.asarray(tokens, dtype=dtype), BS, 2, next_token) == \
            block_hashes(tokens, BS, 2, next_token)


def test_naming_blocks_by_their_next_token_needs_that_token() -> None:
    with pytest.raises(ValueError, match=r"^2 blocks named with their next token need 33 "
                                         r"tokens, got 32$"):
        block_hashes(list(range(2 * BS)), BS, 2, next_token=True)
    assert block_hashes([], BS, 0, next_token=True) == []


# ---- the cache's own bookkeeping ---------------------------------------------------------------
def test_a_plan_made_between_two_new_weights_registers_nothing() -> None:
    """Each weight update moves the epoch on: a prefill planned between two updates and
    finished after the second holds KV of the middle weights and must not be named."""
    kv = cache(16)
    prompt = list(range(1, 2 * BS + 2))
    kv.invalidate_prefix_cache()
    mid = seq(0, prompt)
    kv.admit(kv.plan(mid))  # planned under the first update's weights
    kv.invalidate_prefix_cache()
    kv.finish_prefill([mid])
    assert len(kv.prefix) == 0
    assert kv.plan(seq(1, prompt)).shared == []


def test_register_reports_how_many_blocks_it_named() -> None:
    kv = cache(8)
    pc = kv.prefix
    blocks = [int(b) for b in kv.allocator.allocate(3)]
    names = block_hashes(list(range(3 * BS)), BS, 3)
    assert pc.register(blocks[:2], names[:2], pc.epoch - 1) == 0  # planned before an update
    assert len(pc) == 0 and kv.allocator.ref_count(blocks[0]) == 1
    assert pc.register(blocks[:2], names[:2], pc.epoch) == 2
    assert pc.register(blocks, names, pc.epoch) == 1  # the first two are named already
    assert [kv.allocator.ref_count(b) for b in blocks] == [2, 2, 2]


def test_num_evicted_counts_every_evicted_block() -> None:
    kv = cache(8)
    pc = kv.prefix
    assert pc.num_evicted == 0
    for i in range(2):  # two finished prompts of 2 named blocks each: 4 evictable blocks
        s = seq(i, [i + 1] * (2 * BS + 1))
        prefill(kv, s)
        kv.free(s)
    assert len(pc.evictable) == 4
    assert pc.evict(1) == 1 and pc.num_evicted == 1
    assert pc.evict(10) == 3 and pc.num_evicted == 4
    assert pc.evict(1) == 0 and pc.num_evicted == 4
