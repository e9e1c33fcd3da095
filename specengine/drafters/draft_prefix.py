"""Prefix caching of a drafter's own KV, so that a cached prefix serves the target and the
draft alike (docs/design.md §17).

Where each drafter keeps the KV of a prompt, and how a cached prefix covers it:

- **EAGLE-3 / MTP on the static path** (``FeatureDrafter.shared_tables``): the entries live in
  the draft cache at the target's block ids, through the sequences' own block tables (as
  vLLM keeps the EAGLE layer's KV in the target's block table). A named target block then
  also holds the draft's entries of its positions, provided the drafter wrote them: with such
  a drafter blocks are named only after a prefill it caught up on
  (``KVCache.names_need_draft``).
- **EAGLE-3 / MTP eagerly**: their own allocator and per-sequence tables. A second
  :class:`~specengine.core.prefix_cache.PrefixCache` over the draft cache (:class:`DraftPrefix`)
  names the drafter's blocks with the target's names, and a target hit is cut to the leading
  blocks both caches hold (``KVCache.draft_hits``): the drafter cannot write an entry of a
  position whose target features the prefill did not compute.
- **Small LM**: its own allocator and tables too, named the same way. Its KV depends on the
  token ids only, so it takes whatever its own cache holds and computes the rest from the
  tokens, whatever the target reused.

A feature drafter's entry of position ``p`` reads the target's features of ``p`` (tokens
``0..p``) *and the token* ``p + 1``, so a block's entries depend on the first token after
the block: with such a drafter, target and draft blocks are named by
``block_hashes(next_token=True)`` (the chain hash extended with that token), and only blocks
whose next token is a prompt token are named (never one followed by the prefill's sampled
token, which differs between samples). The small LM names blocks by the plain chain hash.

Per-sequence drafter state that is not KV (the n-gram and suffix drafters' indexes, the
hybrid's counts) is built from the token ids, which a cache hit does not skip.

Every weight update, of the policy or of the draft (``load_weights(which="draft")``,
``adapt_draft``), drops every name, target's and draft's: no later prefill reuses KV of
older weights of either model.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from specengine.core.kv_cache import KVCache
from specengine.core.prefix_cache import PrefixCache, block_hashes


class DraftPrefix:
    """Names for a drafter's own cache's full blocks (see the module docstring).

    It becomes ``kv_cache.prefix``, so the cache's own ``ensure`` / ``free`` evict and
    release through it; tables kept outside ``KVCache`` (``LMSlots``) call
    :meth:`released` / :meth:`make_room` themselves."""

    def __init__(self, kv_cache: KVCache, next_token: bool) -> None:
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.cache = PrefixCache(kv_cache.allocator, kv_cache.block_size)
        kv_cache.prefix = self.cache
        self.next_token = next_token
        self.num_reused_tokens = 0  # draft positions served from the cache (a counter)

    def names(self, tokens: Seq[int] | np.ndarray, num_blocks: int) -> list[bytes]:
        return block_hashes(tokens, self.block_size, num_blocks, self.next_token)

    def num_hits(self, names: list[bytes]) -> int:
        """How many leading blocks of ``names`` the draft cache holds."""
        return len(self.cache.match(names))

    def take(self, tokens: Seq[int] | np.ndarray, num_tokens: int) -> list[int]:
        """The longest named prefix of the first ``num_tokens // block_size`` blocks of
        ``tokens``, one reference taken on each (the caller's table starts with them)."""
        blocks = self.cache.match(self.names(tokens, num_tokens // self.block_size))
        self.cache.acquire(blocks)
        self.num_reused_tokens += len(blocks) * self.block_size
        return blocks

    def register(self, table: Seq[int], tokens: Seq[int] | np.ndarray, num_blocks: int) -> None:
        """Name the first ``num_blocks`` blocks of ``table``, whose KV the drafter has just
        written for ``tokens`` under its current weights."""
        if num_blocks > 0:
            self.cache.register(list(table[:num_blocks]), self.names(tokens, num_blocks),
                                self.cache.epoch)

    def released(self, blocks: Seq[int]) -> None:
        self.cache.released(list(blocks))

    def make_room(self, num_needed: int) -> bool:
        """Evict named blocks nobody holds until ``num_needed`` blocks are free; False (with
        nothing evicted) when even all of them would not do."""
        short = num_needed - int(self.kv_cache.allocator.num_free)
        if short <= 0:
            return True
        if short > len(self.cache.evictable):
            return False
        self.cache.evict(short)
        return True

    def clear(self) -> None:
        """Forget every name (the draft's or the policy's weights changed)."""
        self.cache.clear()


__all__ = ["DraftPrefix"]
