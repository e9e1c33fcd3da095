"""The paged KV cache: one tensor for all layers plus the C++ block allocator that hands out
its blocks to sequences."""

from __future__ import annotations

import math

import numpy as np
import torch

from specengine.sequence import Sequence


class KVCacheFullError(RuntimeError):
    """A request can never fit in the KV cache (it would need more blocks than exist)."""


class KVCache:
    """``kv[2, num_layers, num_blocks, block_size, Hkv, D]`` and the ownership of its blocks.

    Blocks are owned by sequences through ``seq.block_table``; :meth:`ensure` grows a table to
    cover a number of tokens (all or nothing) and :meth:`free` returns a table's blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        from specengine import _C

        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)
        self.allocator = _C.BlockAllocator(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return int(self.allocator.num_free)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_ensure(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks

    def ensure(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens (raises if blocks run out)."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing:
            seq.block_table.extend(int(b) for b in self.allocator.allocate(missing))

    def free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(np.asarray(seq.block_table, dtype=np.int32))
        seq.block_table = []
        seq.num_cached_tokens = 0

    def check_fits(self, num_tokens: int) -> None:
        """Raise if one sequence of ``num_tokens`` tokens could never fit, even alone."""
        need = self.blocks_for(num_tokens)
        if need > self.num_blocks:
            raise KVCacheFullError(
                f"a sequence of up to {num_tokens} tokens needs {need} KV blocks but the cache "
                f"has only {self.num_blocks} (block_size {self.block_size}); raise "
                "kv_cache_tokens or lower max_tokens / max_model_len"
            )
