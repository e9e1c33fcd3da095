"""Fused mixture-of-experts: softmax top-k routing and the experts' SwiGLU MLPs as two grouped
GEMMs over the tokens sorted by expert. Specification: ``reference_moe``.

Launches (every shape fixed by ``T``, ``k``, ``E`` and the weights: no host sync, so a decode or
verify pass that runs this stays CUDA-graph capturable):

1. ``_topk_softmax_kernel``: per token, the float32 softmax of the router logits, its top-k
   (largest first, ties to the lower expert id), renormalised to sum 1 when asked.

Then one of two paths, chosen from shapes alone (:func:`uses_alignment`):

- **Per pair** (decode / verify: ``T·k·4 <= E``, so nearly every pair has an expert to itself
  and sorting would only add launches): ``_moe_gemv_kernel`` gate·up runs one program per
  ((token, slot) pair, ``BLOCK_N`` rows of the expert): a weight-streaming matrix-vector
  product, no alignment at all; then ``_moe_gemv_kernel`` down likewise. Two pairs that share an
  expert read its weights twice (rare at these sizes, and the second read often hits L2).
- **Aligned** (otherwise): :func:`moe_align_block_size` sorts the ``M = T·k`` pairs by expert,
  each expert's run padded to a multiple of ``BLOCK_M`` with the sentinel ``M``, so every
  ``BLOCK_M`` block of the sorted list belongs to one expert (as vLLM's / SGLang's
  ``moe_align_block_size``): one Triton program (``_moe_align_kernel``) up to
  ``ALIGN_KERNEL_MAX_PAIRS`` pairs, a few torch ops past it (a prefill chunk, where they cost
  nothing next to the GEMMs). The list has the static length ``M + min(E, M)·(BLOCK_M - 1)``
  (the most padding possible); ``num_tokens_post_padded`` (a device scalar) says how much of it
  is used and blocks past it return at once. ``_moe_gemm_kernel`` gate·up: block ``(m, n)``
  multiplies its ``BLOCK_M`` rows of ``x`` (row = pair // k) by the expert's gate rows ``n``
  and up rows ``I + n`` of ``w13 [E, 2I, H]``; ``_moe_gemm_kernel`` down: ``[M, I]`` by
  ``w2 [E, H, I]``.

Both paths write, for gate·up, ``silu(gate) * up`` ``[M, I]`` (SiLU·mul fused; gate, SiLU and
up each rounded to the activation dtype, as ``F.silu(gate) * up``), and for down the expert's
output rounded to the activation dtype (as transformers computes it) then scaled by the pair's
float32 routing weight, into a float32 ``[M, H]`` buffer. ``_moe_combine_kernel`` then sums
each token's ``k`` rows in float32 (slot order) and rounds once.

Accumulation is float32 throughout; weights are addressed with 64-bit offsets (235B-A22B's
``w13`` has 1.6·10⁹ elements).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, num_experts,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask = cols < num_experts
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(mask, e / tl.sum(e, axis=0), -1.0)  # taken / padded experts drop to -1
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        # The lowest expert id among the maxima (torch.topk's order on ties).
        idx = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, idx, top_i)
        p = tl.where(cols == idx, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    out_mask = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=out_mask)
    tl.store(ids_ptr + row * TOP_K + slots, top_i, mask=out_mask)


def topk_softmax(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """``router_logits [T, E]`` → ``(weights [T, k] float32, ids [T, k] int32)``
    (``reference_moe.route_topk``) in one launch."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    if router_logits.dtype not in _DTYPES:
        raise TypeError(f"router_logits must be a float tensor, got {router_logits.dtype}")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if num_experts > 1 and router_logits.stride(1) != 1:
        raise ValueError("router_logits must be contiguous along its last dim")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _topk_softmax_kernel[(num_tokens,)](
            router_logits, weights, ids, router_logits.stride(0), num_experts, TOP_K=top_k,
            RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=1)
    return weights, ids


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Length of the sorted pair list: every pair plus the most padding possible (each
    expert that has pairs pads its run by at most ``block_m - 1``)."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


#: Pair counts up to which the alignment is one Triton program (``_moe_align_kernel``): it walks
#: the pairs in chunks, so its time grows with ``T·k``; past this the sort-based torch ops
#: (a prefill chunk) are cheaper than a serial walk and negligible next to the GEMMs.
ALIGN_KERNEL_MAX_PAIRS = 1024


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, num_pairs,
                      num_experts, total,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                      J_CHUNK: tl.constexpr, B_CHUNK: tl.constexpr, TAIL_CHUNK: tl.constexpr):
    """One program: ``moe_align_block_size`` without a sort. Each pair's place is its expert's
    padded start plus the number of earlier pairs of that expert, counted with a one-hot
    ``[CHUNK, E_PAD]`` prefix sum per chunk of pairs (flat order within an expert kept). Its
    serial steps: 2·M/CHUNK pair chunks, BLOCK_M/J_CHUNK padding tiles, the tail in 1,024s,
    blocks/B_CHUNK owner tiles (T=16 at E=128, top-8: 4 + 4 + 1 + 2 + 4)."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    tl.store(num_post_ptr, tl.sum(padded, axis=0))
    seen = tl.zeros([E_PAD], dtype=tl.int32)  # pairs of each expert placed so far
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        live = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=live, other=-1).to(tl.int32)
        hit = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD] one-hot
        before = tl.cumsum(hit, axis=0) - hit  # earlier pairs of the same expert in the chunk
        dest = tl.sum(hit * (before + (padded_start + seen)[None, :]), axis=1)
        tl.store(sorted_ids_ptr + dest, offs, mask=live)
        seen += tl.sum(hit, axis=0)
    # The rest of the list gets the sentinel, disjoint from the places written above (so no
    # ordering between the passes is needed): each expert's padding, at most BLOCK_M - 1
    # places after its pairs, as an [E_PAD, J_CHUNK] tile; then the unused tail.
    pad_start = padded_start + counts
    pad_len = padded - counts
    for j0 in tl.static_range(0, BLOCK_M, J_CHUNK):
        j = j0 + tl.arange(0, J_CHUNK)
        tl.store(sorted_ids_ptr + pad_start[:, None] + j[None, :],
                 tl.zeros([E_PAD, J_CHUNK], dtype=tl.int32) + num_pairs,
                 mask=j[None, :] < pad_len[:, None])
    num_post = tl.sum(padded, axis=0)
    for p0 in range(num_post, total, TAIL_CHUNK):
        pos = p0 + tl.arange(0, TAIL_CHUNK)
        tl.store(sorted_ids_ptr + pos, tl.zeros_like(pos) + num_pairs, mask=pos < total)
    # Block b gets the expert whose padded run holds b·BLOCK_M (the last expert past the used
    # length: those blocks return before reading weights).
    for b0 in range(0, total // BLOCK_M, B_CHUNK):
        blk = b0 + tl.arange(0, B_CHUNK)
        owner = tl.sum((padded_end[None, :] <= (blk * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, tl.minimum(owner, num_experts - 1),
                 mask=blk < total // BLOCK_M)


def moe_align_block_size(topk_ids: Tensor, num_experts: int, block_m: int, *,
                         use_kernel: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The (token, slot) pairs of ``topk_ids [T, k]`` sorted by expert, per expert padded to a
    multiple of ``block_m``.

    Returns ``(sorted_ids [P] int32, expert_ids [P / block_m] int32, num_tokens_post_padded [1]
    int32)`` with ``P = max_padded_pairs(T·k, E, block_m)`` rounded up to ``block_m``: entry
    ``i < num_tokens_post_padded`` of ``sorted_ids`` is a flat pair index ``t·k + j`` or the
    sentinel ``T·k`` (padding); block ``b``'s pairs all go to expert ``expert_ids[b]``; pairs of
    one expert keep their flat order. Static shapes, no host sync. ``use_kernel`` picks the one
    Triton program (True) or the torch ops (False); None: the program up to
    ``ALIGN_KERNEL_MAX_PAIRS`` pairs. Both give identical lists.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got {tuple(topk_ids.shape)}")
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    num_pairs = topk_ids.numel()
    total = triton.cdiv(max(max_padded_pairs(num_pairs, num_experts, block_m), 1),
                        block_m) * block_m
    if use_kernel is None:
        use_kernel = num_pairs <= ALIGN_KERNEL_MAX_PAIRS
    if not use_kernel:
        return _align_torch(topk_ids, num_experts, block_m, total)
    device = topk_ids.device
    sorted_ids = torch.empty(total, dtype=torch.int32, device=device)
    expert_ids = torch.empty(total // block_m, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(max(num_experts, 1))
    # Chunks (of pairs, padding columns, blocks) sized so an [x, E_PAD] tile stays <= 4,096
    # entries (32 per thread with 4 warps); the tail is plain stores.
    per_tile = max(1, 4096 // e_pad)
    num_blocks = total // block_m
    _moe_align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, expert_ids, num_post, num_pairs, num_experts, total,
        BLOCK_M=block_m, E_PAD=e_pad,
        CHUNK=min(triton.next_power_of_2(max(num_pairs, 1)), per_tile),
        J_CHUNK=min(triton.next_power_of_2(block_m), per_tile),
        B_CHUNK=min(triton.next_power_of_2(num_blocks), per_tile),
        TAIL_CHUNK=min(triton.next_power_of_2(total), 1024),
        num_warps=4 if e_pad <= 128 else 8)
    return sorted_ids, expert_ids, num_post


def _align_torch(topk_ids: Tensor, num_experts: int, block_m: int,
                 total: int) -> tuple[Tensor, Tensor, Tensor]:
    """``moe_align_block_size`` as torch ops (a sort, cumsums, a scatter, a searchsorted)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert, in flat order
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=device) - count_start[expert_of]
    sorted_ids = torch.full((total,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[padded_start[expert_of] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, total, block_m, device=device)
    # Block b belongs to the expert whose padded run [start, end) holds b·block_m; blocks
    # past the used length get a valid id (they return before reading weights).
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    N, K, num_pairs,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    A_ROW_DIV: tl.constexpr,  # pair -> row of a: t = pair // k for gate-up, the pair for down
    GATED: tl.constexpr,  # gate-up: also read rows N + n of b and write silu(gate) * up
    PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32: float32 means float32)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_post = tl.load(num_post_ptr)
    if pid_m * BLOCK_M >= num_post:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    valid = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_base + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk,
                    mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N]: rows n of w, transposed
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            b_up = tl.load(b_base + (N + offs_n[None, :]).to(tl.int64) * stride_bn
                           + offs_k[:, None] * stride_bk, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
    dtype = c_ptr.dtype.element_ty
    out_mask = valid[:, None] & n_mask[None, :]
    c_rows = pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    if GATED:
        act_dtype = a_ptr.dtype.element_ty
        gate = acc.to(act_dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(act_dtype).to(tl.float32)
        out = act * acc_up.to(act_dtype).to(tl.float32)
        tl.store(c_ptr + c_rows, out.to(dtype), mask=out_mask)
    else:
        act_dtype = a_ptr.dtype.element_ty
        w = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0)
        out = acc.to(act_dtype).to(tl.float32) * w[:, None]
        tl.store(c_ptr + c_rows, out.to(dtype), mask=out_mask)


@triton.jit
def _moe_gemv_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, topk_ids_ptr, N, K,
    stride_am, stride_be, stride_bn, stride_cm,
    A_ROW_DIV: tl.constexpr,  # pair -> row of a: t = pair // k for gate-up, the pair for down
    GATED: tl.constexpr,  # gate-up: also read rows N + n of b and write silu(gate) * up
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The per-pair path: program ``(pair, n)`` streams rows ``n`` of the pair's expert
    (``b``'s last dim contiguous) against one row of ``a``; float32 products and sums."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    a_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = b_ptr + expert * stride_be + offs_n.to(tl.int64)[:, None] * stride_bn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        b_mask = n_mask[:, None] & k_mask[None, :]
        b = tl.load(rows + offs_k[None, :], mask=b_mask, other=0.0)
        acc += tl.sum(b.to(tl.float32) * a[None, :], axis=1)
        if GATED:
            b_up = tl.load(rows + N * stride_bn + offs_k[None, :], mask=b_mask, other=0.0)
            acc_up += tl.sum(b_up.to(tl.float32) * a[None, :], axis=1)
    act_dtype = a_ptr.dtype.element_ty
    c_row = c_ptr + pair.to(tl.int64) * stride_cm + offs_n
    if GATED:
        gate = acc.to(act_dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(act_dtype).to(tl.float32)
        out = act * acc_up.to(act_dtype).to(tl.float32)
    else:
        out = acc.to(act_dtype).to(tl.float32) * tl.load(topk_weights_ptr + pair)
    tl.store(c_row, out.to(c_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _moe_combine_kernel(src_ptr, out_ptr, hidden, stride_src, stride_out,
                        TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[t] = sum_j src[t·k + j]`` in float32 (slot order), rounded once to out's dtype."""
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(src_ptr + (tok * TOP_K + j) * stride_src + offs, mask=mask, other=0.0)
    tl.store(out_ptr + tok * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def uses_alignment(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a pass of ``num_tokens`` sorts its pairs by expert (the grouped GEMMs) or runs
    one program per (token, slot) pair: per pair while ``T·k·4 <= E``, where pairs rarely share
    an expert, so the alignment would buy almost no weight reuse for its launch."""
    return num_tokens * top_k * 4 > num_experts


#: Rows of an expert per program on the per-pair path: 16 rows give 30B-A3B at T=1 8 x 48
#: gate-up and 8 x 128 down programs (>= 2 waves of 132 SMs) while each load is still
#: ``16 x BLOCK_K`` elements (8 KB at bf16) in flight.
GEMV_BLOCK_N = 16


def _gemv_block_k(k: int, dtype: torch.dtype, gated: bool) -> int:
    """``BLOCK_K`` of the per-pair path: the whole row up to 256 elements for the gated
    program (two tiles in flight), 512 for down; half that at float32 (same bytes)."""
    cap = (256 if gated else 512) // (2 if dtype == torch.float32 else 1)
    return max(16, min(cap, triton.next_power_of_2(k)))


def block_m_for(num_pairs: int) -> int:
    """``BLOCK_M``: small for decode-sized batches (little padding per expert), larger when
    each expert gets many rows."""
    return 16 if num_pairs <= 256 else 64


def _gated_num_warps(precision: str, block_m: int) -> int:
    """Warps of the gated (gate and up) GEMM: its two fp32 accumulators with "ieee" dots at
    ``BLOCK_M`` 64 spill on Triton 3.6 with 4 warps (255 registers, up to 1.7 KB on sm_100a);
    8 warps halve each thread's share (184 / 148 registers, no spill). Everything else keeps
    Triton's default 4 (scripts/compile_kernels.py checks both Tritons)."""
    return 8 if precision == "ieee" and block_m >= 64 else 4


def _gemm_num_stages(block_m: int, dtype: torch.dtype) -> int:
    """Software-pipelining depth of the grouped GEMMs: at ``BLOCK_M`` 16 (batched decode /
    verify sizes) a 16-bit stage is small (16 x 64 of ``x`` and one or two 64 x 64 weight
    tiles, 18 KB), so 4 stages keep three weight tiles in flight per program where Triton's
    default 3 keeps two (4 blocks/SM by shared memory on sm_90a, scripts/compile_kernels.py).
    float32 stages are twice the bytes (4 stages: 110 KB, 2 blocks/SM) and the prefill tile
    is compute-bound: both keep the default."""
    return 4 if block_m <= 16 and dtype != torch.float32 else 3


def _block_nk(n: int, k: int) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)``; ``tl.dot`` needs every side ≥ 16."""
    return (max(16, min(64, triton.next_power_of_2(n))),
            max(16, min(64, triton.next_power_of_2(k))))


def _check(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_i, hidden = w13.shape
    if two_i % 2 or x.shape[1] != hidden or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)} "
                         f"(gate then up rows), w2 {tuple(w2.shape)} (want "
                         f"{(num_experts, hidden, two_i // 2)})")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape \
            or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [T={x.shape[0]}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if x.dtype not in _DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"x, w13 and w2 must share one float dtype, got {x.dtype}, "
                        f"{w13.dtype}, {w2.dtype}")
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 must be contiguous along their last dim")


#: Tokens per launch group: a longer pass (a prefill chunk) runs in groups of this many, so the
#: float32 ``[T·k, H]`` buffer before the combine stays bounded (4,096 x 8 x 4,096 x 4 B =
#: 512 MiB at 235B-A22B); each group still reads every expert it touches once.
MAX_CHUNK_TOKENS = 4096


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              max_chunk_tokens: int = MAX_CHUNK_TOKENS) -> Tensor:
    """``x [T, H]`` through the experts ``topk_ids [T, k]`` weighted by ``topk_weights [T, k]``
    (float32) → ``[T, H]`` in ``x``'s dtype (``reference_moe.fused_moe``), in groups of at most
    ``max_chunk_tokens`` tokens."""
    _check(x, w13, w2, topk_weights, topk_ids)
    if max_chunk_tokens < 1:
        raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
    num_tokens = x.shape[0]
    if num_tokens <= max_chunk_tokens:
        return _fused_moe_group(x, w13, w2, topk_weights, topk_ids)
    out = torch.empty_like(x)
    for lo in range(0, num_tokens, max_chunk_tokens):
        hi = min(num_tokens, lo + max_chunk_tokens)
        out[lo:hi] = _fused_moe_group(x[lo:hi], w13, w2, topk_weights[lo:hi],
                                      topk_ids[lo:hi])
    return out


def _fused_moe_group(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor,
                     topk_ids: Tensor) -> Tensor:
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    weights = topk_weights.contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    if not uses_alignment(num_tokens, top_k, num_experts):
        ids = topk_ids.contiguous()
        bn = GEMV_BLOCK_N
        _moe_gemv_kernel[(num_pairs, triton.cdiv(inter, bn))](
            x, w13, act, weights, ids, inter, hidden,
            x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
            A_ROW_DIV=top_k, GATED=True, BLOCK_N=bn,
            BLOCK_K=_gemv_block_k(hidden, x.dtype, True))
        _moe_gemv_kernel[(num_pairs, triton.cdiv(hidden, bn))](
            act, w2, out, weights, ids, hidden, inter,
            act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
            A_ROW_DIV=1, GATED=False, BLOCK_N=bn, BLOCK_K=_gemv_block_k(inter, x.dtype, False))
    else:
        block_m = block_m_for(num_pairs)
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        stages = _gemm_num_stages(block_m, x.dtype)
        sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts, block_m)
        num_blocks = expert_ids.shape[0]
        bn, bk = _block_nk(inter, hidden)
        _moe_gemm_kernel[(num_blocks, triton.cdiv(inter, bn))](
            x, w13, act, weights, sorted_ids, expert_ids, num_post, inter, hidden, num_pairs,
            x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
            A_ROW_DIV=top_k, GATED=True, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=bn,
            BLOCK_K=bk, num_warps=_gated_num_warps(precision, block_m), num_stages=stages)
        bn, bk = _block_nk(hidden, inter)
        _moe_gemm_kernel[(num_blocks, triton.cdiv(hidden, bn))](
            act, w2, out, weights, sorted_ids, expert_ids, num_post, hidden, inter, num_pairs,
            act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
            A_ROW_DIV=1, GATED=False, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=bn,
            BLOCK_K=bk, num_stages=stages)
    # The combine: each token's k weighted expert outputs, summed in float32, rounded once.
    result = torch.empty_like(x, memory_format=torch.contiguous_format)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _moe_combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        out, result, hidden, out.stride(0), result.stride(0), TOP_K=top_k, BLOCK_H=block_h)
    return result


def moe_forward(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int,
                renormalize: bool) -> Tensor:
    """Routing then the expert sum (``reference_moe.moe_forward``)."""
    if router_logits.shape != (x.shape[0], w13.shape[0]):
        raise ValueError(f"router_logits must be [T={x.shape[0]}, E={w13.shape[0]}], got "
                         f"{tuple(router_logits.shape)}")
    weights, ids = topk_softmax(router_logits, top_k, renormalize)
    return fused_moe(x, w13, w2, weights, ids)


#: (label, H, I) of the MoE shapes compiled ahead of time (E = 128 experts, top-8)
AOT_SHAPES = (("Qwen3-30B-A3B", 2048, 768), ("Qwen3-235B-A22B", 4096, 1536))


def aot_configs() -> list[tuple[str, Callable[[], object]]]:
    """``scripts/compile_kernels.py``'s configurations at the Qwen3-MoE shapes, bf16 and fp32:
    1 and 4 tokens (the per-pair path: ``T·k·4 <= E``), 16 tokens (128 pairs: the alignment
    program and ``BLOCK_M`` 16, a batched decode / verify step), 64 tokens (512 pairs: the
    alignment program at ``BLOCK_M`` 64) and 256 tokens (2,048 pairs: the torch alignment and
    ``BLOCK_M`` 64, prefill)."""
    num_experts, top_k = 128, 8

    def call(dtype: torch.dtype, tokens: int, hidden: int, inter: int) -> Callable[[], object]:
        def run() -> object:
            def meta(*shape: int, dtype: torch.dtype = dtype) -> Tensor:
                return torch.empty(*shape, dtype=dtype, device="meta")

            return moe_forward(meta(tokens, hidden), meta(tokens, num_experts),
                               meta(num_experts, 2 * inter, hidden),
                               meta(num_experts, hidden, inter), top_k, True)

        return run

    out: list[tuple[str, Callable[[], object]]] = []
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for model, hidden, inter in AOT_SHAPES:
            for tokens in (1, 4, 16, 64, 256):
                out.append((f"{name} {model} E={num_experts} top-{top_k} T={tokens}",
                            call(dtype, tokens, hidden, inter)))
    return out
