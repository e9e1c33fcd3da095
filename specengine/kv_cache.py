"""The paged KV cache: one tensor for all layers plus the C++ block allocator that hands out
its blocks to sequences."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from specengine.config import MAX_K, EngineConfig
from specengine.model.config import ModelConfig
from specengine.sequence import Sequence

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 1 << 30
GPU_MEMORY_UTILIZATION = 0.85


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
        if num_tokens <= len(seq.block_table) * self.block_size:  # the common case: no work
            return
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


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def num_kv_blocks(cfg: EngineConfig, target: ModelConfig, device: torch.device,
                  extra_bytes_per_token: int = 0) -> int:
    """Blocks of a paged cache that holds as many tokens as the target's will.

    ``kv_cache_tokens`` when given; otherwise enough for ``max_batch_size`` full sequences,
    capped on CUDA by the memory left under ``GPU_MEMORY_UTILIZATION`` (split between the
    target's cache and ``extra_bytes_per_token``, a drafter's own cache built first) and on
    CPU by a 1 GiB target cache. Every cache of an engine gets the same token count, so a
    drafter never runs out of room before the target does."""
    target_bpt = kv_bytes_per_token(target.num_layers, target.num_kv_heads, target.head_dim,
                                    cfg.torch_dtype)
    wanted = cfg.max_batch_size * (cfg.max_model_len + MAX_K + 1)
    if cfg.kv_cache_tokens is not None:
        tokens = cfg.kv_cache_tokens
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = max(free - (1 - GPU_MEMORY_UTILIZATION) * total, 0)
        tokens = min(wanted, int(budget // (target_bpt + extra_bytes_per_token)))
    else:
        tokens = min(wanted, CPU_KV_BUDGET_BYTES // target_bpt)
    return max(1, tokens // cfg.block_size)
