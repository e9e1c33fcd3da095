"""Plain-PyTorch specifications of every kernel in ``specengine.kernels``.

Written for clarity, not speed: each function is the contract its Triton / CUDA twin is tested
against, and the CPU engine (``kernel_backend="torch"``) runs these directly.

Paged KV layout (DESIGN §5): ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, Hkv, D]``;
token ``t`` of sequence ``s`` lives in slot ``block_tables[s, t // bs] * bs + t % bs``.
"""

from __future__ import annotations

import torch
from torch import Tensor

# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def tree_mask_to_dense(tree_mask: Tensor, q_len: int) -> Tensor:
    """Unpack a packed bit mask ``[q_len, num_words] int32`` into a dense ``[q_len, q_len]`` bool.

    Bit ``j % 32`` of word ``j // 32`` in row ``i`` set ⇔ query ``i`` may attend to new token ``j``.
    """
    j = torch.arange(q_len, device=tree_mask.device)
    words = tree_mask[:, j // 32].to(torch.int64)  # [q_len, q_len]
    return ((words >> (j % 32)) & 1).bool()


def pack_tree_mask(dense: Tensor) -> Tensor:
    """Pack a dense ``[n, n]`` bool mask into ``[n, ceil(n/32)] int32`` words (inverse of above)."""
    n = dense.shape[0]
    num_words = (n + 31) // 32
    out = torch.zeros(n, num_words, dtype=torch.int64, device=dense.device)
    for j in range(n):
        out[:, j // 32] |= dense[:, j].to(torch.int64) << (j % 32)
    # Reinterpret the low 32 bits as a signed int32 (bit 31 becomes the sign bit).
    out = torch.where(out >= 2**31, out - 2**32, out)
    return out.to(torch.int32)


def gather_kv(cache: Tensor, block_table: Tensor, num_tokens: int) -> Tensor:
    """The first ``num_tokens`` entries of one sequence: ``[num_tokens, Hkv, D]``."""
    block_size = cache.shape[1]
    t = torch.arange(num_tokens, device=cache.device)
    blocks = block_table.long()[t // block_size]
    return cache[blocks, t % block_size]


def paged_attention(
    q: Tensor,  # [T, Hq, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32
    context_lens: Tensor,  # [B] int32: tokens cached before this step's queries
    qo_indptr: Tensor,  # [B+1] int32: queries of sequence b are q[qo_indptr[b]:qo_indptr[b+1]]
    tree_mask: Tensor | None,  # [T, num_words] int32 packed bits, or None for causal
    scale: float,
) -> Tensor:  # [T, Hq, D]
    """Ragged attention of new queries over the paged cache (prefill, decode and verification).

    The K/V of the ``q_len`` new tokens of sequence ``b`` are already in the cache at positions
    ``context_lens[b] .. context_lens[b] + q_len - 1``. Query ``i`` sees the whole context and the
    new tokens ``j`` its mask row allows (causal ``j <= i`` when ``tree_mask`` is None). Softmax
    runs in float32; the output has the dtype of ``q``.
    """
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    indptr = qo_indptr.tolist()
    ctx = context_lens.tolist()
    for b in range(len(ctx)):
        start, end = indptr[b], indptr[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        kv_len = ctx[b] + q_len
        k = gather_kv(k_cache, block_tables[b], kv_len).float()  # [kv_len, Hkv, D]
        v = gather_kv(v_cache, block_tables[b], kv_len).float()
        k = k.repeat_interleave(group, dim=1)  # [kv_len, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        if tree_mask is None:
            new_mask = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril()
        else:
            new_mask = tree_mask_to_dense(tree_mask[start:end], q_len)
        mask = torch.cat(
            [torch.ones(q_len, ctx[b], dtype=torch.bool, device=q.device), new_mask], dim=1
        )  # [q_len, kv_len]
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# KV cache writes and accepted-path compaction
# --------------------------------------------------------------------------------------------


def slot_mapping(block_tables: Tensor, seq_ids: Tensor, positions: Tensor, block_size: int) -> Tensor:
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
