"""Triton paged attention: prefill, decode and speculative verification in one kernel.

Specification: ``kernels/reference.py::paged_attention`` (docs/design.md §5-§6). One program handles
(sequence, query tile, kv head, kv split). A query tile is ``QT`` consecutive queries of one
sequence times the ``GROUP`` q heads sharing the kv head, flattened into ``BLOCK_M`` rows
(row r = query ``r // GROUP``, head ``r % GROUP``), so each K/V tile is loaded once per group.
The program walks the keys in ``BLOCK_N`` tiles gathered through the block table: first the
tiles lying wholly in the context (no mask at all), then the tail holding the new tokens, where
the causal rule or the packed tree bits apply. Online softmax in float32 with exp2 (the scale is
pre-multiplied by log2 e). With ``num_splits > 1`` each program covers an even slice of the key
tiles and writes a partial result and its log-sum-exp; the last split of each (tile, kv head) to
finish (a counter from ``attention_combine.split_counters``) merges them in the same launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_checks import as_count, check_inputs, query_run_bounds
from .attention_combine import default_num_splits, split_counters
from .debug import check_values_now

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start, k_base, v_base, bt_row, stride_kb, stride_kt, stride_vb, stride_vt,
    ctx, kv_len, qi, mask_rows, stride_mw, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr, TREE: tl.constexpr, IEEE: tl.constexpr,
):
    offs_n = start + tl.arange(0, BLOCK_N)  # key positions in the sequence
    offs_d = tl.arange(0, HEAD_DIM)
    # Gather per key: its page from the block table, then its slot inside the page. This works
    # whether a tile spans several pages (small block_size) or part of one.
    if MASKED:
        in_range = offs_n < kv_len
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
    slot_in = (offs_n % BLOCK_SIZE).to(tl.int64)
    k_off = page * stride_kb + slot_in * stride_kt  # [BLOCK_N]
    v_off = page * stride_vb + slot_in * stride_vt
    if MASKED:
        kt = tl.load(k_base + k_off[None, :] + offs_d[:, None], mask=in_range[None, :], other=0.0)
    else:
        kt = tl.load(k_base + k_off[None, :] + offs_d[:, None])  # [D, BLOCK_N]
    if IEEE:
        # fp32 inputs: plain tf32 would miss the fp32 tolerance, and "ieee" runs on FMA units
        # with whole head_dim rows per thread (it spills at any tile size). tf32x3 keeps ~fp32
        # accuracy on tensor cores (three tf32 products: hi*hi + hi*lo + lo*hi).
        s = tl.dot(q, kt, input_precision="tf32x3")
    else:
        s = tl.dot(q, kt)
    s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        j = offs_n - ctx  # index among the new tokens; negative = context key, always visible
        if TREE:
            jj = tl.maximum(j, 0)
            need = (j >= 0) & in_range
            words = tl.load(mask_rows[:, None] + (jj // 32)[None, :] * stride_mw,
                            mask=need[None, :], other=0)  # [BLOCK_M, BLOCK_N] int32
            allowed = ((words >> (jj % 32)[None, :]) & 1) != 0
        else:
            allowed = j[None, :] <= qi[:, None]
        visible = ((j < 0)[None, :] | allowed) & in_range[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen no visible key yet keep m = -inf; subtracting 0 instead avoids
    # (-inf) - (-inf) = NaN and leaves their p (and alpha) exactly 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
    else:
        v = tl.load(v_base + v_off[:, None] + offs_d[None, :])  # [BLOCK_N, D]
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="tf32x3")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, fin_ptr, count_ptr, bt_ptr, ctx_ptr, indptr_ptr,
    mask_ptr, qk_scale, num_splits, n_q_tiles,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_ft, stride_fh, stride_bt,
    stride_mt, stride_mw,
    GROUP: tl.constexpr, QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TREE: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, MERGE_D: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid // n_q_tiles
    q0 = (pid % n_q_tiles) * QT  # first query of this tile, within the sequence
    q_start = tl.load(indptr_ptr + seq)
    q_len = tl.load(indptr_ptr + seq + 1) - q_start
    if q0 < q_len:  # tiles past a short sequence's queries (and q_len 0) do nothing
        ctx = tl.load(ctx_ptr + seq)
        kv_len = ctx + q_len
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        qi = q0 + offs_m // GROUP  # [BLOCK_M] query index within the sequence
        head = kvh * GROUP + offs_m % GROUP  # [BLOCK_M] q head
        row_ok = (offs_m < QT * GROUP) & (qi < q_len)
        tok = (q_start + qi).to(tl.int64)  # [BLOCK_M] row of q / out
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
        # [BLOCK_M] pointers to the packed mask rows; padding rows reuse a real row (in bounds)
        mask_rows = mask_ptr + tl.where(row_ok, tok, q_start.to(tl.int64)) * stride_mt

        # Causal: new tokens after this tile's last query are invisible to all its rows, so
        # the walk stops there. A tree row may see any earlier node, so it walks all of them.
        if TREE:
            end = kv_len
        else:
            end = ctx + tl.minimum(q0 + QT, q_len)
        n_tiles = tl.cdiv(end, BLOCK_N)
        # Even splits: each gets floor or ceil of n_tiles / num_splits tiles (a ceil-sized
        # share per split left the last ones empty: 13 of 16 at 50 tiles).
        lo = split * n_tiles // num_splits
        hi = (split + 1) * n_tiles // num_splits
        n_plain = ctx // BLOCK_N  # tiles wholly inside the context: no mask needed

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        k_base = k_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + kvh.to(tl.int64) * stride_vh
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        for t in range(lo, tl.minimum(hi, n_plain)):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, t * BLOCK_N, k_base, v_base, bt_row, stride_kb, stride_kt,
                stride_vb, stride_vt, ctx, kv_len, qi, mask_rows, stride_mw, qk_scale,
                BLOCK_N, HEAD_DIM, BLOCK_SIZE, False, TREE, IEEE)
        for t in range(tl.maximum(lo, n_plain), hi):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, t * BLOCK_N, k_base, v_base, bt_row, stride_kb, stride_kt,
                stride_vb, stride_vt, ctx, kv_len, qi, mask_rows, stride_mw, qk_scale,
                BLOCK_N, HEAD_DIM, BLOCK_SIZE, True, TREE, IEEE)

        # A row that saw nothing (an empty split, or a tree row with no bits) has l = 0: write
        # 0 rather than NaN so the combine can weight it out.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = (out_ptr + split.to(tl.int64) * stride_os + tok[:, None] * stride_ot
                  + head[:, None] * stride_oh + offs_d[None, :])
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if SPLIT:
            lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)),
                           float("-inf"))
            tl.store(lse_ptr + split * stride_ls + tok * stride_lt + head, lse, mask=row_ok)
            # The combine, folded in: the last split of this (tile, kv head) to finish merges
            # all of them. The barrier orders every thread's partial stores before the
            # counter's release; the acq_rel increment makes the others' visible to the last.
            tl.debug_barrier()
            counter = count_ptr + pid * tl.num_programs(1) + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                tl.store(counter, 0)  # ready for the next launch (no other split touches it)
                _merge_splits(out_ptr, lse_ptr, fin_ptr, num_splits, tok, head, row_ok,
                              stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                              stride_ft, stride_fh, BLOCK_M, HEAD_DIM, MERGE_D)


@triton.jit
def _merge_splits(part_ptr, lse_ptr, fin_ptr, num_splits, tok, head, row_ok,
                  stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ft, stride_fh,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_CHUNK: tl.constexpr):
    """``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)``, ``M = max_s lse_s``, for this
    tile's rows, ``D_CHUNK`` columns at a time (the fp32 tiles have no registers for a whole
    second ``[BLOCK_M, HEAD_DIM]`` accumulator and its pointers). Loads bypass L1 (``.cg``):
    the other splits wrote from other SMs."""
    lse_rows = lse_ptr + tok * stride_lt + head
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(lse_rows + s * stride_ls, mask=row_ok, other=float("-inf"),
                                  cache_modifier=".cg"))
    # A row no split saw (fully masked) has M = -inf: weight 0 everywhere, output 0. Empty
    # splits stored zeros (never NaN), so their 0 weights cannot poison the sum.
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([BLOCK_M], tl.float32)
    for s in range(num_splits):
        denom += tl.math.exp2(tl.load(lse_rows + s * stride_ls, mask=row_ok,
                                      other=float("-inf"), cache_modifier=".cg") - m_safe)
    denom = tl.where(denom == 0.0, 1.0, denom)
    for d0 in tl.static_range(0, HEAD_DIM, D_CHUNK):
        offs_d = d0 + tl.arange(0, D_CHUNK)
        part_rows = (part_ptr + tok[:, None] * stride_pt + head[:, None] * stride_ph
                     + offs_d[None, :])
        acc = tl.zeros([BLOCK_M, D_CHUNK], tl.float32)
        for s in range(num_splits):
            w = tl.math.exp2(tl.load(lse_rows + s * stride_ls, mask=row_ok,
                                     other=float("-inf"), cache_modifier=".cg") - m_safe)
            part = tl.load(part_rows + s * stride_ps, mask=row_ok[:, None], other=0.0,
                           cache_modifier=".cg")
            acc += part * w[:, None]
        out = acc / denom[:, None]
        tl.store(fin_ptr + tok[:, None] * stride_ft + head[:, None] * stride_fh
                 + offs_d[None, :], out.to(fin_ptr.dtype.element_ty), mask=row_ok[:, None])


@dataclass(frozen=True)
class Tiles:
    """Launch shape of ``_paged_attention_kernel``; see ``tiles``."""

    block_m: int  # rows per program: QT queries x GROUP heads (>= 16 for tl.dot)
    qt: int  # queries per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int = 3  # Triton's default software-pipelining depth


def tiles(max_q_len: int, group: int, head_dim: int, ieee: bool, tree: bool) -> Tiles:
    """The launch shape for these sizes (the one function that picks it: the launcher and
    ``scripts/compile_kernels.py``, which checks it compiles without spills, both use it)."""
    # Rows = queries x group heads. tl.dot needs >= 16 rows; beyond 64 rows (32 at D=256) the
    # fp32 accumulator no longer fits in registers comfortably.
    cap = 32 if head_dim >= 256 else 64
    block_n = 32 if head_dim >= 256 else 64
    if ieee:
        # fp32 tiles (tf32x3 dots) hold twice the bytes of bf16 ones plus the hi/lo halves of
        # each operand: at 64 x 64 they spill, at 32 x 32 they fit (scripts/compile_kernels.py).
        cap, block_n = cap // 2, block_n // 2
    elif tree:
        # A tree tile also holds its [BLOCK_M, BLOCK_N] mask words: at 64 rows (16 nodes x 4
        # heads) it needed 8 warps, 180-208 registers and 98.8 KB of shared memory, one block
        # per SM, so each tile's loads and its dots ran one after the other. 32 rows fit 2
        # blocks per SM at 4 warps (~200 registers, 52.5 KB) without spills on Triton 3.6 and
        # 3.9 (scripts/compile_kernels.py; benchmarks/RESULTS.md, issue 35); the two query
        # tiles of a sequence are adjacent programs, so the second read of each K/V tile is
        # mostly an L2 hit.
        cap = min(cap, 32)
    block_m = min(max(16, triton.next_power_of_2(max(max_q_len, 1) * group)), cap)
    block_m = max(block_m, triton.next_power_of_2(group))  # at least one whole query per tile
    # A tree tile also holds its [BLOCK_M, BLOCK_N] mask words: at 64 x 128 rows that tips
    # sm_100a into spilling with 4 warps, so it gets 8 like the larger tiles.
    rows = block_m * head_dim
    num_warps = 8 if rows > 64 * 128 or (tree and rows >= 64 * 128) else 4
    # Pipeline depth: the default 3 keeps two K/V tiles in flight, which on Triton 3.6 (what
    # torch 2.11 installs) spills the fp32 tiles (tf32x3 holds hi/lo copies of each operand)
    # and the 16-row tree tile on sm_90a; Triton 3.9 fits them all. 2 stages fit the 32-row
    # fp32 tiles (249 registers); the 16-row fp32 decode tile still spills at 2 and fits at 1
    # (186 registers, 2 blocks/SM); the 16-row bf16 tree tile fits at 2 (163 registers).
    # Everything else keeps the default (scripts/compile_kernels.py checks both Tritons).
    num_stages = 3
    if ieee:
        num_stages = 2 if block_m > 16 else 1
    elif tree and block_m <= 16:
        num_stages = 2
    return Tiles(block_m, max(1, block_m // group), block_n, num_warps, num_stages)


def paged_attention(
    q: Tensor,  # [T, Hq, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: Tensor,  # [B] int32: tokens cached before this step's queries
    qo_indptr: Tensor,  # [B+1] int32
    tree_mask: Tensor | None,  # [T, >= ceil(max_q_len/32)] int32 packed bits; None = causal
    scale: float,
    *,
    max_q_len: int | None = None,
    num_splits: int | None = None,
) -> Tensor:  # [T, Hq, D], dtype of q
    """Ragged paged attention with the semantics of ``reference.paged_attention``.

    ``max_q_len`` is an upper bound on every sequence's query count. Given, the call reads no
    device value (it can be captured in a CUDA graph) unless ``debug.value_checks`` are on,
    which then validate ``qo_indptr`` and the bound (skipped under graph capture). None makes
    the launcher compute it from ``qo_indptr``: one blocking device->host copy per call.
    ``num_splits`` forces the split-KV factor (default: a heuristic from shapes). A query row
    that may see no key at all (only possible with a tree row without bits and no context)
    yields 0 where the reference yields NaN. Output rows of tokens past ``qo_indptr[-1]`` are
    left unwritten, as in the reference.
    """
    check_inputs(q, k_cache, v_cache, block_tables, context_lens, qo_indptr, tree_mask)
    num_tokens, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    group = hq // hkv
    max_q_len = as_count("max_q_len", max_q_len, minimum=0)
    num_splits = as_count("num_splits", num_splits, minimum=1)
    if max_q_len is None:
        # The caller asked us to find it: one device->host copy, which also checks qo_indptr.
        max_q_len = query_run_bounds(qo_indptr, num_tokens, None)
    elif check_values_now():
        query_run_bounds(qo_indptr, num_tokens, max_q_len)
    if tree_mask is not None and tree_mask.shape[1] < (max_q_len + 31) // 32:
        raise ValueError(f"tree_mask needs >= {(max_q_len + 31) // 32} words per row for "
                         f"max_q_len={max_q_len}, got {tree_mask.shape[1]}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")

    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, Hq, D]
    if num_tokens == 0 or num_seqs == 0 or max_q_len == 0:
        return out
    ieee = q.dtype == torch.float32
    shape = tiles(max_q_len, group, d, ieee, tree_mask is not None)
    block_m, qt, block_n = shape.block_m, shape.qt, shape.block_n
    n_q_tiles = triton.cdiv(max_q_len, qt)
    if num_splits is None:
        max_kv_tiles = triton.cdiv(block_tables.shape[1] * block_size, block_n)
        num_splits = default_num_splits(q.device, num_seqs * n_q_tiles * hkv, max_kv_tiles)
    split = num_splits > 1
    grid = (num_seqs * n_q_tiles, hkv, num_splits)
    if split:
        part = torch.empty(num_splits, num_tokens, hq, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, num_tokens, hq, dtype=torch.float32, device=q.device)
        dst, lse_arg = part, lse  # [S, T, Hq, D], [S, T, Hq]
        stride_os, stride_ls, stride_lt = part.stride(0), lse.stride(0), lse.stride(1)
        counts = split_counters(q.device, grid[0] * grid[1])
    else:
        dst, lse_arg, counts = out, out, out  # lse and counters unused (SPLIT is False)
        stride_os, stride_ls, stride_lt = 0, 0, 0
    mask_arg = tree_mask if tree_mask is not None else block_tables  # dummy pointer when causal
    stride_mt = tree_mask.stride(0) if tree_mask is not None else 0
    stride_mw = tree_mask.stride(1) if tree_mask is not None else 0
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, dst, lse_arg, out, counts, block_tables, context_lens, qo_indptr,
        mask_arg, scale * _LOG2E, num_splits, n_q_tiles,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        stride_os, dst.stride(-3), dst.stride(-2), stride_ls, stride_lt,
        out.stride(0), out.stride(1), block_tables.stride(0), stride_mt, stride_mw,
        GROUP=group, QT=qt, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d,
        BLOCK_SIZE=block_size, TREE=tree_mask is not None, SPLIT=split,
        IEEE=ieee, MERGE_D=min(d, 32), num_warps=shape.num_warps,
        num_stages=shape.num_stages,
    )
    return out
