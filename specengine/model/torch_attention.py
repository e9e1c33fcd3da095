"""Batched PyTorch paged attention for the CPU engine (``kernel_backend="torch"``).

``kernels.reference.paged_attention`` is the specification and loops over sequences, which is
clear but slow for the thousands of short sequences a CPU rollout or a distribution test runs.
This computes the same thing for the whole batch at once by padding every sequence to the
longest query and key range and masking the padding; ``tests/test_torch_attention.py`` proves
it equal to the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor


def padded_paged_attention(
    q: Tensor,  # [T, Hq, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: Tensor,  # [B] int32
    qo_indptr: Tensor,  # [B+1] int32
    tree_mask: Tensor | None,  # [T, num_words] int32 packed bits, or None (causal)
    scale: float,
) -> Tensor:  # [T, Hq, D]
    """Same contract as ``kernels.reference.paged_attention``; fp32 softmax."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if num_tokens == 0:
        return torch.empty_like(q)
    plan = _build_plan(block_tables, context_lens, qo_indptr, tree_mask, block_size)
    if plan is None:
        return torch.empty_like(q)
    max_q, q_valid, q_index, slots, mask = plan
    num_seqs = context_lens.shape[0]
    qp = q[q_index].float().view(num_seqs, max_q, num_kv_heads, group, head_dim)
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots].float()  # [B, Km, Hkv, D]
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots].float()

    scores = torch.einsum("bqhgd,bkhd->bhgqk", qp, k) * scale
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(num_seqs, max_q, num_q_heads,
                                                              head_dim)
    return out[q_valid].to(q.dtype)  # rows in (sequence, query) order = token order


def _build_plan(block_tables: Tensor, context_lens: Tensor, qo_indptr: Tensor,
                tree_mask: Tensor | None, block_size: int) -> tuple | None:
    """(max_q, q_valid [B, Qm], q_index [B, Qm], slots [B, Km], mask [B, Qm, Km]) of a pass,
    None when no sequence has a query. Built at every layer: reusing it across a pass's
    layers by comparing the metadata would branch on data inside a captured pass."""
    dev = context_lens.device
    num_seqs = context_lens.shape[0]
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).long()  # [B]
    ctx = context_lens.long()  # [B]
    max_q = int(q_lens.max()) if num_seqs else 0
    max_kv = int((ctx + q_lens).max()) if num_seqs else 0
    if max_q == 0:
        return None

    # Query row i of sequence b is token qo_indptr[b] + i; padding rows point at token 0.
    qi = torch.arange(max_q, device=dev)
    q_valid = qi[None, :] < q_lens[:, None]  # [B, Qm]
    q_index = torch.where(q_valid, qo_indptr[:-1].long()[:, None] + qi[None, :], 0)

    # Keys 0 .. max_kv-1 of every sequence gathered through its block table.
    kj = torch.arange(max_kv, device=dev)
    blocks = block_tables.long()[:, kj // block_size].clamp_min(0)  # [B, Km]
    slots = blocks * block_size + kj % block_size

    # Mask: the whole context, plus new token j = key - ctx as the causal / tree rule allows.
    new_j = kj[None, :] - ctx[:, None]  # [B, Km]
    in_ctx = new_j < 0
    in_new = (new_j >= 0) & (new_j < q_lens[:, None])
    if tree_mask is None:
        allowed = new_j[:, None, :] <= qi[None, :, None]  # [B, Qm, Km]
    else:
        rows = tree_mask[q_index].long()  # [B, Qm, words]
        j = new_j.clamp_min(0)
        word = torch.gather(rows, 2, (j // 32)[:, None, :].expand(-1, max_q, -1).clamp_max(
            rows.shape[2] - 1))
        allowed = ((word >> (j % 32)[:, None, :]) & 1).bool()
    mask = in_ctx[:, None, :] | (in_new[:, None, :] & allowed)  # [B, Qm, Km]
    mask &= q_valid[:, :, None]
    mask[:, :, 0] |= ~q_valid  # padding rows attend to key 0 so their softmax is finite

    return max_q, q_valid, q_index, slots, mask
