"""Plain-PyTorch specification of the fused mixture-of-experts kernel (``fused_moe.py``).

A sparse MoE block (Qwen3-MoE, Qwen2-MoE, Mixtral) routes each token to ``k`` of ``E``
experts and sums their SwiGLU MLPs weighted by the router:

    p = softmax(router_logits)            (float32, over all E experts)
    (w, ids) = top-k of p                 (w / sum(w) when renormalising: Mixtral, and Qwen
                                           with ``norm_topk_prob``; this equals a softmax over
                                           the k selected logits)
    y_j = down_e(silu(gate_e(x)) * up_e(x))    for e = ids[j], in the activation dtype
    out = sum_j w_j * y_j                 (float32, rounded once to the activation dtype)

Expert weights are merged per layer: ``w13 [E, 2I, H]`` (rows: gate then up, as a merged
``gate_up_proj``) and ``w2 [E, H, I]``. transformers computes the same sum expert by expert
(``index_add_``); only the summation order differs, so float32 agrees to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def route_topk(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """``router_logits [T, E]`` → ``(weights [T, k] float32, expert ids [T, k] int64)``: the
    top-k of the float32 softmax, largest first, optionally renormalised to sum to 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_mlp(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """One expert's SwiGLU MLP: ``x [N, H]``, ``w13 [2I, H]``, ``w2 [H, I]`` → ``[N, H]``,
    every product in ``x``'s dtype (transformers' numerics)."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor,
              topk_ids: Tensor) -> Tensor:
    """``x [T, H]`` through the experts ``topk_ids [T, k]`` weighted by ``topk_weights [T, k]``
    (float32) → ``[T, H]`` in ``x``'s dtype. Experts nobody picked are never run."""
    num_experts = w13.shape[0]
    acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        token_idx, slot = torch.where(topk_ids == e)
        if token_idx.numel() == 0:
            continue
        y = expert_mlp(x[token_idx], w13[e], w2[e]).float()
        acc.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return acc.to(x.dtype)


def moe_forward(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int,
                renormalize: bool) -> Tensor:
    """Routing then the expert sum: the whole sparse block after its router matmul."""
    weights, ids = route_topk(router_logits, top_k, renormalize)
    return fused_moe(x, w13, w2, weights, ids)
