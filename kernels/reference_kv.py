"""Plain-PyTorch specifications of the KV-cache writes and the accepted-path compaction.

KV layout (docs/design.md §5): ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, Hkv, D]``;
slot ``s`` is row ``s`` of the cache viewed as ``[num_blocks * block_size, Hkv, D]``.
"""

from __future__ import annotations

from torch import Tensor


def slot_mapping(
    block_tables: Tensor, seq_ids: Tensor, positions: Tensor, block_size: int
) -> Tensor:
    """Slot of token ``positions[i]`` of sequence ``seq_ids[i]``: ``[T] int64``."""
    blocks = block_tables.long()[seq_ids.long(), positions.long() // block_size]
    return blocks * block_size + positions.long() % block_size


def reshape_and_cache(
    key: Tensor,  # [T, Hkv, D]
    value: Tensor,  # [T, Hkv, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: Tensor,  # [T] int; a negative slot skips the token (padding)
) -> None:
    """Scatter new K/V into their slots, in place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def compact_kv(
    k_caches: list[Tensor],  # per layer [num_blocks, block_size, Hkv, D]
    v_caches: list[Tensor],
    src_slots: Tensor,  # [N] int: slots holding the accepted path's entries
    dst_slots: Tensor,  # [N] int: where they must go (context_len .. context_len + accepted)
) -> None:
    """Move accepted tree nodes to contiguous positions, in every layer, in place.

    Sources are read before any destination is written, so overlapping moves (a node moving
    onto a slot another accepted node is leaving) are safe.
    """
    src = src_slots.long()
    dst = dst_slots.long()
    for cache in (*k_caches, *v_caches):
        flat = cache.view(-1, *cache.shape[2:])
        flat[dst] = flat[src].clone()
