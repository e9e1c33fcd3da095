"""Automatic prefix caching of full KV blocks, and GRPO groups (docs/design.md §17).

A full block's KV depends only on the tokens up to its end (and the weights), so a block is
named by a chained hash: ``h_i = blake2b(h_{i-1} || tokens of block i)`` (16-byte digests,
int64 token bytes; a collision needs ~2^64 distinct blocks). Partial blocks are never cached:
their KV is still being written.

The cache holds one allocator reference on every block it names, so a cached block outlives
the sequences that computed it. A cached block whose only reference is the cache's is
*evictable*: it counts as free, and :meth:`PrefixCache.evict` hands it back to the allocator,
least recently released first (a released table's blocks are queued last block first, so a
prefix outlives its tails). Blocks are registered right after the prefill pass that computed
them, and when a sequence finishes (its full blocks of valid KV, generated tokens included,
unless the weights changed since its admission: ``KVCache.cache_finished``), so every cached
block holds KV of the current weights;
:meth:`PrefixCache.clear` runs on every weight update and drops every name (held blocks stay
with their sequences, unnamed), so no later request can hit KV of older weights.

A group is the ``n`` samples of one prompt (``SamplingParams.n``). Sample ``i`` gets seed
:func:`sample_seed` ``(seed, i)``: sample 0 keeps the request's seed (so ``n=1`` is today's
request exactly), the others a splitmix64 mix of (seed, i).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from specengine.sampling import MAX_SEED, SamplingParams

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_group_ids = itertools.count()


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a group whose request has ``seed``: the seed itself for
    sample 0, else splitmix64(seed + index * golden ratio) reduced to [0, 2**63)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % MAX_SEED


@dataclass(frozen=True)
class SeqGroup:
    """The ``n`` samples of one prompt; the scheduler lets them share the prompt's KV."""

    group_id: int
    n: int


def expand_samples(params: SamplingParams
                   ) -> list[tuple[SamplingParams, tuple[SeqGroup, int] | None]]:
    """``(params of the sample, (group, sample_index))`` for each of ``params.n`` samples.
    One sample (n=1) is the request itself, with no group; with a seed, sample i has
    :func:`sample_seed`, and without one each sample draws its own from the engine."""
    if params.n == 1:
        return [(params, None)]
    group = SeqGroup(next(_group_ids), params.n)
    out = []
    for i in range(params.n):
        seed = None if params.seed is None else sample_seed(params.seed, i)
        out.append((dataclasses.replace(params, n=1, seed=seed), (group, i)))
    return out


def sample_ids(request_id: str | None, n: int, taken: Callable[[str], bool]
               ) -> list[str | None]:
    """Request ids of ``n`` samples: ``request_id`` itself for one, ``f"{request_id}-{i}"``
    for sample i of a group (None: the engine names them). Raises ``ValueError``, before
    anything is added, if one is ``taken`` by an unfinished request."""
    if n == 1 or request_id is None:
        return [request_id] * n
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
    ids = [f"{request_id}-{i}" for i in range(n)]
    used = [rid for rid in ids if taken(rid)]
    if used:
        raise ValueError(f"request ids {used[:3]} of the {n} samples of {request_id!r} are "
                         "already used by unfinished requests")
    return ids


def prefix_caching_on(config: object, drafter: object) -> bool:
    """Whether the engine's target cache names blocks: ``enable_prefix_caching``, with every
    drafter (a drafter's own KV is cached with the target's blocks, ``drafters.draft_prefix``)."""
    return bool(getattr(config, "enable_prefix_caching", True))


def block_hashes(tokens: Seq[int] | np.ndarray, block_size: int, num_blocks: int,
                 next_token: bool = False) -> list[bytes]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``tokens``. With
    ``next_token``, block i is named by ``blake2b(h_i || token (i + 1) * block_size)``
    instead (the chain itself is unchanged), so ``tokens`` must hold that token: the name
    then covers everything a feature drafter's entries of the block read (the entry of
    position p reads the token p + 1, ``drafters.draft_prefix``)."""
    end = num_blocks * block_size + (1 if next_token and num_blocks else 0)
    arr = np.asarray(tokens[:end], dtype=np.int64)
    if len(arr) < end:
        raise ValueError(f"{num_blocks} blocks named with their next token need {end} tokens, "
                         f"got {len(arr)}")
    out, prev = [], b""
    for i in range(num_blocks):
        prev = hashlib.blake2b(prev + arr[i * block_size:(i + 1) * block_size].tobytes(),
                               digest_size=16).digest()
        if next_token:
            nxt = arr[(i + 1) * block_size:(i + 1) * block_size + 1].tobytes()
            out.append(hashlib.blake2b(prev + nxt, digest_size=16).digest())
        else:
            out.append(prev)
    return out


class PrefixCache:
    """Hash → block of full blocks whose KV is computed, with an LRU of evictable ones (see
    the module docstring). ``allocator`` is the KV cache's ``_C.BlockAllocator``."""

    def __init__(self, allocator: object, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.epoch = 0  # weight updates seen (clears)
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self.block_of)

    def match(self, hashes: list[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (nothing is taken yet)."""
        out = []
        for h in hashes:
            b = self.block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_evictable_in(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if b in self.evictable)

    def acquire(self, blocks: list[int]) -> None:
        """One more reference on each of ``blocks`` (a sequence reuses them); they stop being
        evictable and become the most recently used."""
        if not blocks:
            return
        self.allocator.incref(np.asarray(blocks, dtype=np.int64))
        for b in blocks:
            self.evictable.pop(b, None)

    def register(self, blocks: list[int], hashes: list[bytes], epoch: int) -> int:
        """Name the just-computed full ``blocks`` by ``hashes`` (the cache takes a reference
        on each new one). Skipped when the weights changed since (``epoch``), and for a hash
        already cached (its first block keeps the name). Returns how many were added."""
        if epoch != self.epoch:
            return 0
        new = [(b, h) for b, h in zip(blocks, hashes)
               if h not in self.block_of and b not in self.hash_of]
        if new:
            self.allocator.incref(np.asarray([b for b, _ in new], dtype=np.int64))
        for b, h in new:
            self.block_of[h] = b
            self.hash_of[b] = h
        return len(new)

    def released(self, blocks: list[int]) -> None:
        """After a table's references were dropped: its named blocks that only the cache
        holds now become evictable, last block first (so tails are evicted before prefixes)."""
        ref_count = self.allocator.ref_count
        for b in reversed(blocks):
            if b in self.hash_of and ref_count(b) == 1:
                self.evictable[b] = None
                self.evictable.move_to_end(b)

    def evict(self, n: int) -> int:
        """Free up to ``n`` evictable blocks, least recently released first."""
        victims = []
        while self.evictable and len(victims) < n:
            b, _ = self.evictable.popitem(last=False)
            del self.block_of[self.hash_of.pop(b)]
            victims.append(b)
        if victims:
            self.allocator.free(np.asarray(victims, dtype=np.int64))
        self.num_evicted += len(victims)
        return len(victims)

    def clear(self) -> None:
        """Forget every name (after a weight update): evictable blocks go back to the
        allocator, held ones stay with their sequences; later registrations of blocks planned
        before this call are refused (the epoch moved)."""
        if self.hash_of:
            self.allocator.free(np.asarray(list(self.hash_of), dtype=np.int64))
        self.block_of.clear()
        self.hash_of.clear()
        self.evictable.clear()
        self.epoch += 1


__all__ = ["PrefixCache", "SeqGroup", "block_hashes", "expand_samples", "prefix_caching_on",
           "sample_ids", "sample_seed"]
