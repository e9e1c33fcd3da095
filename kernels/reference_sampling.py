"""Plain-PyTorch specification of lossless rejection sampling (docs/design.md §6).

Vectorised over the batch so statistical tests can draw 1e5 rows at once; arithmetic is float32
in the kernel's order wherever that makes results equal.

Randomness: Philox4x32-10 keyed by the request seed (k0, k1 = its low, high 32 bits), counter
(c0, c1, c2, c3) = (position, node, purpose, lane):

* acceptance uniform of child node c: (offset + depth(parent(c)), c, 0, 0), word 0;
* tile race of row / node j: (offset + depth(j), j, 2, t), word 0 for tile t;
* token race of row / node j: (offset + depth(j), j, 1, lane(i)), word(i) for token i,

with G = RNG_GROUP: lane(i) = i // 4G * G + i % G and word(i) = i // G % 4, so one Philox call
feeds four runs of G tokens (a quarter of the calls of one per token).

A draw from a row's law is two-level (:func:`draw_tile`): the vocabulary is cut into tiles of
TILE = 4G tokens (one Philox block of the token race); an exponential race over the tiles'
exact integer masses picks a tile, and the token race, run over that tile's tokens only,
picks the token. A pass over the row then needs per token one exp and one conversion to
int64 (the tile's mass), not random numbers and two logarithms; the random numbers of the
token race are drawn for TILE tokens, whatever the vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

RNG_GROUP = 512
MASS_SCALE = 2.0**44  # top-p's fixed-point weights (keep_threshold); V * 2**44 < 2**63
_U32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox multipliers
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # Weyl key increments


def philox4x32(seed: Tensor, c0, c1, c2, c3) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 (Salmon et al., 2011) on broadcastable int64 tensors holding uint32s.

    The counters are broadcast to one shape up front so that every round can work in place
    (the CPU engine runs this over batch x vocabulary / 4 lanes: fewer full-size passes and
    temporaries)."""
    seed = torch.as_tensor(seed)
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    c0, c1, c2, c3 = (torch.as_tensor(c, device=seed.device) & _U32 for c in (c0, c1, c2, c3))
    shape = torch.broadcast_shapes(k0.shape, c0.shape, c1.shape, c2.shape, c3.shape)
    c0, c1, c2, c3 = (c.expand(shape).contiguous() for c in (c0, c1, c2, c3))
    for _ in range(10):
        prod_a, prod_b = c0 * _ROUND_A, c2 * _ROUND_B  # < 2**64: wraps, all 64 bits kept
        # (hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a) with hi = product >> 32, lo = its low
        # half. lo is kept whole (its high half is garbage): it is only ever xored into a
        # word that is masked before the next product, and masked at the end.
        c0 = (prod_b >> 32).bitwise_xor_(c1).bitwise_xor_(k0).bitwise_and_(_U32)
        c2 = (prod_a >> 32).bitwise_xor_(c3).bitwise_xor_(k1).bitwise_and_(_U32)
        c1, c3 = prod_b, prod_a
        k0, k1 = (k0 + _KEY_A) & _U32, (k1 + _KEY_B) & _U32
    c1, c3 = c1.bitwise_and_(_U32), c3.bitwise_and_(_U32)
    return c0, c1, c2, c3


def uniform_from_bits(x: Tensor) -> Tensor:
    """uint32 → float32 uniform on (0, 1] (24 bits): never 0, so u·q ≤ p is never free."""
    return ((x >> 8) + 1).float() * 2.0**-24


def exponential_from_bits(x: Tensor) -> Tensor:
    """uint32 → Exp(1) float32 as -log(1 - w), w = (x + ½)·2⁻³², in (0, 16.7]: never 0 or inf.

    Fine steps near E = 0 matter: a token whose E is 0 would win every race. For small w,
    -log(1 - w) = w + w²/2 + O(w³) avoids the rounding of 1 - w.
    """
    w = ((x.float() + 0.5) * 2.0**-32).clamp(max=1.0 - 2.0**-24)
    return torch.where(w < 2.0**-12, w + 0.5 * w * w, -torch.log(1.0 - w))


def race_exponentials(seeds: Tensor, positions: Tensor, node: int | Tensor,
                      vocab: int) -> Tensor:
    """E[b, i] of the sampling race of row `node` ([B, V]); see the counter layout above.
    ``node`` is one row for all of the batch or one per batch row (``[B]``).

    Each Philox call (lane) is made once and its four words laid out as the four runs of G
    tokens they feed: lanes ``[B, blocks * G]`` -> words ``[B, blocks, 4, G]`` -> tokens."""
    bsz, group = len(seeds), RNG_GROUP
    full, rest = divmod(vocab, 4 * group)  # whole blocks of 4G tokens, tokens past them
    tail = min(group, rest)  # lanes the last block needs: its tokens < rest only
    lane = torch.arange(full * group + tail, device=seeds.device)
    if isinstance(node, Tensor):
        node = node[:, None]
    words = philox4x32(seeds[:, None], positions[:, None], node, 1, lane)  # 4 x [B, lanes]
    parts = []
    if full:  # [B, full, 4, G]: block b's word w drives tokens b * 4G + w * G + lane
        parts.append(torch.stack([w[:, : full * group].view(bsz, full, group) for w in words],
                                 2).view(bsz, -1))
    if rest:  # the last block's lanes, [B, 4, tail]: tokens w * G + lane < rest (with
        # rest < G only word 0 is read, and w * tail + lane = lane there)
        parts.append(torch.stack([w[:, full * group:] for w in words], 1).view(bsz, -1)[:, :rest])
    bits = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return exponential_from_bits(bits)


TILE = 4 * RNG_GROUP  # tokens per tile of the two-level draw
TILE_PURPOSE = 2  # the tile race's counter word c2


def _per_tile(x: Tensor, reduce) -> Tensor:
    """``reduce(block, -1)`` over each tile of TILE tokens of x [B, V] -> [B, T] (the last
    tile may be short; no padding: a row far shorter than a tile stays that short)."""
    bsz, vocab = x.shape
    full = vocab // TILE
    parts = [reduce(x[:, : full * TILE].reshape(bsz, full, TILE), -1)] if full else []
    if vocab % TILE:
        parts.append(reduce(x[:, full * TILE:], -1)[:, None])
    return torch.cat(parts, 1)


def tile_max(z: Tensor) -> Tensor:
    """a [B, T]: the largest z of each tile of TILE tokens of z [B, V] (the last tile may be
    short; -inf for a tile whose tokens are all -inf)."""
    return _per_tile(z, lambda t, d: t.amax(d))


def tile_sums(mass: Tensor) -> Tensor:
    """S [B, T] int64: the sums of integer masses [B, V] over each tile (exact, any order)."""
    return _per_tile(mass, lambda t, d: t.sum(d))


def fixed_point(x: Tensor) -> Tensor:
    """floor(x * 2**44) in int64 for float32 x in [0, 1]: exact (x * 2**44 is a float32)."""
    return (x * MASS_SCALE).floor().long()


def tile_masses(z: Tensor, live: Tensor) -> tuple[Tensor, Tensor]:
    """(W [B, V] int64, a [B, T]): a token's mass relative to its tile's largest z,
    W = floor(exp(z - a_tile) * 2**44) where ``live`` (and z > -inf), else 0. a is the tile's
    largest z over all its tokens, live or not, so that W <= 2**44 and a tile's sum S < 2**55."""
    a = tile_max(z)
    a_tok = a[:, torch.arange(z.shape[1], device=z.device) // TILE]  # [B, V]: each token's
    d = torch.where(live & (z > float("-inf")), z - a_tok, float("-inf"))
    return fixed_point(torch.exp(d)), a


def draw_tile(seeds: Tensor, positions: Tensor, node: int | Tensor, sums: Tensor,
              bias: Tensor | None) -> Tensor:
    """The tile race: t [B] int64 with P(t) = S_t e^{b_t} / sum_u S_u e^{b_u}, or -1 where
    every S_t is 0. ``sums`` S [B, T] int64; ``bias`` b [B, T] float32 (the tiles' anchors a
    of :func:`tile_masses`) or None (0: masses already on one scale, the residual's).

    argmax_t (b_t + log S_t - log E_t), E_t ~ Exp(1) from counter (pos, node, 2, t) word 0, in
    float32 in that order; S_t = 0 never wins. With the token race inside the winning tile
    (weights e^{z_i}), a token's probability is e^{z_i} / sum e^z up to the masses' floor:
    under TILE * 2**-44 of the tile's largest weight (~1e-10)."""
    tiles = sums.shape[1]
    if isinstance(node, Tensor):
        node = node[:, None]
    lane = torch.arange(tiles, device=sums.device)
    e = exponential_from_bits(philox4x32(seeds[:, None], positions[:, None], node,
                                         TILE_PURPOSE, lane)[0])
    log_s = torch.log(sums.float())
    key = (log_s if bias is None else bias + log_s) - torch.log(e)  # the kernel's order
    key = torch.where(sums > 0, key, float("-inf"))
    return _argmax_or(key, float("-inf"), torch.full_like(sums[:, 0], -1))


def in_tile(keys: Tensor, tile: Tensor, fill: float) -> Tensor:
    """keys [B, V] with every token outside tile ``tile[b]`` (-1: all of them) set to fill."""
    owner = torch.arange(keys.shape[1], device=keys.device) // TILE
    return torch.where(owner[None] == tile[:, None], keys, fill)


def tile_exponentials(seeds: Tensor, positions: Tensor, node: int | Tensor,
                      tile: Tensor) -> Tensor:
    """E [B, TILE] of the token race of row ``node`` for the tokens of tile ``tile[b]``
    (``race_exponentials``'s values at tokens tile * TILE + i: the tile's G lanes, each
    called once, its four words laid out as the four runs of G tokens they feed)."""
    group = RNG_GROUP
    if isinstance(node, Tensor):
        node = node[:, None]
    lane = tile.clamp(min=0)[:, None] * group + torch.arange(group, device=seeds.device)
    words = philox4x32(seeds[:, None], positions[:, None], node, 1, lane)  # 4 x [B, G]
    return exponential_from_bits(torch.stack(words, 1).view(len(seeds), TILE))


def keep_threshold(z: Tensor, top_k: Tensor, top_p: Tensor,
                   log_min_p: Tensor | None = None) -> Tensor:
    """tau [B] such that temperature-scaled logits z [B, V] keep exactly {z >= tau}.

    min-p (vLLM's order: first) keeps {z >= max(z) + log_min_p} (p_i >= min_p * p_max, with
    log_min_p = log(min_p) in float32, -inf = off; the sum is taken in float32, as the kernel
    takes it). top-k then keeps every z >= the k-th largest of those (ties kept), which is the
    larger of the two cuts (if min-p keeps more than k tokens, the k-th largest is among
    them); top-p then keeps the smallest prefix of the renormalised kept probabilities, by
    descending value, whose mass reaches top_p, plus every tie of its last entry. All are
    "z >= a value of z", so tau is one of the z.

    top-p's masses are exact: weights in fixed point, W = floor(exp(z - max z) * 2**44) in
    int64 (no overflow for V < 2**19), summed exactly; the prefix test is float64(sum W) <
    float64(top_p) * float64(sum of the kept W), deterministic IEEE operations on the same
    integers. A float32 sum depends on its order (a sorted cumsum and the kernel's counting
    passes round differently, and did flip the last token of rows with top_p near 1); an
    integer sum does not, so any implementation that finds the cut by other means — the
    kernel's sort-free threshold search — keeps the same tokens. The rule is real-valued top-p
    up to the weights' floor: under V * 2**-44 of the top weight in all (< 1e-8 for V = 152k,
    finer than float32's 2**-24 of the kept mass).
    """
    vocab = z.shape[-1]
    zs = z.sort(dim=-1, descending=True).values  # [B, V]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k.long(), vocab)
    kth = zs.gather(1, (k - 1)[:, None])  # [B, 1]
    if log_min_p is not None:
        cut = zs[:, :1] + log_min_p.float()[:, None]  # max(z) + log(min_p), float32
        # the smallest z >= cut (a value of z; max(z) itself always passes: log_min_p <= 0)
        z_cut = torch.where(zs >= cut, zs, float("inf")).min(1, keepdim=True).values
        kth = torch.maximum(kth, z_cut)
    w = torch.where(zs >= kth, torch.exp(zs - zs[:, :1]), 0.0)  # sorted top-k weights
    fixed = (w * MASS_SCALE).floor().long().cumsum(1)  # exact (see above)
    need = top_p.double() * fixed[:, -1].double()
    short = fixed.double() < need[:, None]  # prefix entries before the mass is reached
    tau_p = zs.gather(1, short.sum(1, keepdim=True).clamp(max=vocab - 1))
    return torch.where((top_p < 1)[:, None], torch.maximum(tau_p, kth), kth)[:, 0]


def _argmax_or(keys: Tensor, floor: float, fallback: Tensor) -> Tensor:
    """Lowest index of the largest key per row, or `fallback` where no key exceeds `floor`."""
    best = keys.max(1)
    return torch.where(best.values > floor, keys.argmax(1), fallback)


def draft_probs_in_target_vocab(q: Tensor, draft_index: Tensor) -> Tensor:
    """A drafter's distributions over its own vocabulary ``q [..., Vd]`` as distributions over
    the target's ``[..., V]``: target token ``t`` has ``q[..., draft_index[t]]`` where
    ``draft_index[t] >= 0`` and 0 where the drafter has no id for it (an EAGLE-3 head's
    reduced vocabulary: ``draft_index`` is its ``t2d`` as column numbers)."""
    idx = draft_index.long()
    return torch.where(idx >= 0, q[..., idx.clamp(min=0)].float(), 0.0)


def rejection_sample(
    target_logits: Tensor,  # [B, N, V] float32 / float16 / bfloat16
    draft_token_ids: Tensor,  # [B, N-1] int: chain: draft j, judged by row j; tree: node j+1
    num_draft_tokens: Tensor,  # [B] int: chain 0..N-1; tree N-1 or 0
    draft_probs: Tensor | None,  # [B, N-1, V] q each draft was drawn from ([.., Vd]: below)
    temperature: Tensor,  # [B] float32, 0 = greedy
    top_k: Tensor,  # [B] int, <= 0 = off
    top_p: Tensor,  # [B] float32 in (0, 1]
    seeds: Tensor,  # [B] int64
    offsets: Tensor,  # [B] int64: position of the token emitted at row 0
    tree_parents: Tensor | None,  # [N] int: parents[0] = -1, parents[j] < j; None = chain
    log_min_p: Tensor | None = None,  # [B] float32 log(min_p), -inf = off; None: all off
    *,
    draft_index: Tensor | None = None,  # [V] int: draft_probs column of target token t, or -1
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Lossless speculative sampling: (output_ids [B, N] int64 (-1 pad), num_accepted [B] int32,
    logprobs [B, N] float32 (0 pad), row_ids [B, N] int32 (-1 pad)). Inputs assumed valid.

    The processed law of a sampled row is temperature → min-p → top-k → top-p
    (:func:`keep_threshold`); logits may hold -inf (tokens masked out, e.g. by ``min_tokens``:
    never kept, never emitted), never +inf or NaN, and a row the walk reads has a finite logit
    (the launcher's value checks refuse the rest).

    With ``draft_index`` the drafts were drawn from ``draft_probs [B, N-1, Vd]`` over the
    drafter's own vocabulary: the distribution judged is exactly that one in target ids
    (:func:`draft_probs_in_target_vocab`: 0 at target tokens the drafter cannot propose), and
    a rejection's residual ``max(p - q, 0)`` covers the whole target vocabulary.

    Trees: without ``draft_probs`` the children are point masses, tried in node order against
    the running residual. With it, each node's children were drawn from ``draft_probs`` at
    the child (its parent's ``q``) one after another without replacement, and the row judges
    them by recursive rejection sampling (:func:`_sampled_children`); a chain-shaped tree then
    gives the chain's outputs exactly."""
    bsz, n_rows, vocab = target_logits.shape
    dev = target_logits.device
    tree = tree_parents is not None
    parents = tree_parents.long().tolist() if tree else list(range(-1, n_rows - 1))
    depth = [0] * n_rows
    for c in range(1, n_rows):
        depth[c] = depth[parents[c]] + 1
    n = num_draft_tokens.long()
    # used[b, c]: node c (draft c - 1) takes part in this step.
    c_all = torch.arange(n_rows, device=dev)
    used = ((n[:, None] > 0) if tree else (c_all[None] <= n[:, None])) & (c_all[None] > 0)
    drafts = torch.cat([torch.zeros_like(n[:, None]), draft_token_ids.long()], 1)  # by node
    drafts = drafts.clamp(0, vocab - 1)
    greedy = temperature == 0
    inv_t = torch.where(greedy, torch.ones_like(temperature), temperature.reciprocal())
    seeds = seeds.long()
    rows = torch.arange(bsz, device=dev)

    tok_end = torch.zeros(bsz, n_rows, dtype=torch.long, device=dev)  # emitted if the walk ends
    lp_end = torch.zeros(bsz, n_rows, device=dev)
    p_child = torch.zeros(bsz, n_rows, device=dev)  # p_parent(c)(x_c); greedy: 1 iff x_c = argmax
    lp_child = torch.zeros(bsz, n_rows, device=dev)
    acc = torch.zeros(bsz, n_rows, dtype=torch.bool, device=dev)  # chains: draft of node c passes
    # sampled trees: the child each node accepts (0: none), decided at the node's row
    pick = torch.zeros(bsz, n_rows, dtype=torch.long, device=dev)
    # Child c is only ever tried at its parent, so its uniform's position is fixed.
    u_child = [uniform_from_bits(philox4x32(seeds, offsets.long() + depth[max(parents[c], 0)],
                                            c, 0, 0)[0]) for c in range(n_rows)] if tree else []
    for j in range(n_rows):
        z = target_logits[:, j].float() * inv_t[:, None]  # [B, V]
        tau = torch.where(greedy, float("-inf"), keep_threshold(z, top_k, top_p, log_min_p))
        kept = z >= tau[:, None]
        m = z.max(1, keepdim=True).values
        w = torch.where(kept, torch.exp(z - m), 0.0)  # unnormalised p_j
        s = w.sum(1, keepdim=True)
        logp = torch.where(kept, z - m - torch.log(s), float("-inf"))
        argmax = z.argmax(1)
        pos = offsets.long() + depth[j]
        # Two-level draw (draw_tile): a tile by the race over the kept tiles' masses, then in
        # it the exponential race argmax_i p_i / E_i = argmax_i z_i - log E_i, an exact draw.
        e = race_exponentials(seeds, pos, j, vocab)
        g = torch.where(kept, z - torch.log(e), float("-inf"))
        mass, anchor = tile_masses(z, kept)
        t_plain = draw_tile(seeds, pos, j, tile_sums(mass), anchor)
        plain = torch.where(greedy, argmax, in_tile(g, t_plain, float("-inf")).argmax(1))
        kids = [c for c in range(1, n_rows) if parents[c] == j]
        if tree and draft_probs is not None:  # sampled children: this row decides its own
            pick[:, j], end = _sampled_children(w / s, argmax, drafts, used, kids, draft_probs,
                                                draft_index, greedy, seeds, pos, j, e, plain,
                                                u_child)
        else:
            excl = torch.zeros_like(kept)
            for c in kids:
                excl[rows, drafts[:, c]] |= used[:, c]
            # All point-mass children rejected: sample p_j with their tokens removed.
            t_rest = draw_tile(seeds, pos, j, tile_sums(mass.masked_fill(excl, 0)), anchor)
            end = _argmax_or(in_tile(g.masked_fill(excl, float("-inf")), t_rest,
                                     float("-inf")), float("-inf"), plain)
        for c in kids:
            x = drafts[:, c : c + 1]
            p_x = (w.gather(1, x) / s)[:, 0]
            p_child[:, c] = torch.where(greedy, (x[:, 0] == argmax).float(), p_x)
            lp_child[:, c] = logp.gather(1, x)[:, 0]
            if tree:
                continue
            # Accept x iff u·q(x) <= p(x) (q = 1 for a point mass): P(accept) = min(1, p/q), and
            # a rejection is followed by a draw of norm(max(p - q, 0)), which together give p.
            u = uniform_from_bits(philox4x32(seeds, pos, c, 0, 0)[0])
            if draft_probs is None:
                ok = (p_child[:, c] > 0) & (u <= p_child[:, c])
            else:
                q = draft_probs[:, c - 1].float()
                if draft_index is not None:
                    q = draft_probs_in_target_vocab(q, draft_index)
                qx = q.gather(1, x)[:, 0]
                ok = (qx > 0) & (u * qx <= p_child[:, c])
                r = (w / s - q).clamp(min=0)
                t_r = draw_tile(seeds, pos, j, tile_sums(fixed_point(r)), None)
                key = in_tile(torch.where(r > 0, r / e, -1.0), t_r, -1.0)
                end = torch.where(ok | ~used[:, c], end, _argmax_or(key, 0.0, plain))
            acc[:, c] = torch.where(greedy, x[:, 0] == argmax, ok)
        tok_end[:, j] = torch.where(greedy, argmax, end)
        lp_end[:, j] = logp.gather(1, tok_end[:, j : j + 1])[:, 0]

    out = torch.full((bsz, n_rows), -1, dtype=torch.long, device=dev)
    out_lp = torch.zeros(bsz, n_rows, device=dev)
    row_ids = torch.full((bsz, n_rows), -1, dtype=torch.int32, device=dev)
    if not tree:
        fail = used & ~acc
        num_acc = torch.where(fail.any(1), fail.float().argmax(1) - 1, n)  # first rejected - 1
        i = c_all[None].expand(bsz, -1)
        out = torch.where(i < num_acc[:, None], drafts.roll(-1, 1), out)
        out_lp = torch.where(i < num_acc[:, None], lp_child.roll(-1, 1), out_lp)
        out[rows, num_acc] = tok_end[rows, num_acc]
        out_lp[rows, num_acc] = lp_end[rows, num_acc]
        row_ids = torch.where(i <= num_acc[:, None], i.int(), row_ids)
        return out, num_acc.int(), out_lp, row_ids

    # Tree walk: at each node try its children in order, each as a point mass on the residual
    # r (p_node minus earlier siblings' tokens): accept c iff u·sum(r) <= r(x_c).
    node = torch.zeros(bsz, dtype=torch.long, device=dev)
    done = torch.zeros(bsz, dtype=torch.bool, device=dev)
    num_acc = torch.zeros(bsz, dtype=torch.long, device=dev)
    for step in range(max(depth) + 1):  # a walk accepts at most max-depth nodes
        found = torch.zeros_like(done)
        nxt = torch.zeros_like(node)
        if draft_probs is not None:  # sampled children: the node's row chose (pick)
            nxt = pick[rows, node]
            found = nxt > 0
        else:
            mass = torch.ones(bsz, device=dev)  # sum(r), updated in the kernel's float32 order
            for c in range(1, n_rows):
                try_c = (parents[c] == node) & used[:, c] & ~found & ~done
                dup = torch.zeros_like(done)
                for c2 in range(1, c):
                    dup |= (parents[c2] == node) & (drafts[:, c2] == drafts[:, c])
                r = torch.where(dup, 0.0, p_child[:, c])
                ok = (r > 0) & (greedy | (u_child[c] * mass <= r))
                nxt = torch.where(try_c & ok, c, nxt)
                found |= try_c & ok
                mass = torch.where(try_c & ~ok, mass - r, mass)
        live = ~done
        b, at = rows[live], torch.full_like(rows[live], step)
        out[b, at] = torch.where(found, drafts[rows, nxt], tok_end[rows, node])[live]
        out_lp[b, at] = torch.where(found, lp_child[rows, nxt], lp_end[rows, node])[live]
        row_ids[b, at] = node[live].int()
        num_acc += found.long()
        node = torch.where(found, nxt, node)
        done |= ~found
    return out, num_acc.int(), out_lp, row_ids


def _sampled_children(p: Tensor, argmax: Tensor, drafts: Tensor, used: Tensor, kids: list[int],
                      draft_probs: Tensor, draft_index: Tensor | None, greedy: Tensor,
                      seeds: Tensor, pos: Tensor, j: int, e: Tensor, plain: Tensor,
                      u_child: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Row ``j`` of a tree whose children were drawn from ``q`` without replacement (recursive
    rejection sampling, Jeon et al. 2024): ``(pick [B], end [B])``, the child the row accepts
    (0: none) and the token emitted if none is.

    Child ``c_i`` (in node order) was drawn from ``Q_i = q / D_i`` off the earlier siblings'
    tokens (0 there), ``q = draft_probs[:, c_i - 1]`` and ``D_i = 1 - sum of q at those
    tokens``. Against the running target ``r`` (``r_0 = p``) it is kept iff ``u·Q_i(x) <=
    r(x)`` (probability ``min(1, r/Q_i)``); a rejection makes ``r = norm(max(r - Q_i, 0))``.
    One such step emits a draw of ``r`` whatever ``Q_i`` is, and given a rejection the rest
    is again a draw of the new ``r``, so the row emits exactly ``p``; with no child kept,
    ``end`` is a draw of the last ``r``. A rejected token has ``Q_i(x) > r(x)``, so the new
    ``r`` is 0 there. A child at which ``Q_i`` is 0 (past ``q``'s support, or a repeat) was
    not drawn from ``Q_i``: it is skipped, ``r`` left as it was. Greedy rows keep the first
    child that is the argmax.

    ``r`` is held unnormalised with its total ``z`` (``r_0 = p``, ``z = 1``; a rejection:
    ``r = max(r - z·Q_i, 0)``, ``z = sum(r)``, summed as :func:`fixed_point` integers so that
    the kernel's order gives the same float32), and the test is ``u·Q_i(x)·z <= r(x)``: for
    a one-child row these are the chain's operations on the same numbers, so a chain-shaped
    tree draws what the chain draws."""
    bsz = p.shape[0]
    rows = torch.arange(bsz, device=p.device)
    pick = torch.zeros(bsz, dtype=torch.long, device=p.device)
    taken = torch.zeros_like(p, dtype=torch.bool)  # earlier siblings' tokens
    r, z = p, torch.ones(bsz, device=p.device)
    left = torch.ones(bsz, device=p.device)  # D_i
    rejected = torch.zeros(bsz, dtype=torch.bool, device=p.device)
    for c in kids:
        x = drafts[:, c]
        q = draft_probs[:, c - 1].float()
        if draft_index is not None:
            q = draft_probs_in_target_vocab(q, draft_index)
        q = q.masked_fill(taken, 0.0)
        big_q = q / left.clamp(min=1e-30)[:, None]
        qx, rx = big_q[rows, x], r[rows, x]
        open_ = used[:, c] & (pick == 0)
        valid = open_ & (qx > 0)
        ok = torch.where(greedy, open_ & (x == argmax), valid & (u_child[c] * qx * z <= rx))
        pick = torch.where(ok, c, pick)
        rej = valid & ~ok & ~greedy
        nr = (r - z[:, None] * big_q).clamp(min=0)
        # its total in fixed point, exact in any order (the kernel sums it in its own)
        nz = fixed_point(nr).sum(1).float() * 2.0**-44
        rej_r = rej & (nz > 0)
        r = torch.where(rej_r[:, None], nr, r)
        z = torch.where(rej_r, nz, z)
        rejected |= rej
        left = torch.where(valid, left - q[rows, x], left)
        taken[rows, x] |= valid
    t_r = draw_tile(seeds, pos, j, tile_sums(fixed_point(r)), None)
    key = in_tile(torch.where(r > 0, r / e, -1.0), t_r, -1.0)
    end = torch.where(rejected, _argmax_or(key, 0.0, plain), plain)
    return pick, end
