"""Plain-PyTorch specification of paged attention, and the packed tree-mask format it reads.

KV layout (docs/design.md §5): ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, Hkv, D]``;
token ``t`` of sequence ``s`` lives in slot ``block_tables[s, t // bs] * bs + t % bs``.
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def random_tree_mask(n: int, generator: torch.Generator, max_depth: int | None = None) -> Tensor:
    """Dense ancestor-or-self mask ``[n, n]`` bool of a random tree rooted at node 0.

    Node ``i`` picks its parent uniformly among the earlier nodes of depth < ``max_depth`` (any
    earlier node when None), so parents precede children as in a draft tree. Test and benchmark
    input, not a kernel contract.
    """
    parents, depth = [-1], [0]
    for i in range(1, n):
        candidates = [j for j in range(i) if max_depth is None or depth[j] < max_depth]
        p = candidates[int(torch.randint(0, len(candidates), (1,), generator=generator))]
        parents.append(p)
        depth.append(depth[p] + 1)
    dense = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:  # walk up to the root, marking every ancestor
            dense[i, j] = True
            j = parents[j]
    return dense
