"""Triton building blocks of the rejection sampler: Philox, vocabulary passes, threshold search.

Every pass streams one logits row ``[V]`` once (``4 * RNG_GROUP`` tokens per step); the random
numbers follow ``reference.py`` bit for bit (Philox4x32-10, same counters, same conversions).
"""

from __future__ import annotations

import triton
import triton.language as tl

RNG_GROUP: tl.constexpr = tl.constexpr(512)  # = reference.RNG_GROUP
TILE_PURPOSE: tl.constexpr = tl.constexpr(2)  # = reference.TILE_PURPOSE (tiles: 4 * RNG_GROUP)
MASS_SCALE: tl.constexpr = tl.constexpr(17592186044416.0)  # = reference.MASS_SCALE (2**44)
INV_MASS_SCALE: tl.constexpr = tl.constexpr(5.684341886080802e-14)  # 2**-44
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
POS_INF: tl.constexpr = tl.constexpr(float("inf"))


@triton.jit
def philox(k0, k1, c0, c1, c2, c3):
    """Philox4x32-10 on uint32 scalars / blocks (same rounds as ``reference.philox4x32``)."""
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = a2 * 0xCD9E8D57
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def seed_key(seed_ptr, b):
    seed = tl.load(seed_ptr + b).to(tl.int64)
    return (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def uniform_from_bits(x):
    """uint32 → (0, 1], 24 bits (``reference.uniform_from_bits``)."""
    return ((x >> 8) + 1).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def acceptance_uniform(k0, k1, pos, node):
    """u of child `node` whose token would be emitted at `pos`: counter (pos, node, 0, 0)."""
    c0 = pos.to(tl.uint32)
    zero = c0 * 0
    r0, _, _, _ = philox(k0, k1, c0, (pos * 0 + node).to(tl.uint32), zero, zero)
    return uniform_from_bits(r0)


@triton.jit
def excluded(lane, draft_row_ptr, parents_ptr, j, n, N, V, IS_TREE: tl.constexpr):
    """Lanes holding the token of a child of node j (a draft judged at row j)."""
    out = lane < 0
    if IS_TREE:
        if n > 0:
            for c in range(1, N):
                if tl.load(parents_ptr + c) == j:
                    x = tl.load(draft_row_ptr + c - 1)
                    out = out | (lane == x)
    else:
        x = tl.load(draft_row_ptr + j, mask=j < n, other=-1)
        out = lane == tl.where(j < n, x, -1)
    return out


@triton.jit
def exponential_from_bits(bits):
    """uint32 → Exp(1) as -log(1 - w), w in (0, 1) (``reference.exponential_from_bits``)."""
    w = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994039535522)
    return tl.where(w < 0.000244140625, w + 0.5 * w * w, -tl.log(1.0 - w))


@triton.jit
def _race_counter(pos, j):
    """First three Philox counter words of the sampling race of row j: (pos, j, 1)."""
    c0 = pos.to(tl.uint32)
    c1 = j.to(tl.uint32)
    return c0, c1, c1 * 0 + 1


@triton.jit
def _word(r0, r1, r2, r3, w: tl.constexpr):
    """Word ``w`` of one Philox output: it drives tokens ``base + w * RNG_GROUP + lane``."""
    if w == 0:
        bits = r0
    elif w == 1:
        bits = r1
    elif w == 2:
        bits = r2
    else:
        bits = r3
    return bits


@triton.jit
def _chain_child_token(draft_row_ptr, j, n, IS_TREE: tl.constexpr):
    """Token of the chain draft judged at row j (row j's child), -1 if none or for trees."""
    x_ex = j * 0 - 1
    if not IS_TREE:
        x_ex = tl.where(j < n, tl.load(draft_row_ptr + j, mask=j < n, other=-1).to(tl.int32), -1)
    return x_ex


@triton.jit
def _children(at, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, IS_TREE: tl.constexpr):
    """Lanes ``at`` holding a token of row j's (used) children: the point-mass residual's
    exclusions (``x_ex``: a chain's one child token, -1 if none)."""
    if IS_TREE:
        out = excluded(at, draft_row_ptr, parents_ptr, j, n, N, V, True)
    else:
        out = at == x_ex
    return out


@triton.jit
def _drop_children(g, at, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, IS_TREE: tl.constexpr):
    """``g`` with the lanes of row j's children's tokens set to -inf (point-mass residual)."""
    return tl.where(_children(at, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, IS_TREE),
                    NEG_INF, g)


@triton.jit
def tile_key(e, bias, mass):
    """A tile's key in the tile race, bias + log(float32 mass) - log(E) in that order (the
    reference's float32 operations), -inf for a tile without mass."""
    key = bias + tl.log(tl.where(mass > 0, mass, 1).to(tl.float32)) - tl.log(e)
    return tl.where(mass > 0, key, NEG_INF)


@triton.jit
def tile_mass(z, a, live):
    """floor(exp(z - a) * 2**44) in int64 where ``live`` and z > -inf, else 0
    (``reference.tile_masses``; a: the tile's largest z, so the mass is at most 2**44)."""
    d = tl.where(live & (z > NEG_INF), z - a, NEG_INF)
    return tl.floor(tl.exp(d) * MASS_SCALE).to(tl.int64)


@triton.jit
def _load_tile(row_ptr, base, end, inv_t):
    """Token indices and z of the tile's four runs of RNG_GROUP tokens [base, base + 4G) (-inf
    past ``end``), and the tile's largest z."""
    G: tl.constexpr = RNG_GROUP
    at0 = base + tl.arange(0, G)
    at1 = at0 + G
    at2 = at0 + 2 * G
    at3 = at0 + 3 * G
    z0 = tl.load(row_ptr + at0, mask=at0 < end, other=NEG_INF).to(tl.float32) * inv_t
    z1 = tl.load(row_ptr + at1, mask=at1 < end, other=NEG_INF).to(tl.float32) * inv_t
    z2 = tl.load(row_ptr + at2, mask=at2 < end, other=NEG_INF).to(tl.float32) * inv_t
    z3 = tl.load(row_ptr + at3, mask=at3 < end, other=NEG_INF).to(tl.float32) * inv_t
    a = tl.max(tl.maximum(tl.maximum(z0, z1), tl.maximum(z2, z3)), 0)
    return at0, at1, at2, at3, z0, z1, z2, z3, a


@triton.jit
def _lowest_argmax(g, i):
    """(max of the per-lane keys ``g``, lowest index ``i`` among lanes holding it, -1 if none)."""
    top = tl.max(g, 0)
    i = tl.min(tl.where((g == top) & (i >= 0), i, 2147483647), 0)
    return top, tl.where(i == 2147483647, -1, i)


TILES_MAX = 256  # tiles of 4 * RNG_GROUP tokens in a row: V < 2**19 (sampling_checks)


@triton.jit
def row_tile_scratch(tile_f_ptr, tile_i_ptr, row, V):
    """Row program ``row``'s part of the tiles' scratch (``rejection_sampling.tile_scratch``:
    ceil(V / tile) float32 largest z, then twice as many int64 masses)."""
    tiles = (V + 4 * RNG_GROUP - 1) // (4 * RNG_GROUP)
    return tile_f_ptr + row.to(tl.int64) * tiles, tile_i_ptr + row.to(tl.int64) * tiles * 2


@triton.jit
def first_pass(row_ptr, draft_row_ptr, parents_ptr, k0, k1, pos, j, n, N, V, inv_t, tile_f_ptr,
               tile_i_ptr, IS_TREE: tl.constexpr, TB: tl.constexpr):
    """Pass 1 over a sampled row: (max, sum exp(z - max), min, t1, t2), t1 / t2 the winners of
    the two tile races (``reference.draw_tile``) — over all tokens and over all but row j's
    children's tokens (its point-mass residual). ``tile_f_ptr`` / ``tile_i_ptr``: the row's
    scratch for its tiles' statistics (``first_pass_part``); ``TB``: the tiles of a row,
    rounded up to a power of two (``tile_races``)."""
    _, zmin = first_pass_part(row_ptr, draft_row_ptr, parents_ptr, j, n, N, V, inv_t, 0, V,
                              tile_f_ptr, tile_i_ptr, IS_TREE)
    tl.debug_barrier()  # the tiles' statistics, visible to every thread of the program
    m, s, t1, t2 = tile_races(tile_f_ptr, tile_i_ptr, V, k0, k1, pos, j, j * 0 + 1, TB)
    return m, s, zmin, t1, t2


@triton.jit
def first_pass_part(row_ptr, draft_row_ptr, parents_ptr, j, n, N, V, inv_t, start, end,
                    tile_f_ptr, tile_i_ptr, IS_TREE: tl.constexpr):
    """``first_pass`` over tokens [start, end) (start a multiple of the tile, 4 * RNG_GROUP;
    end <= V): stores each tile's statistics (its largest z a at ``tile_f_ptr[t]``, its mass
    and its point-mass residual's at ``tile_i_ptr[2t]``, ``[2t + 1]``) and returns the part's
    (max, min). Parts cover whole tiles, so a split row's statistics are one pass's.

    One step per tile: its largest z a, then per token one exp and one conversion, the
    integer mass floor(exp(z - a) * 2**44), summed exactly. The random numbers and
    logarithms of the tile races come after the pass, for all tiles at once
    (``tile_races``)."""
    G: tl.constexpr = RNG_GROUP
    m = -3.4028234663852886e38 + inv_t * 0.0
    zmin = tl.full([G], POS_INF, tl.float32)
    x_ex = _chain_child_token(draft_row_ptr, j, n, IS_TREE)
    # its z (-inf if none: mass 0), taken out of its tile's mass below
    z_x = tl.load(row_ptr + tl.minimum(tl.maximum(x_ex, 0), V - 1),
                  mask=(x_ex >= 0) & (x_ex < V), other=NEG_INF).to(tl.float32) * inv_t
    for base in range(start, end, 4 * G):
        at0, at1, at2, at3, z0, z1, z2, z3, a = _load_tile(row_ptr, base, end, inv_t)
        # every token is live here: z - max(a, -FLT_MAX) is z - a, or -inf for z = -inf
        # (also when a = -inf: a tile of -inf only), so no select per token
        a_fin = tl.maximum(a, -3.4028234663852886e38)
        w0 = tl.floor(tl.exp(z0 - a_fin) * MASS_SCALE).to(tl.int64)
        w1 = tl.floor(tl.exp(z1 - a_fin) * MASS_SCALE).to(tl.int64)
        w2 = tl.floor(tl.exp(z2 - a_fin) * MASS_SCALE).to(tl.int64)
        w3 = tl.floor(tl.exp(z3 - a_fin) * MASS_SCALE).to(tl.int64)
        mass = tl.sum(w0 + w1 + w2 + w3, 0)
        # the point-mass residual's tile: the children's tokens' masses taken out
        if IS_TREE:
            out = tl.where(_children(at0, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, True),
                           w0, 0)
            out += tl.where(_children(at1, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, True),
                            w1, 0)
            out += tl.where(_children(at2, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, True),
                            w2, 0)
            out += tl.where(_children(at3, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, True),
                            w3, 0)
            rest = mass - tl.sum(out, 0)
        else:
            # a chain's one child token: its mass as a scalar, not a select per token (the
            # minimum changes nothing in its own tile, z_x <= a there; elsewhere it keeps
            # the unused value finite)
            w_x = tl.floor(tl.exp(tl.minimum(z_x - a_fin, 0.0)) * MASS_SCALE).to(tl.int64)
            rest = mass - tl.where(x_ex // (4 * G) == base // (4 * G), w_x, 0)
        zmin = tl.minimum(zmin, tl.where(at0 < end, z0, POS_INF))
        zmin = tl.minimum(zmin, tl.where(at1 < end, z1, POS_INF))
        zmin = tl.minimum(zmin, tl.where(at2 < end, z2, POS_INF))
        zmin = tl.minimum(zmin, tl.where(at3 < end, z3, POS_INF))
        t = base // (4 * G)
        tl.store(tile_f_ptr + t, a)
        tl.store(tile_i_ptr + 2 * t, mass)
        tl.store(tile_i_ptr + 2 * t + 1, rest)
        m = tl.maximum(m, a)
    return m, tl.min(zmin, 0)


@triton.jit
def tile_races(tile_f_ptr, tile_i_ptr, V, k0, k1, pos, j, rest_on_scale, TB: tl.constexpr):
    """The row's tile races from its tiles' statistics (``first_pass_part`` / ``tile_pass``),
    all tiles at once: (max z, sum exp(z - max), t1, t2) with t1 the winner of the race over
    the masses, t2 over the residual's (-1 where no tile has mass). Keys as
    ``reference.draw_tile``: b_t + log S_t - log E_t, b_t = a_t (``rest_on_scale`` 0 for the
    residual max(p - q, 0), whose masses are on one scale: b_t = 0); E_t from counter
    (pos, j, 2, t). Ties go to the lowest tile, as the reference's argmax. The sum is
    sum_t S_t * 2**-44 * exp(a_t - max), within TILE * 2**-44 of each tile's top weight.
    ``TB``: the row's tiles rounded up to a power of two (``tile_block``), one lane each."""
    G: tl.constexpr = RNG_GROUP
    t = tl.arange(0, TB)
    has = t * (4 * G) < V
    a = tl.load(tile_f_ptr + t, mask=has, other=NEG_INF)
    mass = tl.load(tile_i_ptr + 2 * t, mask=has, other=0)
    rest = tl.load(tile_i_ptr + 2 * t + 1, mask=has, other=0)
    c0 = (pos + t * 0).to(tl.uint32)
    r0, _, _, _ = philox(k0, k1, c0, (pos * 0 + j).to(tl.uint32) + c0 * 0, c0 * 0 + TILE_PURPOSE,
                         t.to(tl.uint32))
    e = exponential_from_bits(r0)
    key1 = tile_key(e, a, mass)
    key2 = tile_key(e, tl.where(rest_on_scale != 0, a, 0.0), rest)
    top1, t1 = _lowest_argmax(key1, t)
    top2, t2 = _lowest_argmax(key2, t)
    m = tl.maximum(tl.max(a, 0), -3.4028234663852886e38)
    s = tl.sum(tl.where(mass > 0, mass.to(tl.float32) * INV_MASS_SCALE * tl.exp(a - m), 0.0), 0)
    return m, s, tl.where(top1 > NEG_INF, t1, -1), tl.where(top2 > NEG_INF, t2, -1)


@triton.jit
def merge_parts(part_f_ptr, part_i_ptr, C):
    """One greedy row's ``greedy_pass`` from the C parts written by ``_part_kernel`` over
    consecutive token ranges, in order: (max, sum exp(z - max), argmax). The argmax merges
    exactly (the first part holding the max, whose winner has the lower index, as in one
    pass); only the sum's rounding differs from one pass. (A sampled row's parts store its
    tiles' statistics instead: ``merged_max_min`` and ``tile_races``.)"""
    m = -3.4028234663852886e38 + tl.load(part_f_ptr) * 0.0
    i1 = C * 0 - 1
    for c in range(0, C):
        m_c = tl.load(part_f_ptr + c * 5)
        i1 = tl.where(m_c > m, tl.load(part_i_ptr + c * 2), i1)
        m = tl.maximum(m, m_c)
    s = m * 0.0
    for c in range(0, C):
        s += tl.load(part_f_ptr + c * 5 + 1) * tl.exp(tl.load(part_f_ptr + c * 5) - m)
    return m, s, i1


@triton.jit
def greedy_pass(row_ptr, V, BLOCK: tl.constexpr):
    """One pass over a greedy row: argmax (lowest index), max and sum exp(logit - max)."""
    return greedy_pass_part(row_ptr, 0, V, BLOCK)


@triton.jit
def greedy_pass_part(row_ptr, start, end, BLOCK: tl.constexpr):
    """``greedy_pass`` over tokens [start, end): (max, sum exp(logit - max), argmax)."""
    lane = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -3.4028234663852886e38, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    arg = tl.full([BLOCK], -1, tl.int32)
    for base in range(start, end, BLOCK):
        z = tl.load(row_ptr + base + lane, mask=base + lane < end, other=NEG_INF).to(tl.float32)
        e = tl.exp(-tl.abs(z - m))
        s = tl.where(z > m, s * e + 1.0, s + e)
        arg = tl.where(z > m, base + lane, arg)
        m = tl.maximum(m, z)
    m_row = tl.max(m, 0)
    arg = tl.min(tl.where((m == m_row) & (arg >= 0), arg, 2147483647), 0)
    return m_row, tl.sum(s * tl.exp(m - m_row), 0), arg


@triton.jit
def min_p_pass(row_ptr, V, inv_t, m, cut, BLOCK: tl.constexpr):
    """The min-p cut of a row: (smallest z >= cut, sum of exp(z - m) and count over z >= cut),
    cut = max(z) + log(min_p) (``reference.keep_threshold``). One pass over the row."""
    lane = tl.arange(0, BLOCK)
    zc = tl.full([BLOCK], POS_INF, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    cnt = tl.zeros([BLOCK], tl.int32)
    for base in range(0, V, BLOCK):
        at = base + lane
        z = tl.load(row_ptr + at, mask=at < V, other=NEG_INF).to(tl.float32) * inv_t
        ge = (at < V) & (z >= cut)
        zc = tl.minimum(zc, tl.where(ge, z, POS_INF))
        s += tl.where(ge, tl.exp(z - m), 0.0)
        cnt += ge.to(tl.int32)
    return tl.min(zc, 0), tl.sum(s, 0), tl.sum(cnt, 0)


@triton.jit
def _ordered_key(x):
    """float32 → int32 with the same order (negative floats have their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key_to_float(k):
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _search_load(src_ptr, at, n, scale):
    """z of entries ``at`` of a row (scale = 1 / temperature) or of a candidate buffer (float32
    z, scale = 1); entries past ``n`` read -inf, which adds nothing anywhere (below every
    pivot, weight 0), so they need no mask downstream."""
    return tl.load(src_ptr + at, mask=at < n, other=NEG_INF).to(tl.float32) * scale


SEARCH_CAP_ENTRIES = 16384  # float32 entries of scratch per searched row (launchers allocate)
SEARCH_CAP: tl.constexpr = tl.constexpr(SEARCH_CAP_ENTRIES)


@triton.jit
def _pivot_tile(z, piv, m, lo0, cnt, imass, itot, BY_MASS: tl.constexpr):
    """Adds one tile of z [SBLOCK] to the per-pivot, per-lane partials [P, SBLOCK] of a pass:
    count (top-k) or integer mass (top-p: ``reference.keep_threshold``'s fixed-point weights
    floor(exp(z - m) * 2**44), whose sums are exact in any order) of {z >= pivot}.

    The token axis is the tile's last (fastest) one, so each lane holds its own tokens and all
    P pivots of them: a token's load, exp and 64-bit conversion happen once, not once per
    pivot lane (with tokens first, Triton spread the pivots over 16 lanes that each
    recomputed them: 455 instructions per token per pass on sm_90a, now ~5 per pivot)."""
    ge = z[None, :] >= piv[:, None]
    if BY_MASS:
        wi = tl.floor(tl.exp(z - m) * MASS_SCALE).to(tl.int64)  # exact: w * 2**44 is a float32
        imass += tl.where(ge, wi[None, :], 0)
        itot += tl.where(z >= lo0, wi, 0)
    else:
        cnt += ge.to(tl.int32)
    return cnt, imass, itot


@triton.jit
def _pivot_pass(src_ptr, n, scale, m, piv, lo0, BY_MASS: tl.constexpr, P: tl.constexpr,
                SBLOCK: tl.constexpr):
    """One pass over ``n`` entries: per pivot, #{z >= pivot} (top-k) or W(pivot) =
    sum_{z >= pivot} floor(exp(z - m) * 2**44) (top-p), and W(lo0)."""
    cnt = tl.zeros([P, SBLOCK], tl.int32)
    imass = tl.zeros([P, SBLOCK], tl.int64)
    itot = tl.zeros([SBLOCK], tl.int64)
    # Four tiles per step, all loaded before any is used: four loads in flight instead of
    # one (a pass is ~n / SBLOCK dependent steps; one load each left it latency-bound).
    for base in range(0, n, 4 * SBLOCK):
        at = base + tl.arange(0, SBLOCK)
        z0 = _search_load(src_ptr, at, n, scale)
        z1 = _search_load(src_ptr, at + SBLOCK, n, scale)
        z2 = _search_load(src_ptr, at + 2 * SBLOCK, n, scale)
        z3 = _search_load(src_ptr, at + 3 * SBLOCK, n, scale)
        cnt, imass, itot = _pivot_tile(z0, piv, m, lo0, cnt, imass, itot, BY_MASS)
        cnt, imass, itot = _pivot_tile(z1, piv, m, lo0, cnt, imass, itot, BY_MASS)
        cnt, imass, itot = _pivot_tile(z2, piv, m, lo0, cnt, imass, itot, BY_MASS)
        cnt, imass, itot = _pivot_tile(z3, piv, m, lo0, cnt, imass, itot, BY_MASS)
    return tl.sum(cnt, 1), tl.sum(imass, 1), tl.sum(itot, 0)


@triton.jit
def _snap_tile(z, k: tl.constexpr, lane, lo_v, hi_v, m, zlo, zhi, n_k, f_above, buf_ptr,
               WRITE: tl.constexpr, ABOVE: tl.constexpr, SLOTS: tl.constexpr):
    """One tile of ``_snap_pass`` (sub-tile ``k`` of a step); ``n_k``: its columns' lengths."""
    SBLOCK: tl.constexpr = z.shape[0]
    inside = (z >= lo_v) & (z < hi_v)
    zlo = tl.minimum(zlo, tl.where(inside, z, POS_INF))
    zhi = tl.maximum(zhi, tl.where(inside, z, NEG_INF))
    if ABOVE:
        f_above += tl.where(z >= hi_v, tl.exp(z - m), 0.0)
    if WRITE:
        tl.store(buf_ptr + (n_k * 4 + k) * SBLOCK + lane, z, mask=inside & (n_k < SLOTS))
    return zlo, zhi, n_k + inside.to(tl.int32), f_above


@triton.jit
def _pad_column(buf_ptr, n_k, k: tl.constexpr, lane, longest):
    """-inf in the slots of sub-tile k's columns past their lengths, up to ``longest``."""
    SBLOCK: tl.constexpr = lane.shape[0]
    for slot in range(0, longest):
        tl.store(buf_ptr + (slot * 4 + k) * SBLOCK + lane, NEG_INF, mask=slot >= n_k)


@triton.jit
def _snap_pass(src_ptr, n, scale, m, lo_v, hi_v, buf_ptr, WRITE: tl.constexpr,
               ABOVE: tl.constexpr, SBLOCK: tl.constexpr):
    """One cheap pass (no pivots) over ``n`` entries: (the smallest and the largest z in
    [lo_v, hi_v), (WRITE) the buffer's length or -1, (ABOVE) the float32 mass sum exp(z - m)
    of z >= hi_v).

    WRITE compacts the entries of [lo_v, hi_v) into ``buf_ptr`` with no communication between
    lanes: element e of the step's 4 * SBLOCK appends its own entries to column e of a
    [SEARCH_CAP // (4 * SBLOCK), 4 * SBLOCK] buffer, and the columns are then padded with -inf
    (which adds nothing anywhere) to the longest one's length L; the buffer is its first
    L * 4 * SBLOCK entries, or -1 (not usable) if a column overflowed. Tiles of SBLOCK (one
    entry per lane) keep the loads, the scattered stores and the counters in one layout."""
    SLOTS: tl.constexpr = SEARCH_CAP // (4 * SBLOCK)
    lane = tl.arange(0, SBLOCK)
    zlo = tl.full([SBLOCK], POS_INF, tl.float32)
    zhi = tl.full([SBLOCK], NEG_INF, tl.float32)
    n0 = tl.zeros([SBLOCK], tl.int32)  # entries in [lo_v, hi_v) per element (column lengths)
    n1 = n0
    n2 = n0
    n3 = n0
    f_above = tl.zeros([SBLOCK], tl.float32)
    for base in range(0, n, 4 * SBLOCK):
        at = base + lane
        z0 = _search_load(src_ptr, at, n, scale)
        z1 = _search_load(src_ptr, at + SBLOCK, n, scale)
        z2 = _search_load(src_ptr, at + 2 * SBLOCK, n, scale)
        z3 = _search_load(src_ptr, at + 3 * SBLOCK, n, scale)
        zlo, zhi, n0, f_above = _snap_tile(z0, 0, lane, lo_v, hi_v, m, zlo, zhi, n0, f_above,
                                           buf_ptr, WRITE, ABOVE, SLOTS)
        zlo, zhi, n1, f_above = _snap_tile(z1, 1, lane, lo_v, hi_v, m, zlo, zhi, n1, f_above,
                                           buf_ptr, WRITE, ABOVE, SLOTS)
        zlo, zhi, n2, f_above = _snap_tile(z2, 2, lane, lo_v, hi_v, m, zlo, zhi, n2, f_above,
                                           buf_ptr, WRITE, ABOVE, SLOTS)
        zlo, zhi, n3, f_above = _snap_tile(z3, 3, lane, lo_v, hi_v, m, zlo, zhi, n3, f_above,
                                           buf_ptr, WRITE, ABOVE, SLOTS)
    n_buf = n * 0 - 1
    if WRITE:
        longest = tl.max(tl.maximum(tl.maximum(n0, n1), tl.maximum(n2, n3)), 0)
        if longest <= SLOTS:
            _pad_column(buf_ptr, n0, 0, lane, longest)
            _pad_column(buf_ptr, n1, 1, lane, longest)
            _pad_column(buf_ptr, n2, 2, lane, longest)
            _pad_column(buf_ptr, n3, 3, lane, longest)
            n_buf = longest * 4 * SBLOCK
    return tl.min(zlo, 0), tl.max(zhi, 0), n_buf, tl.sum(f_above, 0)


@triton.jit
def _mass_pass(src_ptr, n, scale, m, lo, SBLOCK: tl.constexpr):
    """sum of exp(z - m) over the entries z >= lo of ``src_ptr[:n]`` (float32)."""
    s = tl.zeros([SBLOCK], tl.float32)
    for base in range(0, n, SBLOCK):
        z = _search_load(src_ptr, base + tl.arange(0, SBLOCK), n, scale)
        s += tl.where(z >= lo, tl.exp(z - m), 0.0)
    return tl.sum(s, 0)


@triton.jit
def _pick(vec, i, idx):
    """vec[idx] as a scalar (``i``: arange of vec's length; 0 where idx is outside it)."""
    return tl.sum(tl.where(i == idx, vec, 0), 0)


@triton.jit
def _search_pivots(lo, hi, it, P: tl.constexpr):
    """The P sorted pivots in (lo, hi] of search pass ``it`` (``threshold_search``)."""
    piv_i = tl.arange(0, P)
    k_lo = _ordered_key(lo).to(tl.int64)
    k_hi = _ordered_key(hi).to(tl.int64)
    if it == 0:
        d = tl.exp2((P - 1 - piv_i).to(tl.float32) * (5.0 / (P - 1))) - 1.0
        k_piv = tl.minimum(tl.maximum(_ordered_key(hi - d).to(tl.int64), k_lo + 1), k_hi)
        k_piv = tl.where(piv_i == P - 1, k_hi, k_piv)
    else:
        k_piv = k_lo + ((k_hi - k_lo) * (piv_i + 1) + P - 1) // P
    return _key_to_float(k_piv.to(tl.int32))


# Split search (small batches): per (row, part) partials of the first search pass, int64:
# #{z >= pivot} [P], W(pivot) [P] (top-p), W(lo0), #{z >= lo0}; and float32 of its snap:
# the smallest and largest z of the part in the bracket, the mass above it (top-k).
SEARCH_P = 16  # pivots per search pass (the launchers' P)
SPLIT_INTS = 2 * SEARCH_P + 2
SPLIT_FLOATS = 3
# Parts merged per step: one round of loads for up to 32 parts (a loop over the parts one by
# one waits for each part's loads in turn: 38 dependent L2 round trips per merge at B = 1).
PART_BLOCK: tl.constexpr = tl.constexpr(32)


@triton.jit
def merged_max_min(part_f_ptr, C):
    """The row's max and min z from pass 1's C parts (``_part_kernel``), as ``merge_parts``
    gives them (a max and a min are exact in any order), PART_BLOCK parts per step."""
    ci = tl.arange(0, PART_BLOCK)
    # the first step starts the reductions (merge_parts starts m at -FLT_MAX, which every
    # part's max already is at least: first_pass_part starts there)
    m = tl.max(tl.load(part_f_ptr + ci * 5, mask=ci < C, other=-3.4028234663852886e38), 0)
    zmin = tl.min(tl.load(part_f_ptr + ci * 5 + 2, mask=ci < C, other=POS_INF), 0)
    for c0 in range(PART_BLOCK, C, PART_BLOCK):
        at = part_f_ptr + (c0 + ci) * 5
        has = c0 + ci < C
        m = tl.maximum(m, tl.max(tl.load(at, mask=has, other=-3.4028234663852886e38), 0))
        zmin = tl.minimum(zmin, tl.min(tl.load(at + 2, mask=has, other=POS_INF), 0))
    return m, zmin


@triton.jit
def _part_pivot_tile(z, valid, piv, m, lo0, cnt, imass, itot, ctot, BY_MASS: tl.constexpr):
    """``_pivot_tile`` plus the counts the compaction's offsets need whatever the search
    (#{z >= pivot} also for top-p, and #{z >= lo0} of the part's own tokens)."""
    if BY_MASS:
        cnt += (z[None, :] >= piv[:, None]).to(tl.int32)
    cnt, imass, itot = _pivot_tile(z, piv, m, lo0, cnt, imass, itot, BY_MASS)
    ctot += (valid & (z >= lo0)).to(tl.int32)
    return cnt, imass, itot, ctot


@triton.jit
def split_pivot_part(row_ptr, start, end, inv_t, m, lo, hi, out_ptr, BY_MASS: tl.constexpr,
                     P: tl.constexpr, SBLOCK: tl.constexpr):
    """The first pass of ``threshold_search`` (pivots from (lo, hi]) over the row's tokens
    [start, end): writes the part's SPLIT_INTS partials to ``out_ptr``. Every sum is an
    integer one, so the merge (``_merged_first_pass``) is exact in any order."""
    piv = _search_pivots(lo, hi, 0, P)
    cnt = tl.zeros([P, SBLOCK], tl.int32)
    imass = tl.zeros([P, SBLOCK], tl.int64)
    itot = tl.zeros([SBLOCK], tl.int64)
    ctot = tl.zeros([SBLOCK], tl.int32)
    src_ptr = row_ptr + start
    n = end - start
    for base in range(0, n, 4 * SBLOCK):  # four loads in flight, as ``_pivot_pass``
        at = base + tl.arange(0, SBLOCK)
        z0 = _search_load(src_ptr, at, n, inv_t)
        z1 = _search_load(src_ptr, at + SBLOCK, n, inv_t)
        z2 = _search_load(src_ptr, at + 2 * SBLOCK, n, inv_t)
        z3 = _search_load(src_ptr, at + 3 * SBLOCK, n, inv_t)
        cnt, imass, itot, ctot = _part_pivot_tile(z0, at < n, piv, m, lo, cnt, imass, itot,
                                                  ctot, BY_MASS)
        cnt, imass, itot, ctot = _part_pivot_tile(z1, at + SBLOCK < n, piv, m, lo, cnt, imass,
                                                  itot, ctot, BY_MASS)
        cnt, imass, itot, ctot = _part_pivot_tile(z2, at + 2 * SBLOCK < n, piv, m, lo, cnt,
                                                  imass, itot, ctot, BY_MASS)
        cnt, imass, itot, ctot = _part_pivot_tile(z3, at + 3 * SBLOCK < n, piv, m, lo, cnt,
                                                  imass, itot, ctot, BY_MASS)
    piv_i = tl.arange(0, P)
    tl.store(out_ptr + piv_i, tl.sum(cnt, 1).to(tl.int64))
    tl.store(out_ptr + P + piv_i, tl.sum(imass, 1))
    tl.store(out_ptr + 2 * P, tl.sum(itot, 0))
    tl.store(out_ptr + 2 * P + 1, tl.sum(ctot, 0).to(tl.int64))


@triton.jit
def _bracket_offset(part_ptr, c, n_ok, P: tl.constexpr):
    """Entries in the bracket [pivot n_ok - 1 (or lo0), pivot n_ok) of the parts before part
    ``c`` (n_ok < P): where part c's entries start in the row's buffer."""
    ci = tl.arange(0, PART_BLOCK)
    off = (c * 0).to(tl.int64)
    for c0 in range(0, c, PART_BLOCK):
        at = part_ptr + (c0 + ci) * (2 * P + 2)
        before = c0 + ci < c
        above_lo = tl.load(at + tl.where(n_ok > 0, n_ok - 1, 2 * P + 1), mask=before, other=0)
        above_hi = tl.load(at + tl.minimum(n_ok, P - 1), mask=before, other=0)
        off += tl.sum(above_lo - above_hi, 0)
    return off.to(tl.int32)


@triton.jit
def _merged_first_pass(part_ptr, C, lo, hi, top_p, need_count, BY_MASS: tl.constexpr,
                       P: tl.constexpr):
    """The first search pass of a row from its C parts' partials (integer sums: the same as
    one pass over the row in any order): (pivots passing, top-p's float64 need, W of the new
    lo, the bracket [lo_v, hi_v), entries in it, count and W of the entries above it)."""
    piv_i = tl.arange(0, P)
    ci = tl.arange(0, PART_BLOCK)
    cnt = tl.zeros([P], tl.int64)
    imass = tl.zeros([P], tl.int64)
    itot = tl.load(part_ptr + 2 * P) * 0
    ctot = itot
    for c0 in range(0, C, PART_BLOCK):
        at = part_ptr + (c0 + ci) * (2 * P + 2)  # [PART_BLOCK] parts' partials
        has = c0 + ci < C
        cnt += tl.sum(tl.load(at[:, None] + piv_i[None, :], mask=has[:, None], other=0), 0)
        imass += tl.sum(tl.load(at[:, None] + P + piv_i[None, :], mask=has[:, None], other=0),
                        0)
        itot += tl.sum(tl.load(at + 2 * P, mask=has, other=0), 0)
        ctot += tl.sum(tl.load(at + 2 * P + 1, mask=has, other=0), 0)
    piv = _search_pivots(lo, hi, 0, P)
    if BY_MASS:
        need = top_p.to(tl.float64) * itot.to(tl.float64)
        ok = imass.to(tl.float64) >= need
    else:
        need = itot.to(tl.float64) * 0.0  # unused by top-k
        ok = cnt >= need_count
    n_ok = tl.sum(ok.to(tl.int32), 0)
    lo_imass = tl.where(n_ok > 0, _pick(imass, piv_i, n_ok - 1), itot)
    lo_v = tl.where(n_ok > 0, _pick(piv, piv_i, n_ok - 1), lo)
    hi_v = _pick(piv, piv_i, n_ok)
    n_in = tl.where(n_ok > 0, _pick(cnt, piv_i, n_ok - 1), ctot) - _pick(cnt, piv_i, n_ok)
    return (n_ok, need, lo_imass, lo_v, hi_v, n_in.to(tl.int32),
            _pick(cnt, piv_i, n_ok).to(tl.int32), _pick(imass, piv_i, n_ok))


@triton.jit
def _part_snap_tile(z, valid, lo_v, hi_v, m, zlo, zhi, f_above, buf_ptr, pos, write,
                    ABOVE: tl.constexpr):
    """One tile of ``split_snap_part``: the bracket's entries are appended at ``pos`` in
    token order (a scan gives each its place: no atomics, the same layout every run)."""
    inside = valid & (z >= lo_v) & (z < hi_v)
    zlo = tl.minimum(zlo, tl.where(inside, z, POS_INF))
    zhi = tl.maximum(zhi, tl.where(inside, z, NEG_INF))
    if ABOVE:
        f_above += tl.where(z >= hi_v, tl.exp(z - m), 0.0)
    ins = inside.to(tl.int32)
    rank = tl.cumsum(ins, 0)  # inclusive: this entry's place among the tile's
    tl.store(buf_ptr + pos + rank - 1, z, mask=(ins * write) != 0)
    return zlo, zhi, f_above, pos + tl.sum(ins, 0)


@triton.jit
def split_snap_part(row_ptr, start, end, c, inv_t, m, lo, hi, top_p, need_count, part_ptr,
                    C, buf_ptr, out_ptr, BY_MASS: tl.constexpr, P: tl.constexpr,
                    SBLOCK: tl.constexpr):
    """The snap after the first pass, over part ``c`` = the row's tokens [start, end): with
    the merged pass (every part merges the same partials the same way) it writes the part's
    smallest / largest z in the bracket and (top-k) the mass above it to ``out_ptr``, and
    copies its bracket entries into the row's buffer at the part's exact offset (the counts
    of the parts before it), contiguous in token order, when all of the row's fit
    (SEARCH_CAP); else the search goes on over the row (``threshold_search``)."""
    n_ok, _, _, lo_v, hi_v, n_in, _, _ = _merged_first_pass(part_ptr, C, lo, hi, top_p,
                                                            need_count, BY_MASS, P)
    if n_ok < P:
        off = _bracket_offset(part_ptr, c, n_ok, P)
        write = (n_in <= SEARCH_CAP).to(tl.int32)  # 0: the bracket overflows the buffer
        lane = tl.arange(0, SBLOCK)
        zlo = tl.full([SBLOCK], POS_INF, tl.float32)
        zhi = tl.full([SBLOCK], NEG_INF, tl.float32)
        f_above = tl.zeros([SBLOCK], tl.float32)
        pos = off
        src_ptr = row_ptr + start
        n = end - start
        for base in range(0, n, 4 * SBLOCK):
            at = base + lane
            z0 = _search_load(src_ptr, at, n, inv_t)
            z1 = _search_load(src_ptr, at + SBLOCK, n, inv_t)
            z2 = _search_load(src_ptr, at + 2 * SBLOCK, n, inv_t)
            z3 = _search_load(src_ptr, at + 3 * SBLOCK, n, inv_t)
            zlo, zhi, f_above, pos = _part_snap_tile(z0, at < n, lo_v, hi_v, m, zlo, zhi,
                                                     f_above, buf_ptr, pos, write, not BY_MASS)
            zlo, zhi, f_above, pos = _part_snap_tile(z1, at + SBLOCK < n, lo_v, hi_v, m, zlo,
                                                     zhi, f_above, buf_ptr, pos, write,
                                                     not BY_MASS)
            zlo, zhi, f_above, pos = _part_snap_tile(z2, at + 2 * SBLOCK < n, lo_v, hi_v, m,
                                                     zlo, zhi, f_above, buf_ptr, pos, write,
                                                     not BY_MASS)
            zlo, zhi, f_above, pos = _part_snap_tile(z3, at + 3 * SBLOCK < n, lo_v, hi_v, m,
                                                     zlo, zhi, f_above, buf_ptr, pos, write,
                                                     not BY_MASS)
        tl.store(out_ptr, tl.min(zlo, 0))
        tl.store(out_ptr + 1, tl.max(zhi, 0))
        tl.store(out_ptr + 2, tl.sum(f_above, 0))


@triton.jit
def _merged_snap(part_f_ptr, C):
    """(smallest, largest z in the bracket, float32 mass above it) from the C parts' snaps,
    PART_BLOCK parts per step (the mass's order is fixed: the same every run, rounded unlike
    one pass's lanes)."""
    ci = tl.arange(0, PART_BLOCK)
    # the first step starts the reductions (a part's zlo is +inf when it has no entry in the
    # bracket: no arithmetic on loaded values before the min)
    at = part_f_ptr + ci * 3  # 3 = SPLIT_FLOATS
    zlo = tl.min(tl.load(at, mask=ci < C, other=POS_INF), 0)
    zhi = tl.max(tl.load(at + 1, mask=ci < C, other=NEG_INF), 0)
    f_above = tl.sum(tl.load(at + 2, mask=ci < C, other=0.0), 0)
    for c0 in range(PART_BLOCK, C, PART_BLOCK):
        at = part_f_ptr + (c0 + ci) * 3
        has = c0 + ci < C
        zlo = tl.minimum(zlo, tl.min(tl.load(at, mask=has, other=POS_INF), 0))
        zhi = tl.maximum(zhi, tl.max(tl.load(at + 1, mask=has, other=NEG_INF), 0))
        f_above += tl.sum(tl.load(at + 2, mask=has, other=0.0), 0)
    return zlo, zhi, f_above


@triton.jit
def split_first_search(top_k, top_p, V, log_min_p, HAS_MIN_P: tl.constexpr):
    """Which search of ``keep_cut`` the parts run first: (1 = top-k, 2 = top-p, 0 = none:
    neither is on, or min-p is, whose cut needs its own pass over the row first)."""
    which = tl.where((top_k > 0) & (top_k < V), 1, tl.where(top_p < 1, 2, 0))
    if HAS_MIN_P:
        which = tl.where(log_min_p > NEG_INF, 0, which)
    return which


@triton.jit
def threshold_search(row_ptr, buf_ptr, V, inv_t, m, lo, hi, lo_mass, need_count, top_p,
                     part_ptr, part_f_ptr, C, from_parts, BY_MASS: tl.constexpr,
                     P: tl.constexpr, SBLOCK: tl.constexpr, FROM_PARTS: tl.constexpr):
    """Largest value tau of z with crit(tau); returns (tau, sum_{z >= tau} exp(z - m)).

    crit(v): #{z >= v} >= need_count (top-k), or (top-p) W(v) >= top_p * W(lo) in float64,
    W(v) = sum_{z >= v} floor(exp(z - m) * 2**44) in int64 (``reference.keep_threshold``): an
    integer sum is the same in any order, so this cut equals the sort-based one bit for bit
    (a float32 sum is not: per-lane partials and a sorted cumsum round differently, which
    flipped the last token of rows with top_p near 1). crit is monotone and changes only at
    values of z (it depends on v only through the set {z >= v}).

    Invariant: lo and hi are values of z with lo <= tau <= hi and crit(lo). Each iteration
    tests P sorted pivots in (lo, hi] (the last is hi) in one pass; with n_ok of them passing,
    tau lies in [pivot n_ok-1 (or lo), pivot n_ok), and a cheap pass without pivots snaps the
    bracket to the smallest and largest z in that interval. The first iteration's pivots sit
    at hi - d for d from 31 down to 0 (logits are log-probabilities: cuts sit within a few
    tens of the max); later ones spread evenly over the int32 keys of (lo, hi], shrinking the
    key range P-fold per pass (at most ceil(32 / log2 P) + 1 passes).

    After the first pass over the row, its snap pass also writes the entries of the new
    bracket to ``buf_ptr`` (SEARCH_CAP of them at most): every later pass reads only those,
    the entries above the bracket adding their known count / mass (the pivot-pass values at
    its upper end), the ones below it adding nothing (below every later pivot). If more than
    SEARCH_CAP entries are in the bracket, the search stays on the row and tries again after
    the next pass. Only the pass count and length depend on data; no sort of the vocabulary.

    ``FROM_PARTS`` (small batches) with ``from_parts``: that first row pass, its snap and the
    compaction ran in C programs per row (``split_pivot_part``, ``split_snap_part``); their
    partials (``part_ptr``: per-pivot integer sums, ``part_f_ptr``: bracket ends and mass
    above) give the same state after it, and the search goes on from there.
    """
    piv_i = tl.arange(0, P)
    lo0 = lo
    n_buf = V * 0 - 1  # entries in buf_ptr, -1: not compacted yet
    a_cnt = V * 0  # entries above the buffer's bracket: their count and integer / float mass
    a_imass = a_cnt.to(tl.int64)
    a_f = inv_t * 0.0
    need = (inv_t * 0.0).to(tl.float64)  # top-p: top_p * W(lo0) in float64
    lo_imass = a_imass  # W(lo) once the first pass has counted it
    it = 0
    if FROM_PARTS:
        # The first pass (and its snap and compaction) ran in C programs per row
        # (``split_pivot_part``, ``split_snap_part``): pick up the search after it.
        if from_parts & (lo < hi):
            n_ok, need, lo_imass, _, _, n_in, p_cnt, p_imass = _merged_first_pass(
                part_ptr, C, lo, hi, top_p, need_count, BY_MASS, P)
            if n_ok == P:
                lo = hi
            else:
                lo, hi, f_above = _merged_snap(part_f_ptr, C)
                if n_in <= SEARCH_CAP:
                    n_buf = n_in
                    a_cnt = p_cnt
                    a_imass = p_imass
                    a_f = f_above
            it = 1
    while (lo < hi) & (it < 40):
        piv = _search_pivots(lo, hi, it, P)
        if n_buf < 0:
            cnt, imass, itot = _pivot_pass(row_ptr, V, inv_t, m, piv, lo0, BY_MASS, P, SBLOCK)
            if BY_MASS:
                if it == 0:
                    need = top_p.to(tl.float64) * itot.to(tl.float64)
                    lo_imass = itot
        else:
            cnt, imass, _ = _pivot_pass(buf_ptr, n_buf, 1.0, m, piv, lo0, BY_MASS, P, SBLOCK)
            cnt += a_cnt
            imass += a_imass
        if BY_MASS:
            # The reference's float64 operations on the same integers: identical results.
            ok = imass.to(tl.float64) >= need
        else:
            ok = cnt >= need_count
        n_ok = tl.sum(ok.to(tl.int32), 0)  # crit is monotone: pivots 0..n_ok-1 pass
        lo_imass = tl.where(n_ok > 0, _pick(imass, piv_i, n_ok - 1), lo_imass)
        if n_ok == P:
            lo = hi
        else:
            lo_v = tl.where(n_ok > 0, _pick(piv, piv_i, n_ok - 1), lo)
            hi_v = _pick(piv, piv_i, n_ok)
            if n_buf < 0:
                lo, hi, n_buf, f_above = _snap_pass(row_ptr, V, inv_t, m, lo_v, hi_v, buf_ptr,
                                                    True, not BY_MASS, SBLOCK)
                tl.debug_barrier()  # the buffer's writes, visible to every lane's next reads
                if n_buf >= 0:
                    a_cnt = _pick(cnt, piv_i, n_ok)
                    a_imass = _pick(imass, piv_i, n_ok)
                    a_f = f_above
            else:
                lo, hi, _, _ = _snap_pass(buf_ptr, n_buf, 1.0, m, lo_v, hi_v, buf_ptr, False,
                                          False, SBLOCK)
        it += 1
    if BY_MASS:
        # W(tau) * 2**-44: the kept float mass to within V * 2**-44 of the top weight
        lo_mass = tl.where(it > 0, lo_imass.to(tl.float32) * INV_MASS_SCALE, lo_mass)
    else:
        if it > 0:
            if n_buf < 0:
                lo_mass = _mass_pass(row_ptr, V, inv_t, m, lo, SBLOCK)
            else:
                lo_mass = a_f + _mass_pass(buf_ptr, n_buf, 1.0, m, lo, SBLOCK)
    return lo, lo_mass


@triton.jit
def keep_cut(row_ptr, buf_ptr, V, inv_t, m, s, zmin, top_k_ptr, top_p_ptr, min_p_ptr, b,
             part_ptr, part_f_ptr, C, HAS_MIN_P: tl.constexpr, P: tl.constexpr,
             SBLOCK: tl.constexpr, GBLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """(tau, sum of exp(z - m) over z >= tau) of row ``b``: the processed law keeps exactly
    {z >= tau} (``reference.keep_threshold``: min-p, then top-k, then top-p; tau = -inf keeps
    all). ``m``, ``s``, ``zmin``: the row's max, sum of exp(z - m) and min (``first_pass``).
    ``buf_ptr``: SEARCH_CAP float32 of scratch for the search's candidates. ``SPLIT``: the
    first search's first pass ran in the row's C parts (``split_first_search`` says which;
    ``part_ptr`` / ``part_f_ptr``: the row's partials), the rest runs here."""
    tau = NEG_INF + inv_t * 0.0
    s_tau = s
    top_k = tl.load(top_k_ptr + b).to(tl.int32)
    top_p = tl.load(top_p_ptr + b)
    n_kept = V  # tokens min-p keeps
    log_min_p = top_p * 0.0
    if HAS_MIN_P:
        log_min_p = tl.load(min_p_ptr + b)
        if log_min_p > NEG_INF:
            tau, s_tau, n_kept = min_p_pass(row_ptr, V, inv_t, m, m + log_min_p, GBLOCK)
    which = 0
    if SPLIT:
        which = split_first_search(top_k, top_p, V, log_min_p, HAS_MIN_P)
    # top-k after min-p: if min-p keeps more than k tokens, the k-th largest z overall
    # is among them (so >= the min-p cut) and is the threshold; else min-p's cut is.
    if (top_k > 0) & (top_k < V) & (n_kept > top_k):
        tau, s_tau = threshold_search(row_ptr, buf_ptr, V, inv_t, m, zmin, m, s, top_k, 0.0,
                                      part_ptr, part_f_ptr, C, which == 1, False, P, SBLOCK,
                                      SPLIT)
    if top_p < 1:
        lo = tl.where(tau == NEG_INF, zmin, tau)
        tau, s_tau = threshold_search(row_ptr, buf_ptr, V, inv_t, m, lo, m, s_tau, 0, top_p,
                                      part_ptr, part_f_ptr, C, which == 2, True, P, SBLOCK,
                                      SPLIT)
    return tau, s_tau


@triton.jit
def q_columns(at, valid, map_ptr, HAS_MAP: tl.constexpr):
    """The q column of each token ``at``: itself, or with ``HAS_MAP`` (q over the drafter's
    vocabulary) ``map[t]``, -1 off that vocabulary or where not ``valid``."""
    col = at
    if HAS_MAP:
        col = tl.load(map_ptr + at, mask=valid, other=-1).to(tl.int64)
    return col


@triton.jit
def q_in_columns(q_row_ptr, col, valid, HAS_MAP: tl.constexpr):
    """q at the columns ``col`` of ``q_columns``: 0 where not ``valid`` (or off the draft
    vocabulary), so a residual still covers every target token."""
    if HAS_MAP:
        q = tl.load(q_row_ptr + col, mask=col >= 0, other=0.0).to(tl.float32)
    else:
        q = tl.load(q_row_ptr + col, mask=valid, other=0.0).to(tl.float32)
    return q


@triton.jit
def q_at(q_row_ptr, at, valid, map_ptr, HAS_MAP: tl.constexpr):
    """A draft distribution's q at tokens ``at`` (0 where not ``valid``; ``q_columns``)."""
    return q_in_columns(q_row_ptr, q_columns(at, valid, map_ptr, HAS_MAP), valid, HAS_MAP)


@triton.jit
def sibling_residual(p, at, valid, q_tree_ptr, s_qn, map_ptr, sib_f_ptr, sib_i_ptr,
                     draft_row_ptr, parents_ptr, j, upto, V, HAS_MAP: tl.constexpr):
    """(r, taken) at tokens ``at`` after row j's sampled children c < ``upto`` were judged
    (``reference._sampled_children``): r = p, then for each child whose rejection changed the
    residual (flag 2) r = max(r - z_c · Q_c, 0), Q_c = q_c off ``taken`` / D_c, in its float32
    operations; ``taken``: the tokens of the children judged valid so far (flag 1). The row
    kernel stored each child's flags, z_c and D_c (``sib_*_ptr``, the sequence's [N] part);
    ``q_tree_ptr``: the sequence's q rows, child c's at ``(c - 1) * s_qn``. Recomputed per
    token rather than stored per row: a [rows, V] scratch would be O(B·N·V). With ``HAS_MAP``
    the tokens' draft-vocabulary columns are read once, not once per rejected child."""
    r = p
    taken = at < 0
    col = q_columns(at, valid, map_ptr, HAS_MAP)  # read once for every rejected child
    for c in range(1, upto):
        if tl.load(parents_ptr + c) == j:
            flags = tl.load(sib_i_ptr + c)
            if (flags & 2) != 0:
                q = q_in_columns(q_tree_ptr + (c - 1) * s_qn, col, valid, HAS_MAP)
                big_q = tl.where(taken, 0.0, q) / tl.load(sib_f_ptr + 2 * c + 1)
                r = tl.maximum(r - tl.load(sib_f_ptr + 2 * c) * big_q, 0.0)
            if (flags & 1) != 0:
                x = tl.minimum(tl.maximum(tl.load(draft_row_ptr + c - 1), 0), V - 1)
                taken = taken | (at == x)
    return r, taken


@triton.jit
def _residual_mass(z, at, kept, m, s, q_row_ptr, s_qn, map_ptr, sib_f_ptr, sib_i_ptr,
                   draft_row_ptr, parents_ptr, j, N, use_q, V, HAS_MAP: tl.constexpr,
                   SIBLINGS: tl.constexpr):
    """(r, its fixed-point mass floor(r * 2**44)) with p = exp(z - m) / s on the kept set:
    r = max(p - q, 0) (``reference.rejection_sample``'s residual), or with ``SIBLINGS`` (a
    sampled tree: ``q_row_ptr`` the sequence's q rows) the residual after every child of row
    j (``sibling_residual``). q is read only when ``use_q`` (0 / 1: lanes < V * use_q are
    the valid lanes exactly when q is needed)."""
    p = tl.where(kept, tl.exp(z - m) / s, 0.0)
    if SIBLINGS:
        r, _ = sibling_residual(p, at, at < V * use_q, q_row_ptr, s_qn, map_ptr, sib_f_ptr,
                                sib_i_ptr, draft_row_ptr, parents_ptr, j, N, V, HAS_MAP)
    else:
        r = tl.maximum(p - q_at(q_row_ptr, at, at < V * use_q, map_ptr, HAS_MAP), 0.0)
    return r, tl.floor(r * MASS_SCALE).to(tl.int64)


@triton.jit
def residual_total(row_ptr, q_tree_ptr, s_qn, map_ptr, sib_f_ptr, sib_i_ptr, draft_row_ptr,
                   parents_ptr, j, upto, V, inv_t, tau, m, s, HAS_MAP: tl.constexpr):
    """sum over the row of floor(r * 2**44), r the residual after row j's children c < upto
    (``sibling_residual``): the total a rejection gives, exact in any order (int64), as the
    reference's fixed-point sum."""
    G: tl.constexpr = RNG_GROUP
    total = tl.sum(tl.zeros([G], tl.int64), 0)
    for base in range(0, V, G):
        at = base + tl.arange(0, G)
        valid = at < V
        z = tl.load(row_ptr + at, mask=valid, other=NEG_INF).to(tl.float32) * inv_t
        p = tl.where(valid & (z >= tau), tl.exp(z - m) / s, 0.0)
        r, _ = sibling_residual(p, at, valid, q_tree_ptr, s_qn, map_ptr, sib_f_ptr, sib_i_ptr,
                                draft_row_ptr, parents_ptr, j, upto, V, HAS_MAP)
        total += tl.sum(tl.floor(r * MASS_SCALE).to(tl.int64), 0)
    return total


@triton.jit
def _kept_tile(z, at, a, tau, m, s, q_row_ptr, s_qn, map_ptr, sib_f_ptr, sib_i_ptr,
               draft_row_ptr, parents_ptr, x_ex, j, n, N, V, use_q, HAS_MAP: tl.constexpr,
               IS_TREE: tl.constexpr, SIBLINGS: tl.constexpr):
    """One run of a tile in ``tile_pass``: (its kept mass, its residual's mass) summed."""
    kept = (at < V) & (z >= tau)
    w = tile_mass(z, a, kept)
    _, r = _residual_mass(z, at, kept, m, s, q_row_ptr, s_qn, map_ptr, sib_f_ptr, sib_i_ptr,
                          draft_row_ptr, parents_ptr, j, N, use_q, V, HAS_MAP, SIBLINGS)
    drop = _children(at, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, IS_TREE)
    rest = tl.where(use_q != 0, r, tl.where(drop, 0, w))
    return tl.sum(w, 0), tl.sum(rest, 0)


@triton.jit
def tile_pass(row_ptr, q_row_ptr, s_qn, map_ptr, sib_f_ptr, sib_i_ptr, draft_row_ptr,
              parents_ptr, k0, k1, pos, j, n, N, V, inv_t, tau, m, s, use_q, tile_f_ptr,
              tile_i_ptr, HAS_MAP: tl.constexpr, IS_TREE: tl.constexpr,
              SIBLINGS: tl.constexpr, TB: tl.constexpr):
    """The tile races over the kept set {z >= tau} (``reference.draw_tile``), when pass 1's
    (over every token) do not hold: (t1: p's, t2: the residual's — p without row j's
    children's tokens, or, ``use_q``, max(p - q, 0), or with ``SIBLINGS`` the residual
    after row j's sampled children (``_residual_mass``) — -1 where no tile has mass). Same E_t
    and the same anchors a_t (each tile's largest z over all its tokens) as pass 1; the
    tiles' statistics overwrite pass 1's in the row's scratch."""
    G: tl.constexpr = RNG_GROUP
    x_ex = _chain_child_token(draft_row_ptr, j, n, IS_TREE)
    tl.debug_barrier()  # every thread has read pass 1's statistics before they are replaced
    for base in range(0, V, 4 * G):
        at0, at1, at2, at3, z0, z1, z2, z3, a = _load_tile(row_ptr, base, V, inv_t)
        w0, r0 = _kept_tile(z0, at0, a, tau, m, s, q_row_ptr, s_qn, map_ptr, sib_f_ptr,
                            sib_i_ptr, draft_row_ptr, parents_ptr, x_ex, j, n, N, V, use_q,
                            HAS_MAP, IS_TREE, SIBLINGS)
        w1, r1 = _kept_tile(z1, at1, a, tau, m, s, q_row_ptr, s_qn, map_ptr, sib_f_ptr,
                            sib_i_ptr, draft_row_ptr, parents_ptr, x_ex, j, n, N, V, use_q,
                            HAS_MAP, IS_TREE, SIBLINGS)
        w2, r2 = _kept_tile(z2, at2, a, tau, m, s, q_row_ptr, s_qn, map_ptr, sib_f_ptr,
                            sib_i_ptr, draft_row_ptr, parents_ptr, x_ex, j, n, N, V, use_q,
                            HAS_MAP, IS_TREE, SIBLINGS)
        w3, r3 = _kept_tile(z3, at3, a, tau, m, s, q_row_ptr, s_qn, map_ptr, sib_f_ptr,
                            sib_i_ptr, draft_row_ptr, parents_ptr, x_ex, j, n, N, V, use_q,
                            HAS_MAP, IS_TREE, SIBLINGS)
        t = base // (4 * G)
        tl.store(tile_f_ptr + t, a)
        tl.store(tile_i_ptr + 2 * t, w0 + w1 + w2 + w3)
        tl.store(tile_i_ptr + 2 * t + 1, r0 + r1 + r2 + r3)
    tl.debug_barrier()
    _, _, t1, t2 = tile_races(tile_f_ptr, tile_i_ptr, V, k0, k1, pos, j,
                              (use_q == 0).to(tl.int32), TB)
    return t1, t2


@triton.jit
def race_in_tile(row_ptr, q_row_ptr, s_qn, map_ptr, sib_f_ptr, sib_i_ptr, draft_row_ptr,
                 parents_ptr, k0, k1, pos, j, n, N, V, inv_t, tau, m, s, use_q, t,
                 HAS_MAP: tl.constexpr, IS_TREE: tl.constexpr, SIBLINGS: tl.constexpr):
    """The token races inside tile ``t`` (``reference.in_tile``), over the kept set: (p's
    winner, the residual's winner — p without row j's children's tokens, or norm(max(p - q,
    0)) with ``use_q`` (``SIBLINGS``: the sampled children's residual, ``_residual_mass``) —
    or -1 where it has no candidate). Exponential races: argmax of
    z - log E (p) or r / E (the residual), E from the token race's counters."""
    G: tl.constexpr = RNG_GROUP
    lane = tl.arange(0, G)
    c0, c1, c2 = _race_counter(pos, j)
    g1 = tl.full([G], NEG_INF, tl.float32)
    g2 = g1
    i1 = tl.full([G], -1, tl.int32)
    i2 = i1
    x_ex = _chain_child_token(draft_row_ptr, j, n, IS_TREE)
    base = tl.maximum(t, 0) * (4 * G)  # (t = -1 only for a row of -inf: out of contract)
    r0, r1, r2, r3 = philox(k0, k1, c0, c1, c2, (base // 4 + lane).to(tl.uint32))
    for w in tl.static_range(4):
        at = base + w * G + lane
        valid = at < V
        z = tl.load(row_ptr + at, mask=valid, other=NEG_INF).to(tl.float32) * inv_t
        kept = valid & (z >= tau)
        e = exponential_from_bits(_word(r0, r1, r2, r3, w))
        g = tl.where(kept, z - tl.log(e), NEG_INF)
        i1 = tl.where(g > g1, at, i1)
        g1 = tl.maximum(g1, g)
        g = _drop_children(g, at, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, IS_TREE)
        r, _ = _residual_mass(z, at, kept, m, s, q_row_ptr, s_qn, map_ptr, sib_f_ptr,
                              sib_i_ptr, draft_row_ptr, parents_ptr, j, N, use_q, V, HAS_MAP,
                              SIBLINGS)
        key = tl.where(use_q != 0, tl.where(r > 0, r / e, -1.0), g)
        i2 = tl.where(key > g2, at, i2)
        g2 = tl.maximum(g2, key)
    _, i1 = _lowest_argmax(g1, i1)
    top2, i2 = _lowest_argmax(g2, i2)
    found = tl.where(use_q != 0, top2 > 0, i2 >= 0)
    return i1, tl.where(found, i2, -1)
