"""Fused lossless rejection sampling (docs/design.md §6): Triton kernels + launcher.

Specification and RNG counter layout: ``reference.rejection_sample``; results are identical for
the same inputs and seeds. Two launches, no host sync (CUDA-graph capturable):

1. ``_row_kernel``, one program per (request, row / tree node) that the step can reach:
   * greedy row: 1 pass over V (argmax, max, sum of exp) — logprobs are raw log-softmax;
   * sampled row: pass 1 (per tile of 2,048 tokens: its largest z and exact integer mass,
     which give the row's max and sum of exp, and two tile races (``reference.draw_tile``):
     plain and without the row's children's tokens; the min); with min-p, one pass for its
     cut (the
     smallest z >= max(z) + log(min_p), its mass and count); with top-k / top-p (applied after
     min-p, vLLM's order), a threshold search each (``threshold_search``: one counting pass
     over the row, then over only the candidates it leaves, compacted into a per-row scratch
     buffer; bisection over value space, never a sort);
     then the tile races again over the kept set (``tile_pass``) only if the cut removed a
     token or the row's sampled draft (``draft_probs``) was rejected (residual max(p - q, 0),
     reads q too; q over a drafter's own vocabulary is read through ``draft_index``, 0 off
     it); last, the token race inside the winning tile (``race_in_tile``: 2,048 tokens).
   It stores per row the token emitted if the walk ends there and, per child, p_row(x_child).
   A sampled tree's row (``draft_probs`` with a tree) also judges its children by recursive
   rejection sampling (``_sampled_children``: one more pass over the row per rejected child,
   for the residual's total) and stores the child it keeps; its end token is a draw of the
   last residual when a child was rejected.
2. ``_walk_kernel``, one program per request: chain = first rejected draft; tree = the
   child-by-child walk on residuals (tiny: O(N) scalar steps per accepted token), or for a
   sampled tree the children the rows kept.

At small batch (rows fewer than about 2 per SM, ``default_vocab_parts``) three launches run
before the row kernel, each over (row, vocabulary part) programs: ``_part_kernel`` (pass 1),
``_search_pivot_kernel`` and ``_search_snap_kernel`` (the first pass of the row's first
top-k / top-p search, its snap and the compaction into the row's buffer). Their partials merge
exactly (maxima, minima, race keys, integer counts and masses), so the row kernel's search
goes on from the state one program would have reached, and draws the same tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .debug import check_values_now
from .sampling_checks import validate_inputs
from .sampling_pass import (
    INV_MASS_SCALE,
    NEG_INF,
    SEARCH_CAP,
    SEARCH_CAP_ENTRIES,
    SEARCH_P,
    SPLIT_FLOATS,
    SPLIT_INTS,
    TILES_MAX,
    acceptance_uniform,
    first_pass,
    first_pass_part,
    greedy_pass,
    greedy_pass_part,
    keep_cut,
    merge_parts,
    merged_max_min,
    q_at,
    race_in_tile,
    residual_total,
    row_tile_scratch,
    seed_key,
    sibling_residual,
    split_first_search,
    split_pivot_part,
    split_snap_part,
    tile_pass,
    tile_races,
)

# Search-pass tile [P, SBLOCK]: on GPUs one token per lane (32 * num_warps), so each lane
# holds all P pivots of its own tokens (sampling_pass._pivot_tile); large in the CPU
# interpreter (fewer numpy ops).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_SBLOCK = 1024 if _INTERPRET else 128
_SBLOCK_TREE = _SBLOCK


@triton.jit
def _row_reached(num_draft_ptr, b, j, N, IS_TREE: tl.constexpr):
    """Row ``j`` of sequence ``b`` in the verify pass: its drafts ``n`` and whether the walk
    can reach the row (a chain's rows past the bonus row, a tree's when the sequence drafted
    nothing, are never read)."""
    n = tl.minimum(tl.maximum(tl.load(num_draft_ptr + b).to(tl.int32), 0), N - 1)
    if IS_TREE:
        live = (j == 0) | (n > 0)
    else:
        live = j <= n
    return live, n


@triton.jit
def _row_position(parents_ptr, offset_ptr, b, j, N, IS_TREE: tl.constexpr):
    """The position row ``j``'s token sits at past sequence ``b``'s offset (its depth in the
    tree, its index in a chain): the counter its random numbers are drawn at. Called inside
    the reached branch only: walked for every row, the loop's registers spill in the part
    kernel on sm_90a (8 B)."""
    depth = j * 0
    if IS_TREE:
        node = j
        while (node > 0) & (depth < N):
            node = tl.load(parents_ptr + node).to(tl.int32)
            depth += 1
    else:
        depth = j
    return tl.load(offset_ptr + b).to(tl.int64) + depth


@triton.jit
def _sampled_children(row_ptr, q_tree_ptr, s_qn, map_ptr, sib_f_ptr, sib_i_ptr, draft_row_ptr,
                      parents_ptr, k0, k1, pos, j, N, V, inv_t, tau, m, s, argmax, greedy,
                      HAS_MAP: tl.constexpr):
    """Row ``j``'s children drawn from their q without replacement, judged one after another by
    recursive rejection sampling (``reference._sampled_children``, the same float32
    operations): (the child kept, 0 if none; 1 if a child was rejected). Child ``c`` was drawn
    from ``Q_c = q_c`` off the earlier valid siblings' tokens, ``/ D_c``; it is kept iff
    ``u·Q_c(x)·z <= r(x)``, and a rejection makes ``r = max(r - z·Q_c, 0)``, ``z = sum(r)``
    (one pass over the row, in fixed point: ``residual_total``). Per child it stores its flags
    (1: valid, so its token is taken; 2: its rejection changed r), ``z`` and ``D`` for
    ``sibling_residual``, which recomputes r at any token from them. Greedy rows keep the first
    child that is the argmax."""
    lane = tl.arange(0, 16)  # x's values on a small block (sibling_residual works on blocks)
    every = lane >= 0
    pick = j * 0
    rejected = j * 0
    total = m * 0.0 + 1.0  # z: the unnormalised residual's total
    left = total  # D: 1 - q at the earlier valid siblings' tokens
    for c in range(1, N):
        if tl.load(parents_ptr + c) == j:
            x = tl.minimum(tl.maximum(tl.load(draft_row_ptr + c - 1), 0), V - 1)
            at = x + lane * 0
            zx = tl.load(row_ptr + at).to(tl.float32) * inv_t
            px = tl.where(zx >= tau, tl.exp(zx - m) / s, 0.0)
            r_x, taken_x = sibling_residual(px, at, every, q_tree_ptr, s_qn, map_ptr, sib_f_ptr,
                                            sib_i_ptr, draft_row_ptr, parents_ptr, j, c, V,
                                            HAS_MAP)
            q_raw = tl.max(q_at(q_tree_ptr + (c - 1) * s_qn, at, every, map_ptr, HAS_MAP), 0)
            d = tl.maximum(left, 1e-30)
            qx = tl.where(tl.max(taken_x.to(tl.int32), 0) > 0, 0.0, q_raw) / d
            open_ = pick == 0
            valid = open_ & (qx > 0)  # Q_c(x) = 0: not drawn from Q_c, skipped
            u = acceptance_uniform(k0, k1, pos, c)
            ok = tl.where(greedy, open_ & (x == argmax), valid & (u * qx * total <= tl.max(r_x, 0)))
            flags = valid.to(tl.int32)
            if valid & (ok == 0) & (greedy == 0):  # rejected: r = max(r - z·Q_c, 0)
                tl.store(sib_f_ptr + 2 * c, total)
                tl.store(sib_f_ptr + 2 * c + 1, d)
                tl.store(sib_i_ptr + c, 3)
                tl.debug_barrier()
                new_total = residual_total(row_ptr, q_tree_ptr, s_qn, map_ptr, sib_f_ptr,
                                           sib_i_ptr, draft_row_ptr, parents_ptr, j, c + 1, V,
                                           inv_t, tau, m, s, HAS_MAP)
                if new_total > 0:  # else r stays as it was (no mass left to move)
                    total = new_total.to(tl.float32) * INV_MASS_SCALE
                    flags = flags * 0 + 3
                rejected = rejected * 0 + 1
            tl.store(sib_i_ptr + c, flags)
            tl.debug_barrier()
            pick = tl.where(ok, c, pick)
            left = tl.where(valid, left - q_raw, left)
    return pick, rejected


@triton.jit
def _row_kernel(logits_ptr, s_lb, s_ln, draft_ptr, s_db, num_draft_ptr, q_ptr, s_qb, s_qn,
                map_ptr, buf_ptr, temp_ptr, inv_t_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr,
                offset_ptr, parents_ptr, tok_end_ptr, lp_end_ptr, p_child_ptr, lp_child_ptr,
                acc_ptr, part_f_ptr, part_i_ptr, search_i_ptr, search_f_ptr, tile_f_ptr,
                tile_i_ptr, sib_f_ptr, sib_i_ptr, C, N, V, HAS_Q: tl.constexpr,
                HAS_MAP: tl.constexpr, IS_TREE: tl.constexpr, SIBLINGS: tl.constexpr,
                HAS_MIN_P: tl.constexpr,
                SPLIT: tl.constexpr, P: tl.constexpr, SBLOCK: tl.constexpr,
                GBLOCK: tl.constexpr, TB: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // N
    j = pid % N
    live, n = _row_reached(num_draft_ptr, b, j, N, IS_TREE)
    if live:
        b64 = b.to(tl.int64)
        row_ptr = logits_ptr + b64 * s_lb + j.to(tl.int64) * s_ln
        draft_row_ptr = draft_ptr + b64 * s_db
        at = b64 * N
        if SIBLINGS:  # the sequence's q rows: child c's at (c - 1) * s_qn
            q_row_ptr = q_ptr + b64 * s_qb
        else:  # the q of row j's one (chain) child
            q_row_ptr = q_ptr + b64 * s_qb + j.to(tl.int64) * s_qn
        sib_f = sib_f_ptr + 2 * at
        sib_i = sib_i_ptr + at
        pos = _row_position(parents_ptr, offset_ptr, b, j, N, IS_TREE)
        k0, k1 = seed_key(seed_ptr, b)
        inv_t = tl.load(inv_t_ptr + b)
        temp = tl.load(temp_ptr + b)
        greedy = temp == 0
        sampled = temp != 0
        tau = NEG_INF + inv_t * 0.0
        # the row's scratch for its tiles' statistics (sampled rows)
        tile_f, tile_i = row_tile_scratch(tile_f_ptr, tile_i_ptr, pid, V)
        if greedy:
            if SPLIT:  # pass 1 ran in C parts (_part_kernel)
                m, s, i1 = merge_parts(part_f_ptr + pid.to(tl.int64) * C * 5,
                                       part_i_ptr + pid.to(tl.int64) * C * 2, C)
            else:
                m, s, i1 = greedy_pass(row_ptr, V, GBLOCK)
            i2 = i1
            s_tau = s
            zmin = m
        else:
            if SPLIT:  # pass 1 ran in C parts, which stored the tiles' statistics
                _, zmin = merged_max_min(part_f_ptr + pid.to(tl.int64) * C * 5, C)
                m, s, i1, i2 = tile_races(tile_f, tile_i, V, k0, k1, pos, j, j * 0 + 1, TB)
            else:
                m, s, zmin, i1, i2 = first_pass(row_ptr, draft_row_ptr, parents_ptr, k0, k1, pos,
                                                j, n, N, V, inv_t, tile_f, tile_i, IS_TREE, TB)
            tau, s_tau = keep_cut(row_ptr, buf_ptr + pid.to(tl.int64) * SEARCH_CAP, V, inv_t, m,
                                  s, zmin, top_k_ptr, top_p_ptr, min_p_ptr, b,
                                  search_i_ptr + pid.to(tl.int64) * C * (2 * P + 2),
                                  search_f_ptr + pid.to(tl.int64) * C * 3, C, HAS_MIN_P, P,
                                  SBLOCK, GBLOCK, SPLIT)
        log_s = tl.log(s_tau)

        # p_j(x_c) for each child c judged at this row; chains also decide acceptance here.
        rejected_q = j < 0  # False
        if IS_TREE:
            if n > 0:
                for c in range(1, N):
                    if tl.load(parents_ptr + c) == j:
                        x = tl.minimum(tl.maximum(tl.load(draft_row_ptr + c - 1), 0), V - 1)
                        z = tl.load(row_ptr + x).to(tl.float32) * inv_t
                        p = tl.where(z >= tau, tl.exp(z - m) / s_tau, 0.0)
                        p = tl.where(greedy, tl.where(x == i1, 1.0, 0.0), p)
                        tl.store(p_child_ptr + at + c, p)
                        tl.store(lp_child_ptr + at + c, tl.where(z >= tau, z - m - log_s, NEG_INF))
                if SIBLINGS:  # the row decides which child it keeps (the walk follows)
                    pick, rej = _sampled_children(row_ptr, q_row_ptr, s_qn, map_ptr, sib_f, sib_i,
                                                  draft_row_ptr, parents_ptr, k0, k1, pos, j, N,
                                                  V, inv_t, tau, m, s_tau, i1, greedy, HAS_MAP)
                    tl.store(acc_ptr + at + j, pick)
                    rejected_q = sampled & (rej != 0)
        else:
            if j < n:
                c = j + 1
                x = tl.minimum(tl.maximum(tl.load(draft_row_ptr + j), 0), V - 1)
                z = tl.load(row_ptr + x).to(tl.float32) * inv_t
                p = tl.where(z >= tau, tl.exp(z - m) / s_tau, 0.0)
                u = acceptance_uniform(k0, k1, pos, c)
                # Accept iff u·q(x) <= p(x): P(accept) = min(1, p/q); a rejection is followed by
                # a draw of norm(max(p - q, 0)), which together give exactly p (q = 1: point mass).
                if HAS_Q:
                    if HAS_MAP:  # q over the drafter's vocabulary: x's column, or q(x) = 0
                        dx = tl.load(map_ptr + x).to(tl.int64)
                        qx = tl.load(q_row_ptr + tl.maximum(dx, 0)).to(tl.float32)
                        qx = tl.where(dx >= 0, qx, 0.0)
                    else:
                        qx = tl.load(q_row_ptr + x).to(tl.float32)
                    ok = (qx > 0) & (u * qx <= p)
                else:
                    ok = (p > 0) & (u <= p)
                ok = tl.where(greedy, x == i1, ok)
                if HAS_Q:
                    rejected_q = sampled & (ok == 0)
                tl.store(p_child_ptr + at + c, tl.where(greedy, tl.where(x == i1, 1.0, 0.0), p))
                tl.store(lp_child_ptr + at + c, tl.where(z >= tau, z - m - log_s, NEG_INF))
                tl.store(acc_ptr + at + c, ok.to(tl.int32))

        # The draw (``reference.draw_tile``): pass 1's tile races hold unless the cut removed
        # a token (they were over every token) or the residual is max(p - q, 0); then the
        # races run again over the kept set. The token race runs in the winning tile only.
        tok = i1  # greedy: the argmax
        if sampled:
            t1 = i1
            t2 = i2
            if (tau > zmin) | rejected_q:
                t1, t2 = tile_pass(row_ptr, q_row_ptr, s_qn, map_ptr, sib_f, sib_i,
                                   draft_row_ptr, parents_ptr, k0, k1, pos, j, n, N, V, inv_t,
                                   tau, m, s_tau, rejected_q.to(tl.int32), tile_f, tile_i,
                                   HAS_MAP, IS_TREE, SIBLINGS, TB)
            if SIBLINGS:  # no child rejected: the row's end is a draw of p itself
                t2 = tl.where(rejected_q, t2, -1)
            tok = -1
            if t2 >= 0:  # the residual (p itself for a row without children)
                _, tok = race_in_tile(row_ptr, q_row_ptr, s_qn, map_ptr, sib_f, sib_i,
                                      draft_row_ptr, parents_ptr, k0, k1, pos, j, n, N, V, inv_t,
                                      tau, m, s_tau, rejected_q.to(tl.int32), t2, HAS_MAP,
                                      IS_TREE, SIBLINGS)
            if tok < 0:  # no residual mass: p itself
                tok, _ = race_in_tile(row_ptr, q_row_ptr, s_qn, map_ptr, sib_f, sib_i,
                                      draft_row_ptr, parents_ptr, k0, k1, pos, j, n, N, V, inv_t,
                                      tau, m, s_tau, 0, t1, HAS_MAP, IS_TREE, SIBLINGS)
        z_t = tl.load(row_ptr + tok).to(tl.float32) * inv_t
        tl.store(tok_end_ptr + at + j, tok)
        tl.store(lp_end_ptr + at + j, z_t - m - log_s)


@triton.jit
def _part_kernel(logits_ptr, s_lb, s_ln, draft_ptr, s_db, num_draft_ptr, temp_ptr, inv_t_ptr,
                 parents_ptr, part_f_ptr, part_i_ptr, tile_f_ptr, tile_i_ptr, C, CHUNK, N, V,
                 IS_TREE: tl.constexpr, GBLOCK: tl.constexpr):
    """Pass 1 of row (b, j) over its tokens [c * CHUNK, (c + 1) * CHUNK), program (row, c):
    at small batch the rows alone would leave most of the GPU idle. A greedy row's part
    writes its (max, sum, argmax) for ``merge_parts``; a sampled row's, its (max, min) and
    its tiles' statistics in the row's scratch (``first_pass_part``: parts are whole tiles)."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    b = pid // N
    j = pid % N
    live, n = _row_reached(num_draft_ptr, b, j, N, IS_TREE)
    if live:
        b64 = b.to(tl.int64)
        row_ptr = logits_ptr + b64 * s_lb + j.to(tl.int64) * s_ln
        start = c * CHUNK
        end = tl.minimum(start + CHUNK, V)
        out_f = part_f_ptr + (pid.to(tl.int64) * C + c) * 5
        out_i = part_i_ptr + (pid.to(tl.int64) * C + c) * 2
        if tl.load(temp_ptr + b) == 0:
            m, s, arg = greedy_pass_part(row_ptr, start, end, GBLOCK)
            tl.store(out_f, m)
            tl.store(out_f + 1, s)
            tl.store(out_i, arg)
        else:
            tile_f, tile_i = row_tile_scratch(tile_f_ptr, tile_i_ptr, pid, V)
            m, zmin = first_pass_part(row_ptr, draft_ptr + b64 * s_db, parents_ptr, j, n, N, V,
                                      tl.load(inv_t_ptr + b), start, end, tile_f, tile_i,
                                      IS_TREE)
            tl.store(out_f, m)
            tl.store(out_f + 2, zmin)


@triton.jit
def _search_part(logits_ptr, s_lb, s_ln, num_draft_ptr, temp_ptr, inv_t_ptr, top_k_ptr,
                 top_p_ptr, min_p_ptr, part_f_ptr, search_i_ptr, search_f_ptr, buf_ptr, C,
                 CHUNK, N, V, IS_TREE: tl.constexpr, HAS_MIN_P: tl.constexpr,
                 SNAP: tl.constexpr, P: tl.constexpr, SBLOCK: tl.constexpr):
    """The first pass of a sampled row's first threshold search (``keep_cut``), program
    (row, c) over its tokens [c * CHUNK, (c + 1) * CHUNK) as ``_part_kernel``: the pivot
    pass's integer partials (``_search_pivot_kernel``), or (``SNAP``: ``_search_snap_kernel``,
    the next launch) the snap after it and the copy of the bracket's entries into the row's
    buffer. The row kernel merges them and runs the rest of the search (over the buffer) in
    one program: at small batch a pass over the whole row in one program was most of the
    search's time."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    b = pid // N
    j = pid % N
    live, _ = _row_reached(num_draft_ptr, b, j, N, IS_TREE)
    if live & (tl.load(temp_ptr + b) != 0):
        top_k = tl.load(top_k_ptr + b).to(tl.int32)
        top_p = tl.load(top_p_ptr + b)
        log_min_p = top_p * 0.0
        if HAS_MIN_P:
            log_min_p = tl.load(min_p_ptr + b)
        which = split_first_search(top_k, top_p, V, log_min_p, HAS_MIN_P)
        pid64 = pid.to(tl.int64)
        # the row's max and min, as the row kernel's merge of pass 1 has them
        m, zmin = merged_max_min(part_f_ptr + pid64 * C * 5, C)
        if (which != 0) & (zmin < m):  # zmin == m: every z equal, no search runs
            row_ptr = logits_ptr + b.to(tl.int64) * s_lb + j.to(tl.int64) * s_ln
            inv_t = tl.load(inv_t_ptr + b)
            start = c * CHUNK
            end = tl.minimum(start + CHUNK, V)
            row_i = search_i_ptr + pid64 * C * (2 * P + 2)  # [C, 2P + 2] int64
            if SNAP:
                out_f = search_f_ptr + (pid64 * C + c) * 3
                buf = buf_ptr + pid64 * SEARCH_CAP
                if which == 1:
                    split_snap_part(row_ptr, start, end, c, inv_t, m, zmin, m, top_p, top_k,
                                    row_i, C, buf, out_f, False, P, SBLOCK)
                else:
                    split_snap_part(row_ptr, start, end, c, inv_t, m, zmin, m, top_p, top_k,
                                    row_i, C, buf, out_f, True, P, SBLOCK)
            else:
                out_i = row_i + c * (2 * P + 2)
                if which == 1:
                    split_pivot_part(row_ptr, start, end, inv_t, m, zmin, m, out_i, False, P,
                                     SBLOCK)
                else:
                    split_pivot_part(row_ptr, start, end, inv_t, m, zmin, m, out_i, True, P,
                                     SBLOCK)


@triton.jit
def _search_pivot_kernel(logits_ptr, s_lb, s_ln, num_draft_ptr, temp_ptr, inv_t_ptr,
                         top_k_ptr, top_p_ptr, min_p_ptr, part_f_ptr, search_i_ptr,
                         search_f_ptr, buf_ptr, C, CHUNK, N, V, IS_TREE: tl.constexpr,
                         HAS_MIN_P: tl.constexpr, P: tl.constexpr, SBLOCK: tl.constexpr):
    _search_part(logits_ptr, s_lb, s_ln, num_draft_ptr, temp_ptr, inv_t_ptr, top_k_ptr,
                 top_p_ptr, min_p_ptr, part_f_ptr, search_i_ptr, search_f_ptr, buf_ptr, C,
                 CHUNK, N, V, IS_TREE, HAS_MIN_P, False, P, SBLOCK)


@triton.jit
def _search_snap_kernel(logits_ptr, s_lb, s_ln, num_draft_ptr, temp_ptr, inv_t_ptr,
                        top_k_ptr, top_p_ptr, min_p_ptr, part_f_ptr, search_i_ptr,
                        search_f_ptr, buf_ptr, C, CHUNK, N, V, IS_TREE: tl.constexpr,
                        HAS_MIN_P: tl.constexpr, P: tl.constexpr, SBLOCK: tl.constexpr):
    _search_part(logits_ptr, s_lb, s_ln, num_draft_ptr, temp_ptr, inv_t_ptr, top_k_ptr,
                 top_p_ptr, min_p_ptr, part_f_ptr, search_i_ptr, search_f_ptr, buf_ptr, C,
                 CHUNK, N, V, IS_TREE, HAS_MIN_P, True, P, SBLOCK)


@triton.jit
def _walk_kernel(draft_ptr, s_db, num_draft_ptr, temp_ptr, seed_ptr, offset_ptr, parents_ptr,
                 tok_end_ptr, lp_end_ptr, p_child_ptr, lp_child_ptr, acc_ptr,
                 out_ptr, num_acc_ptr, out_lp_ptr, row_ids_ptr, N,
                 IS_TREE: tl.constexpr, SIBLINGS: tl.constexpr, NP2: tl.constexpr):
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    at = b64 * N
    draft_row_ptr = draft_ptr + b64 * s_db
    n = tl.minimum(tl.maximum(tl.load(num_draft_ptr + b).to(tl.int32), 0), N - 1)
    if IS_TREE:
        greedy = tl.load(temp_ptr + b) == 0
        k0, k1 = seed_key(seed_ptr, b)
        off = tl.load(offset_ptr + b).to(tl.int64)
        i = tl.arange(0, NP2)
        sib_par = tl.load(parents_ptr + i, mask=(i >= 1) & (i < N), other=-2)
        sib_tok = tl.load(draft_row_ptr + i - 1, mask=(i >= 1) & (i < N), other=-1)
        node = b * 0
        depth = b * 0
        done = b * 0
        for _step in range(0, N):
            if done == 0:
                found = b * 0
                nxt = b * 0
                mass = off.to(tl.float32) * 0.0 + 1.0  # sum of the residual r
                if SIBLINGS:  # sampled children: the node's row chose (_sampled_children)
                    if n > 0:
                        nxt = tl.load(acc_ptr + at + node)
                        found = (nxt > 0).to(tl.int32)
                elif n > 0:
                    for c in range(1, N):
                        if (tl.load(parents_ptr + c) == node) & (found == 0):
                            x = tl.load(draft_row_ptr + c - 1)
                            # An earlier sibling with this token already removed it from r.
                            dup = tl.sum(((sib_par == node) & (i < c) & (sib_tok == x))
                                         .to(tl.int32), 0) > 0
                            r = tl.where(dup, 0.0, tl.load(p_child_ptr + at + c))
                            u = acceptance_uniform(k0, k1, off + depth, c)
                            ok = (r > 0) & (greedy | (u * mass <= r))  # P = r(x) / sum(r)
                            if ok:
                                found = found * 0 + 1
                                nxt = c
                            else:
                                mass = mass - r
                if found != 0:
                    tok = tl.load(draft_row_ptr + nxt - 1).to(tl.int64)
                    lp = tl.load(lp_child_ptr + at + nxt)
                else:
                    tok = tl.load(tok_end_ptr + at + node).to(tl.int64)
                    lp = tl.load(lp_end_ptr + at + node)
                tl.store(out_ptr + at + depth, tok)
                tl.store(out_lp_ptr + at + depth, lp)
                tl.store(row_ids_ptr + at + depth, node)
                if found != 0:
                    node = nxt
                    depth += 1
                else:
                    done = done * 0 + 1
        tl.store(num_acc_ptr + b, depth)
    else:
        i = tl.arange(0, NP2)
        is_draft = i < n
        acc = tl.load(acc_ptr + at + i + 1, mask=is_draft, other=0)
        m = tl.min(tl.where(is_draft & (acc == 0), i, n), 0)  # accepted drafts
        x = tl.load(draft_row_ptr + i, mask=i < m, other=-1).to(tl.int64)
        lpx = tl.load(lp_child_ptr + at + i + 1, mask=i < m, other=0.0)
        t_end = tl.load(tok_end_ptr + at + m).to(tl.int64)
        lp_end = tl.load(lp_end_ptr + at + m)
        out_mask = i < N
        tl.store(out_ptr + at + i, tl.where(i < m, x, tl.where(i == m, t_end, -1)), mask=out_mask)
        tl.store(out_lp_ptr + at + i, tl.where(i < m, lpx, tl.where(i == m, lp_end, 0.0)),
                 mask=out_mask)
        tl.store(row_ids_ptr + at + i, tl.where(i <= m, i, -1), mask=out_mask)
        tl.store(num_acc_ptr + b, m)


_PART_TOKENS = 4 * 512  # parts of a row are whole blocks of the race's Philox layout
_DEFAULT_SMS = 132  # H200 / H100 SXM: for meta tensors (compile_kernels) and the interpreter


def default_vocab_parts(rows: int, vocab: int, device: torch.device) -> int:
    """Parts each row's first pass runs in: about two programs per SM when the rows alone are
    fewer (B = 1 ran 4 programs on 132 SMs), at least 2,048 tokens each; 1 at large batch."""
    return max(1, min(-(-vocab // _PART_TOKENS), 2 * _sm_count(device) // max(rows, 1)))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def vocab_chunks(rows: int, vocab: int, device: torch.device,
                 vocab_parts: int | None) -> tuple[int, int]:
    """(parts, tokens per part) of a row split over its vocabulary: ``vocab_parts`` (None:
    ``default_vocab_parts``) rounded to whole 2,048-token blocks (the races' Philox layout)."""
    if vocab_parts is not None and not (isinstance(vocab_parts, int) and vocab_parts >= 1):
        raise ValueError(f"vocab_parts must be a positive int or None, got {vocab_parts!r}")
    parts = vocab_parts or default_vocab_parts(rows, vocab, device)
    per_part = -(-vocab // parts)
    chunk = -(-per_part // _PART_TOKENS) * _PART_TOKENS
    return -(-vocab // chunk), chunk


# Scratch of one (row, part) program of a split call: pass 1's partials (5 float32, 2 int32;
# a sampled row's use 2 of them) and the search's (SPLIT_INTS int64, SPLIT_FLOATS float32):
# 312 B.
SPLIT_BYTES_PER_PROGRAM = 5 * 4 + 2 * 4 + SPLIT_INTS * 8 + SPLIT_FLOATS * 4
# A default split has rows x parts <= 2 x SMs programs (``default_vocab_parts``); 2 x 192 SMs
# bounds today's GPUs (H100 / H200: 132, B200: 148): at most 117 KiB per call.
SPLIT_SCRATCH_MAX_BYTES = 2 * 192 * SPLIT_BYTES_PER_PROGRAM


TILE_SCRATCH_BYTES = 4 + 2 * 8  # one tile's statistics: its largest z, two int64 masses


def _num_tiles(vocab: int) -> int:
    return -(-vocab // _PART_TOKENS)


def tile_block(vocab: int) -> int:
    """The tile races' block (``sampling_pass.tile_races``): a row's tiles rounded up to a
    power of two."""
    return triton.next_power_of_2(_num_tiles(vocab))


def tile_scratch(rows: int, vocab: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Each sampled row's tiles' statistics (``sampling_pass.first_pass_part``), uninitialised
    (written before read): [rows, tiles] float32 (largest z) and [rows, tiles, 2] int64
    (masses), tiles = ceil(V / 2,048): 20 B per 2,048 tokens."""
    tiles = _num_tiles(vocab)
    assert tiles <= TILES_MAX, (vocab, TILES_MAX)  # sampling_checks: V < 2**19
    return (torch.empty(rows * tiles, dtype=torch.float32, device=device),
            torch.empty(rows * tiles * 2, dtype=torch.int64, device=device))


def split_search_scratch(rows: int, parts: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The split search's partials, uninitialised (each is written before it is read):
    [rows, parts, SPLIT_INTS] int64 and [rows, parts, SPLIT_FLOATS] float32."""
    return (torch.empty(rows * parts * SPLIT_INTS, dtype=torch.int64, device=device),
            torch.empty(rows * parts * SPLIT_FLOATS, dtype=torch.float32, device=device))


def launch_search_parts(logits: Tensor, s_lb: int, s_ln: int, num_draft: Tensor,
                        temperature: Tensor, inv_t: Tensor, top_k: Tensor, top_p: Tensor,
                        log_min_p: Tensor | None, part_f: Tensor, search_i: Tensor,
                        search_f: Tensor, scratch: Tensor, rows: int, parts: int, chunk: int,
                        n_rows: int, vocab: int, is_tree: bool) -> None:
    """The first pass of each sampled row's first threshold search over its ``parts``, after
    ``_part_kernel`` and before the row kernel: two launches of rows x parts programs, the
    pivot pass (``_search_pivot_kernel``), then its snap and compaction
    (``_search_snap_kernel``: it merges every part's pivot partials first)."""
    args = (logits, s_lb, s_ln, num_draft, temperature, inv_t, top_k, top_p,
            log_min_p if log_min_p is not None else top_p, part_f, search_i, search_f, scratch,
            parts, chunk, n_rows, vocab)
    meta = dict(IS_TREE=is_tree, HAS_MIN_P=log_min_p is not None, P=SEARCH_P, SBLOCK=_SBLOCK,
                num_warps=4)
    # No FMA contraction in the pivot pass: fused, z - m became fma(logit, 1 / T, -m) there
    # while the row kernel's passes (row and buffer) compute it from the rounded z (FADD in
    # their SASS), and a token's fixed-point weight could differ by one unit between the split
    # and the one-program search. (The snap pass only compares z and sums a float mass.)
    _search_pivot_kernel[(rows, parts)](*args, **meta, enable_fp_fusion=False)
    _search_snap_kernel[(rows, parts)](*args, **meta)


def rejection_sample(
    target_logits: Tensor,  # [B, N, V] float32 / float16 / bfloat16
    draft_token_ids: Tensor,  # [B, N-1] int64: chain: draft j judged by row j; tree: node j+1
    num_draft_tokens: Tensor,  # [B] int32: chain 0..N-1; tree N-1 or 0
    draft_probs: Tensor | None,  # [B, N-1, V] ([B, N-1, Vd] with draft_index) or None (point
    # masses); trees: each child's q (its parent's), children drawn without replacement
    temperature: Tensor,  # [B] float32, 0 = greedy
    top_k: Tensor,  # [B] int32, <= 0 = off
    top_p: Tensor,  # [B] float32 in (0, 1]
    seeds: Tensor,  # [B] int64
    offsets: Tensor,  # [B] int64
    tree_parents: Tensor | None,  # [N] int32 or None (chain)
    log_min_p: Tensor | None = None,  # [B] float32 log(min_p), -inf = off; None: all off
    *,
    draft_index: Tensor | None = None,  # [V] int32 / int64: draft_probs column of token t, or -1
    check_values: bool | None = None,
    vocab_parts: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Same contract and results as ``reference.rejection_sample``; returns (output_ids [B, N]
    int64, num_accepted [B] int32, logprobs [B, N] float32, row_ids [B, N] int32).

    ``draft_index``: the drafts were drawn from ``draft_probs`` over the drafter's own
    vocabulary (``reference.draft_probs_in_target_vocab`` gives the law judged); the kernels
    read q(x) through it and the residual max(p - q, 0) over every target token.

    ``vocab_parts``: programs each row's first pass runs in (rounded to whole 2,048-token
    blocks; results are the same for any value); None: ``default_vocab_parts`` (small batches
    split, large ones do not).

    ``check_values`` also validates values (draft ids, lengths, parents, ranges), which costs one
    device→host sync. Default (None): on only when ``debug.value_checks_enabled()`` and no CUDA
    graph is being captured; an explicit True / False wins.
    """
    if check_values is None:
        check_values = check_values_now()
    validate_inputs(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature,
                    top_k, top_p, seeds, offsets, tree_parents, check_values,
                    draft_index=draft_index, log_min_p=log_min_p)
    bsz, n_rows, vocab = target_logits.shape
    dev = target_logits.device
    is_tree = tree_parents is not None
    inv_t = torch.where(temperature == 0, torch.ones_like(temperature), temperature.reciprocal())
    tok_end = torch.empty(bsz, n_rows, dtype=torch.int32, device=dev)
    lp_end = torch.empty(bsz, n_rows, dtype=torch.float32, device=dev)
    p_child = torch.empty(bsz, n_rows, dtype=torch.float32, device=dev)
    lp_child = torch.empty(bsz, n_rows, dtype=torch.float32, device=dev)
    acc = torch.empty(bsz, n_rows, dtype=torch.int32, device=dev)
    out = torch.full((bsz, n_rows), -1, dtype=torch.int64, device=dev)
    num_acc = torch.empty(bsz, dtype=torch.int32, device=dev)
    out_lp = torch.zeros(bsz, n_rows, dtype=torch.float32, device=dev)
    row_ids = torch.full((bsz, n_rows), -1, dtype=torch.int32, device=dev)
    q = draft_probs if draft_probs is not None else target_logits  # dummy when unused
    parents = tree_parents if is_tree else num_draft_tokens  # dummy when unused
    vocab_map = draft_index if draft_index is not None else num_draft_tokens  # dummy too
    # top-k / top-p search candidates, SEARCH_CAP_ENTRIES per row program (uninitialised:
    # a search reads only what it wrote)
    scratch = torch.empty(bsz * n_rows, SEARCH_CAP_ENTRIES, dtype=torch.float32, device=dev)
    s_db = draft_token_ids.stride(0) if n_rows > 1 else 0
    parts, chunk = vocab_chunks(bsz * n_rows, vocab, dev, vocab_parts)
    part_f = torch.empty(bsz * n_rows * parts * 5 if parts > 1 else 1, dtype=torch.float32,
                         device=dev)
    part_i = torch.empty(bsz * n_rows * parts * 2 if parts > 1 else 1, dtype=torch.int32,
                         device=dev)
    # (unsplit: the row kernel's unused search-partial arguments are part_i / part_f)
    search_i, search_f = split_search_scratch(bsz * n_rows, parts, dev) if parts > 1 \
        else (part_i, part_f)
    tile_f, tile_i = tile_scratch(bsz * n_rows, vocab, dev)
    # sampled tree children (``_sampled_children``): per node its flags (zeroed: read for every
    # child of a row), the residual's total and D at its rejection
    siblings = is_tree and draft_probs is not None
    sib_f = torch.empty(bsz * n_rows * 2 if siblings else 1, dtype=torch.float32, device=dev)
    sib_i = torch.zeros(bsz * n_rows if siblings else 1, dtype=torch.int32, device=dev)
    if parts > 1:
        _part_kernel[(bsz * n_rows, parts)](
            target_logits, target_logits.stride(0), target_logits.stride(1), draft_token_ids,
            s_db, num_draft_tokens, temperature, inv_t, parents, part_f, part_i, tile_f, tile_i,
            parts, chunk, n_rows, vocab, IS_TREE=is_tree, GBLOCK=2048, num_warps=4,
            enable_fp_fusion=False)  # z = logit / T, then z - a: rounded as the reference
        # and the first pass of the rows' top-k / top-p search (two launches)
        launch_search_parts(target_logits, target_logits.stride(0), target_logits.stride(1),
                            num_draft_tokens, temperature, inv_t, top_k, top_p, log_min_p,
                            part_f, search_i, search_f, scratch, bsz * n_rows, parts, chunk,
                            n_rows, vocab, is_tree)
    _row_kernel[(bsz * n_rows,)](
        target_logits, target_logits.stride(0), target_logits.stride(1),
        draft_token_ids, s_db, num_draft_tokens, q, q.stride(0), q.stride(1), vocab_map, scratch,
        temperature, inv_t, top_k, top_p, log_min_p if log_min_p is not None else top_p,
        seeds, offsets, parents, tok_end, lp_end, p_child, lp_child, acc, part_f, part_i,
        search_i, search_f, tile_f, tile_i, sib_f, sib_i, parts, n_rows, vocab,
        HAS_Q=draft_probs is not None, HAS_MAP=draft_index is not None, IS_TREE=is_tree,
        SIBLINGS=siblings,
        HAS_MIN_P=log_min_p is not None, SPLIT=parts > 1, P=16, TB=tile_block(vocab),
        SBLOCK=_SBLOCK_TREE if is_tree else _SBLOCK, GBLOCK=2048,
        # ptxas otherwise caps this kernel near 128 registers and spills a few bytes on sm_100a
        # (scripts/compile_kernels.py); 255 lets it keep every pass's per-lane state.
        num_warps=4, maxnreg=255,
        # no FMA contraction: a tile mass floor(exp(z - a) * 2**44) from the rounded
        # z = logit / T, in pass 1, the tile pass and the split's parts alike (the reference's
        # float32 operations; fused, z - a could differ by one unit of the mass)
        enable_fp_fusion=False,
    )
    _walk_kernel[(bsz,)](
        draft_token_ids, s_db, num_draft_tokens, temperature, seeds, offsets, parents,
        tok_end, lp_end, p_child, lp_child, acc, out, num_acc, out_lp, row_ids, n_rows,
        IS_TREE=is_tree, SIBLINGS=siblings, NP2=max(triton.next_power_of_2(n_rows), 2),
        num_warps=1,
    )
    return out, num_acc, out_lp, row_ids
