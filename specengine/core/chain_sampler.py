"""Chain verification with sampled rows on the CPU: the reference's outputs, with only the work
those outputs read.

The reference rejection sampler (``kernels/reference_sampling.py``, the kernels'
specification) runs its whole machinery at every logits row of every batch row: the top-k /
top-p threshold (a sort of the vocabulary) and a two-level draw (a race over the tiles'
masses, then a Philox race over the winning tile's tokens; the reference draws that race's
random numbers for the whole vocabulary), then keeps one draw per batch row. On the CPU
those were most of a sampled step (at batch 32 over a 49k vocabulary a race over every token
and the sort cost more than the model's forward). For chains, what each batch row reads is:

* at every node ``j``: the row's log-sum-exp, its argmax (greedy rows) and the draft's
  probability ``p_j(x)``; the draft's acceptance uniform;
* the draw only at the node where the walk ends (``num_accepted``): one per batch row,
  whichever node that is, its token race's random numbers for the winning tile's 2,048
  tokens only. Every other node's draw is made by the reference and discarded;
* the threshold (a sort) only for rows whose request turned top-k, top-p or min-p on: for
  the others it keeps the whole vocabulary.

This module computes exactly those, in the reference's float32 operations, so its outputs
equal the reference's bit for bit (``tests/test_chain_sampler.py``): the same tokens for the
same seeds, the same logprobs. Trees keep the reference (their walk visits several nodes).
Host reads (which rows filter, where walks end) are memory reads here: CPU only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from specengine.kernels.reference import (
    TILE,
    draw_tile,
    fixed_point,
    keep_threshold,
    philox4x32,
    tile_exponentials,
    tile_masses,
    tile_sums,
    uniform_from_bits,
)


def _thresholds(z: Tensor, sampled: Tensor, top_k: Tensor, top_p: Tensor,
                log_min_p: Tensor | None) -> Tensor | None:
    """``tau [B, N]`` (keep ``z >= tau``) for logits ``z [B, N, V]``, or None when no row
    filters. Rows that are greedy or filter nothing keep everything (-inf), as in the
    reference (whose threshold for them is the row's minimum: the same kept set)."""
    bsz, n_rows, vocab = z.shape
    filt = (top_k > 0) & (top_k < vocab) | (top_p < 1)
    if log_min_p is not None:
        filt |= log_min_p > float("-inf")
    rows = torch.nonzero(filt & sampled)[:, 0]
    if not len(rows):
        return None
    tau = torch.full((bsz, n_rows), float("-inf"), device=z.device)
    rep = lambda t: t[rows].repeat_interleave(n_rows)  # noqa: E731  (row r's N nodes)
    tau[rows] = keep_threshold(z[rows].reshape(-1, vocab), rep(top_k), rep(top_p),
                               None if log_min_p is None else rep(log_min_p)
                               ).view(len(rows), n_rows)
    return tau


def _argmax_or(keys: Tensor, floor: float, fallback: Tensor) -> Tensor:
    """Lowest index of the largest key per row, or `fallback` where no key exceeds `floor`."""
    best = keys.max(1)
    return torch.where(best.values > floor, keys.argmax(1), fallback)


def sampled_chain_sample(
    target_logits: Tensor,  # [B, N, V]
    draft_token_ids: Tensor,  # [B, N-1] int
    num_draft_tokens: Tensor,  # [B] int
    draft_probs: Tensor | None,  # [B, N-1, V or Vd] or None (point-mass drafts)
    temperature: Tensor,  # [B] float32, 0 = greedy
    top_k: Tensor,  # [B] int, <= 0 = off
    top_p: Tensor,  # [B] float32
    seeds: Tensor,  # [B] int64
    offsets: Tensor,  # [B] int64
    log_min_p: Tensor | None = None,  # [B] float32, -inf = off
    draft_index: Tensor | None = None,  # [V] int: draft_probs column of target token t, or -1
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The reference ``rejection_sample`` with ``tree_parents=None``: (output_ids [B, N]
    int64 (-1 pad), num_accepted [B] int32, logprobs [B, N] float32 (0 pad), row_ids [B, N]
    int32 (-1 pad)), equal to it bit for bit. CPU tensors."""
    bsz, n_rows, vocab = target_logits.shape
    dev = target_logits.device
    n = num_draft_tokens.long()
    c_all = torch.arange(n_rows, device=dev)
    used = (c_all[None] <= n[:, None]) & (c_all[None] > 0)  # [B, N]: node c's draft is judged
    drafts = torch.cat([torch.zeros_like(n[:, None]), draft_token_ids.long()], 1)  # by node
    drafts = drafts.clamp(0, vocab - 1)
    greedy = temperature == 0
    inv_t = torch.where(greedy, torch.ones_like(temperature), temperature.reciprocal())
    seeds = seeds.long()
    offsets = offsets.long()
    rows = torch.arange(bsz, device=dev)

    z = target_logits.float() * inv_t[:, None, None]  # [B, N, V]
    tau = _thresholds(z, ~greedy, top_k, top_p, log_min_p)  # None: every token kept
    m = z.amax(-1, keepdim=True)  # [B, N, 1]
    w = torch.exp(z - m)  # unnormalised p_j (kept tokens)
    if tau is not None:
        w = torch.where(z >= tau[..., None], w, 0.0)
    s = w.sum(-1, keepdim=True)  # [B, N, 1]
    log_s = torch.log(s)
    argmax = z.argmax(-1)  # [B, N]

    def logp_at(tok: Tensor, node: Tensor) -> Tensor:
        """log p_node(tok) as the reference computes it over the row, [B] each."""
        zt = z[rows, node, tok]
        lp = zt - m[rows, node, 0] - log_s[rows, node, 0]
        return lp if tau is None else torch.where(zt >= tau[rows, node], lp, float("-inf"))

    # Node c's draft x_c is judged at node c - 1 (lp_child and acceptance as the reference
    # computes them; column 0 unused).
    lp_child = torch.zeros(bsz, n_rows, device=dev)
    acc = torch.zeros(bsz, n_rows, dtype=torch.bool, device=dev)
    if n_rows > 1:
        kids = c_all[1:].expand(bsz, -1)  # [B, N-1]
        x = drafts[:, 1:]
        zx = z[:, :-1].gather(2, x[..., None])[..., 0]
        lp = zx - m[:, :-1, 0] - log_s[:, :-1, 0]
        if tau is not None:
            lp = torch.where(zx >= tau[:, :-1], lp, float("-inf"))
        lp_child[:, 1:] = lp
        p_x = w[:, :-1].gather(2, x[..., None])[..., 0] / s[:, :-1, 0]  # p_{c-1}(x_c)
        u = uniform_from_bits(philox4x32(seeds[:, None], offsets[:, None] + kids - 1, kids,
                                         0, 0)[0])
        if draft_probs is None:
            ok = (p_x > 0) & (u <= p_x)
        else:
            qx = _q_at(draft_probs, x, draft_index)
            ok = (qx > 0) & (u * qx <= p_x)
        acc[:, 1:] = torch.where(greedy[:, None], x == argmax[:, :-1], ok)
    fail = used & ~acc
    num_acc = torch.where(fail.any(1), fail.float().argmax(1) - 1, n)  # first rejected - 1

    # The walk ends at node num_acc: the one draw each sampled row needs there, two-level
    # (reference.draw_tile): a tile race over the row's tile masses, then the token race in
    # the winning tile only (random numbers for TILE tokens, not the vocabulary).
    end = num_acc
    tok_end = argmax[rows, end]
    b = torch.nonzero(~greedy)[:, 0]
    if len(b):
        j = end[b]
        pos = offsets[b] + j
        ze = z[b, j]  # [S, V]
        live = torch.ones_like(ze, dtype=torch.bool) if tau is None else ze >= tau[b, j][:, None]
        mass, anchor = tile_masses(ze, live)
        tok = torch.full_like(j, -1)
        p_keys = _p_keys(ze, live)
        # x_{j+1} was refused (j < num_draft): a draw of p_j given that refusal instead (p_j
        # itself only where that has no mass).
        ref = torch.nonzero(j < n[b])[:, 0]
        if len(ref):
            bj, jr = b[ref], j[ref]
            none = torch.full_like(jr, -1)
            if draft_probs is None:
                # Its point-mass drafts refused: p_j with their tokens removed.
                x = drafts[bj, jr + 1]
                rest = mass[ref].index_put((torch.arange(len(ref), device=dev), x),
                                           torch.zeros((), dtype=torch.long, device=dev))
                t_rest = draw_tile(seeds[bj], pos[ref], jr, tile_sums(rest), anchor[ref])

                def rest_keys(sel: Tensor, cols: Tensor, valid: Tensor, e: Tensor) -> Tensor:
                    return torch.where(cols == x[:, None], float("-inf"),
                                       p_keys(sel, cols, valid, e))

                tok[ref] = _token_race(ref, t_rest, rest_keys, float("-inf"), none, seeds[b],
                                      pos, j, vocab)
            else:
                # norm(max(p - q, 0)): the reference's residual draw, same exponentials.
                q = draft_probs[bj, jr].float()
                if draft_index is not None:
                    idx = draft_index.long()
                    q = torch.where(idx >= 0, q[:, idx.clamp(min=0)], 0.0)
                r = (w[bj, jr] / s[bj, jr] - q).clamp(min=0)
                t_r = draw_tile(seeds[bj], pos[ref], jr, tile_sums(fixed_point(r)), None)

                def q_keys(sel: Tensor, cols: Tensor, valid: Tensor, e: Tensor) -> Tensor:
                    rc = r.gather(1, cols)
                    return torch.where(valid & (rc > 0), rc / e, -1.0)

                tok[ref] = _token_race(ref, t_r, q_keys, 0.0, none, seeds[b], pos, j, vocab)
        plain = torch.nonzero(tok < 0)[:, 0]  # p_j: no draft refused there, or no residual
        if len(plain):
            t_plain = draw_tile(seeds[b[plain]], pos[plain], j[plain], tile_sums(mass[plain]),
                                anchor[plain])
            tok[plain] = _token_race(plain, t_plain, p_keys, float("-inf"), tok_end[b[plain]],
                                    seeds[b], pos, j, vocab)
        tok_end[b] = tok
    lp_end = logp_at(tok_end, end)

    out = torch.full((bsz, n_rows), -1, dtype=torch.long, device=dev)
    out_lp = torch.zeros(bsz, n_rows, device=dev)
    i = c_all[None].expand(bsz, -1)
    out = torch.where(i < num_acc[:, None], drafts.roll(-1, 1), out)
    out_lp = torch.where(i < num_acc[:, None], lp_child.roll(-1, 1), out_lp)
    out[rows, num_acc] = tok_end
    out_lp[rows, num_acc] = lp_end
    row_ids = torch.where(i <= num_acc[:, None], i.int(), -1).int()
    return out, num_acc.int(), out_lp, row_ids


Keys = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _p_keys(z: Tensor, live: Tensor) -> Keys:
    """The token race's keys of p: z - log E on the kept tokens, -inf elsewhere."""

    def keys(sel: Tensor, cols: Tensor, valid: Tensor, e: Tensor) -> Tensor:
        return torch.where(valid & live[sel].gather(1, cols), z[sel].gather(1, cols) - torch.log(e),
                           float("-inf"))

    return keys


def _token_race(sel: Tensor, tile: Tensor, keys: Keys, floor: float, fallback: Tensor,
               seeds: Tensor, pos: Tensor, node: Tensor, vocab: int) -> Tensor:
    """The token race inside ``tile`` [R] (-1: none) for rows ``sel`` of the sampled rows:
    ``keys(sel, columns, valid, E)`` over the tile's TILE tokens give the winner (the lowest
    column of the largest key, as the reference's argmax over the row), or ``fallback`` where
    no key exceeds ``floor``. Random numbers for those TILE tokens only."""
    cols = tile.clamp(min=0)[:, None] * TILE + torch.arange(TILE, device=tile.device)
    valid = (cols < vocab) & (tile[:, None] >= 0)
    e = tile_exponentials(seeds[sel], pos[sel], node[sel], tile)
    key = keys(sel, cols.clamp(max=vocab - 1), valid, e)
    best = key.max(1)
    won = cols.gather(1, best.indices[:, None])[:, 0]
    return torch.where(best.values > floor, won, fallback)


def _q_at(draft_probs: Tensor, x: Tensor, draft_index: Tensor | None) -> Tensor:
    """q_{c-1}(x_c) ``[B, N-1]``: the drafter's probability of each draft, in target ids."""
    if draft_index is None:
        return draft_probs.float().gather(2, x[..., None])[..., 0]
    col = draft_index.long()[x]  # [B, N-1]
    q = draft_probs.gather(2, col.clamp(min=0)[..., None])[..., 0].float()
    return torch.where(col >= 0, q, 0.0)
