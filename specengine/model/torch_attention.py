"""Batched PyTorch paged attention for the CPU engine (``kernel_backend="torch"``).

``kernels.reference.paged_attention`` is the specification and loops over sequences, which is
clear but slow for the thousands of short sequences a CPU rollout or a distribution test runs.
This computes the same thing for the whole batch at once by padding every sequence to the
longest query and key range and masking the padding; ``tests/test_torch_attention.py`` proves
it equal to the reference.

On the CPU every operator is a Python → C++ dispatch (a few µs each: for a small model the bulk
of a step), so what all layers of one forward pass share is built once per pass
(:func:`build_pass_plan`, called through ``AttentionBackend.plan`` before the first layer and
carried in ``AttentionMetadata.plan``): the cache blocks each sequence reads, the mask, the
query padding, the KV-write rows, the rope tables. A layer then gathers K/V by whole blocks
(``index_select``: advanced indexing costs several times more per call), runs one fused
``scaled_dot_product_attention`` and writes its new K/V with ``index_copy_``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class TorchPassPlan(NamedTuple):
    """What every torch-backend layer of one forward pass shares. Tensors only (None where the
    pass's shapes make a field unnecessary): a captured pass hands the same structure to every
    layer at every replay, whatever the lengths (``tests/replaying_graph.py``)."""

    blocks: Tensor  # [B, nblk] int64: cache blocks gathered per sequence (padding: block 0)
    # [B, 1, Qm, nblk * block_size] float32: 0 at the keys each padded query sees, -inf
    # elsewhere (what ``scaled_dot_product_attention`` makes of a bool mask, once per pass)
    mask: Tensor
    q_index: Tensor | None  # [B * Qm] int64: token of each padded query row; None: T == B * Qm
    out_index: Tensor | None  # [T] int64: padded query row of each token; None: T == B * Qm
    write_index: Tensor  # [W] int64: the tokens whose K/V are written (slot >= 0)
    write_slots: Tensor  # [W] int64: their cache slots
    cos: Tensor | None  # [T, 1, D]: cat(cos, cos) (rope, ``rotate_half`` layout); None: no rope
    sin: Tensor | None  # [T, 1, D]: cat(-sin, sin)


def build_pass_plan(block_tables: Tensor, context_lens: Tensor, qo_indptr: Tensor,
                    tree_mask: Tensor | None, slot_mapping: Tensor, max_q_len: int,
                    block_size: int, cos: Tensor | None = None,
                    sin: Tensor | None = None) -> TorchPassPlan | None:
    """The plan of one pass (metadata as in ``AttentionMetadata``; ``cos`` / ``sin`` ``[T,
    D/2]`` from ``RotaryEmbedding.cos_sin``), None when the pass has no token. Reads lengths
    back to size the padding (free on the CPU, where this backend runs)."""
    num_tokens = slot_mapping.shape[0]
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return None
    dev = context_lens.device
    ctx = context_lens.long()
    # Every sequence has max_q_len tokens exactly when they add up to B * max_q_len (none has
    # more): query rows are the tokens themselves, no padding to gather or drop.
    uniform = num_tokens == num_seqs * max_q_len
    if uniform:
        max_q = max_q_len
        max_kv = int(ctx.max()) + max_q
    else:
        q_lens = (qo_indptr[1:] - qo_indptr[:-1]).long()  # [B]
        max_q = int(q_lens.max())
        max_kv = int((ctx + q_lens).max())
    num_blocks = min(-(-max_kv // block_size), block_tables.shape[1])
    blocks = block_tables[:, :num_blocks].long().clamp_min(0)
    qi = torch.arange(max_q, device=dev)
    kj = torch.arange(num_blocks * block_size, device=dev)
    q_index = out_index = None
    if uniform and tree_mask is None:
        # Query i of sequence b is its token ctx + i: it sees keys 0 .. ctx + i (context, then
        # the new tokens up to itself).
        mask = kj < (ctx[:, None] + (qi + 1)[None, :])[:, :, None]  # [B, Qm, Km]
    else:
        if uniform:
            q_lens = torch.full((num_seqs,), max_q, dtype=torch.long, device=dev)
        # Query row i of sequence b is token qo_indptr[b] + i; padding rows read token 0.
        q_valid = qi[None, :] < q_lens[:, None]  # [B, Qm]
        q_index = torch.where(q_valid, qo_indptr[:-1].long()[:, None] + qi[None, :],
                              0).view(-1)
        out_index = q_valid.view(-1).nonzero().view(-1)  # (sequence, query) order = tokens
        # Mask: the whole context, plus new token j = key - ctx as the causal / tree rule
        # allows.
        new_j = kj[None, :] - ctx[:, None]  # [B, Km]
        in_ctx = new_j < 0
        in_new = (new_j >= 0) & (new_j < q_lens[:, None])
        if tree_mask is None:
            allowed = new_j[:, None, :] <= qi[None, :, None]  # [B, Qm, Km]
        else:
            rows = tree_mask.index_select(0, q_index).view(num_seqs, max_q, -1).long()
            j = new_j.clamp_min(0)
            word = torch.gather(rows, 2, (j // 32)[:, None, :].expand(-1, max_q, -1).clamp_max(
                rows.shape[2] - 1))
            allowed = ((word >> (j % 32)[:, None, :]) & 1).bool()
        mask = in_ctx[:, None, :] | (in_new[:, None, :] & allowed)  # [B, Qm, Km]
        mask &= q_valid[:, :, None]
        mask[:, :, 0] |= ~q_valid  # padding rows attend to key 0 so their softmax is finite
    write_index = (slot_mapping >= 0).nonzero().view(-1)
    write_slots = slot_mapping.index_select(0, write_index).long()
    cos_full = sin_full = None
    if cos is not None and sin is not None:
        cos_full = torch.cat([cos, cos], dim=-1)[:, None, :]
        sin_full = torch.cat([-sin, sin], dim=-1)[:, None, :]
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=dev).masked_fill_(
        ~mask, float("-inf"))
    return TorchPassPlan(blocks, bias[:, None], q_index, out_index, write_index, write_slots,
                         cos_full, sin_full)


def plan_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: TorchPassPlan,
                   scale: float) -> Tensor:
    """Attention of ``q [T, Hq, D]`` over the cache as ``plan`` lays it out; ``[T, Hq, D]``,
    fp32 softmax (``scaled_dot_product_attention`` in float32; other dtypes are upcast as the
    reference does)."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs, num_blocks = plan.blocks.shape
    max_q = plan.mask.shape[2]
    flat_blocks = plan.blocks.view(-1)
    keys = num_blocks * block_size
    qp = q if plan.q_index is None else q.index_select(0, plan.q_index)
    k = k_cache.index_select(0, flat_blocks).view(num_seqs, keys, num_kv_heads, head_dim)
    v = v_cache.index_select(0, flat_blocks).view(num_seqs, keys, num_kv_heads, head_dim)
    if q.dtype != torch.float32:
        qp, k, v = qp.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(
        qp.view(num_seqs, max_q, num_q_heads, head_dim).transpose(1, 2), k.transpose(1, 2),
        v.transpose(1, 2), attn_mask=plan.mask, scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    ).transpose(1, 2)  # [B, Qm, Hq, D]
    if plan.out_index is None:
        out = out.reshape(num_tokens, num_q_heads, head_dim)
    else:
        out = out.reshape(num_seqs * max_q, num_q_heads, head_dim).index_select(
            0, plan.out_index)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def plan_write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                  plan: TorchPassPlan) -> None:
    """``reference.reshape_and_cache`` with the plan's rows and slots (negative slots were
    dropped when the plan was built)."""
    for new, cache in ((k, k_cache), (v, v_cache)):
        rows = new.index_select(0, plan.write_index)
        if rows.dtype != cache.dtype:
            rows = rows.to(cache.dtype)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, plan.write_slots, rows)


def padded_paged_attention(
    q: Tensor,  # [T, Hq, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: Tensor,  # [B] int32
    qo_indptr: Tensor,  # [B+1] int32
    tree_mask: Tensor | None,  # [T, num_words] int32 packed bits, or None (causal)
    scale: float,
    max_q_len: int | None = None,
) -> Tensor:  # [T, Hq, D]
    """Same contract as ``kernels.reference.paged_attention``; fp32 softmax. ``max_q_len``:
    the longest sequence's query count when the caller knows it."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return torch.empty_like(q)
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    slots = torch.zeros(num_tokens, dtype=torch.long, device=q.device)  # (writes unused here)
    plan = build_pass_plan(block_tables, context_lens, qo_indptr, tree_mask, slots, max_q_len,
                           k_cache.shape[1])
    if plan is None:
        return torch.empty_like(q)
    return plan_attention(q, k_cache, v_cache, plan, scale)
