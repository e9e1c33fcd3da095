"""Triton building blocks of the rejection sampler: Philox, vocabulary passes, threshold search.

Every pass streams one logits row ``[V]`` once (``4 * RNG_GROUP`` tokens per step); the random
numbers follow ``reference.py`` bit for bit (Philox4x32-10, same counters, same conversions).
"""

from __future__ import annotations

import triton
import triton.language as tl

RNG_GROUP: tl.constexpr = tl.constexpr(512)  # = reference.RNG_GROUP
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
def _drop_children(g, at, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, IS_TREE: tl.constexpr):
    """``g`` with the lanes of row j's children's tokens set to -inf (point-mass residual)."""
    if IS_TREE:
        g = tl.where(excluded(at, draft_row_ptr, parents_ptr, j, n, N, V, True), NEG_INF, g)
    else:
        g = tl.where(at == x_ex, NEG_INF, g)
    return g


@triton.jit
def _lowest_argmax(g, i):
    """(max of the per-lane keys ``g``, lowest index ``i`` among lanes holding it, -1 if none)."""
    top = tl.max(g, 0)
    i = tl.min(tl.where((g == top) & (i >= 0), i, 2147483647), 0)
    return top, tl.where(i == 2147483647, -1, i)


@triton.jit
def first_pass(row_ptr, draft_row_ptr, parents_ptr, k0, k1, pos, j, n, N, V, inv_t,
               IS_TREE: tl.constexpr):
    """Pass 1 over a sampled row: max, sum exp(z - max), min, and two unfiltered races — over
    all tokens and over all but row j's children's tokens (its point-mass residual).

    State is kept per lane and reduced once at the end (no cross-lane reduction per step)."""
    G: tl.constexpr = RNG_GROUP
    lane = tl.arange(0, G)
    c0, c1, c2 = _race_counter(pos, j)
    m = tl.full([G], -3.4028234663852886e38, tl.float32)
    s = tl.zeros([G], tl.float32)
    zmin = tl.full([G], POS_INF, tl.float32)
    g1 = tl.full([G], NEG_INF, tl.float32)
    g2 = g1
    i1 = tl.full([G], -1, tl.int32)
    i2 = i1
    x_ex = _chain_child_token(draft_row_ptr, j, n, IS_TREE)
    for base in range(0, V, 4 * G):
        # One Philox call gives 4 words: word w drives tokens base + w*G + lane.
        r0, r1, r2, r3 = philox(k0, k1, c0, c1, c2, (base // 4 + lane).to(tl.uint32))
        for w in tl.static_range(4):
            at = base + w * G + lane
            valid = at < V
            z = tl.load(row_ptr + at, mask=valid, other=NEG_INF).to(tl.float32) * inv_t
            # Online softmax per lane with one exp: e = exp(-|z - m|) rescales whichever side.
            e = tl.exp(-tl.abs(z - m))
            s = tl.where(z > m, s * e + 1.0, s + e)
            m = tl.maximum(m, z)
            zmin = tl.minimum(zmin, tl.where(valid, z, POS_INF))
            # Gumbel form of the race argmax p_i / E_i: no normalisation, so one pass suffices.
            g = z - tl.log(exponential_from_bits(_word(r0, r1, r2, r3, w)))
            i1 = tl.where(g > g1, at, i1)  # strict: the earliest (lowest) index wins ties
            g1 = tl.maximum(g1, g)
            g = _drop_children(g, at, x_ex, draft_row_ptr, parents_ptr, j, n, N, V, IS_TREE)
            i2 = tl.where(g > g2, at, i2)
            g2 = tl.maximum(g2, g)
    m_row = tl.max(m, 0)
    s_row = tl.sum(s * tl.exp(m - m_row), 0)
    _, i1 = _lowest_argmax(g1, i1)
    _, i2 = _lowest_argmax(g2, i2)
    return m_row, s_row, tl.min(zmin, 0), i1, i2


@triton.jit
def greedy_pass(row_ptr, V, BLOCK: tl.constexpr):
    """One pass over a greedy row: argmax (lowest index), max and sum exp(logit - max)."""
    lane = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -3.4028234663852886e38, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    arg = tl.full([BLOCK], -1, tl.int32)
    for base in range(0, V, BLOCK):
        z = tl.load(row_ptr + base + lane, mask=base + lane < V, other=NEG_INF).to(tl.float32)
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
def _search_load(row_ptr, lane, V, inv_t):
    """z of tokens ``lane``; lanes past the row read -inf, which adds nothing anywhere (below
    every pivot, weight 0), so they need no mask downstream."""
    return tl.load(row_ptr + lane, mask=lane < V, other=NEG_INF).to(tl.float32) * inv_t


MASS_SCALE: tl.constexpr = tl.constexpr(17592186044416.0)  # = reference.MASS_SCALE (2**44)


@triton.jit
def _search_tile(z, piv, m, lo0, cnt, mass, imass, itot, nxt, prv, BY_MASS: tl.constexpr):
    """Adds one tile of z [SBLOCK] to the per-lane, per-pivot partials [SBLOCK, P] of a pass:
    count (top-k) or integer mass (top-p: ``reference.keep_threshold``'s fixed-point weights
    floor(exp(z - m) * 2**44), whose sums are exact in any order) of {z >= pivot}, and the
    float32 mass (the kept set's normaliser) and nearest z on either side of each pivot."""
    ge = z[:, None] >= piv[None, :]
    lt = z[:, None] < piv[None, :]
    w = tl.exp(z - m)
    if BY_MASS:
        wi = tl.floor(w * MASS_SCALE).to(tl.int64)  # exact: w * 2**44 is a float32 as is
        imass += tl.where(ge, wi[:, None], 0)
        itot += tl.where(z >= lo0, wi, 0)
    else:
        cnt += ge.to(tl.int32)
    mass += tl.where(ge, w[:, None], 0.0)
    nxt = tl.minimum(nxt, tl.where(ge, z[:, None], POS_INF))
    prv = tl.maximum(prv, tl.where(lt, z[:, None], NEG_INF))
    return cnt, mass, imass, itot, nxt, prv


@triton.jit
def threshold_search(row_ptr, V, inv_t, m, lo, hi, lo_mass, need_count, top_p,
                     BY_MASS: tl.constexpr, P: tl.constexpr, SBLOCK: tl.constexpr):
    """Largest value tau of z with crit(tau); returns (tau, sum_{z >= tau} exp(z - m)).

    crit(v): #{z >= v} >= need_count (top-k), or (top-p) W(v) >= top_p * W(lo) in float64,
    W(v) = sum_{z >= v} floor(exp(z - m) * 2**44) in int64 (``reference.keep_threshold``): an
    integer sum is the same in any order, so this cut equals the sort-based one bit for bit
    (a float32 sum is not: per-lane partials and a sorted cumsum round differently, which
    flipped the last token of rows with top_p near 1).

    Invariant: lo and hi are values of z with lo <= tau <= hi and crit(lo). Each iteration is
    one pass over the row that tests P pivots spread evenly over the int32 keys of (lo, hi]
    (the last is hi) and also records, per pivot, the nearest value of z on either side; the
    new bracket is [first z >= last passing pivot, last z < first failing pivot]. The key range
    shrinks P-fold per pass, so at most ceil(32 / log2 P) passes (8 for P = 16) — about
    log_P(V) once the bracket holds few values (4-6 for V = 152k): no sort of the vocabulary.
    Every pass is static in shape (the row is read whole); only the pass count depends on data.
    """
    piv_i = tl.arange(0, P)
    lo0 = lo  # top-p's total: the mass of {z >= lo} as the search starts
    it = 0
    while (lo < hi) & (it < 40):
        k_lo = _ordered_key(lo).to(tl.int64)
        k_hi = _ordered_key(hi).to(tl.int64)
        piv = _key_to_float((k_lo + ((k_hi - k_lo) * (piv_i + 1) + P - 1) // P).to(tl.int32))
        cnt = tl.zeros([SBLOCK, P], tl.int32)  # per-lane partials, reduced after the pass
        mass = tl.zeros([SBLOCK, P], tl.float32)
        imass = tl.zeros([SBLOCK, P], tl.int64)
        itot = tl.zeros([SBLOCK], tl.int64)
        nxt = tl.full([SBLOCK, P], POS_INF, tl.float32)
        prv = tl.full([SBLOCK, P], NEG_INF, tl.float32)
        # Four tiles per step, all loaded before any is used: four loads in flight instead of
        # one (a pass is ~V / SBLOCK dependent steps; one load each left it latency-bound).
        for base in range(0, V, 4 * SBLOCK):
            lane = base + tl.arange(0, SBLOCK)
            z0 = _search_load(row_ptr, lane, V, inv_t)
            z1 = _search_load(row_ptr, lane + SBLOCK, V, inv_t)
            z2 = _search_load(row_ptr, lane + 2 * SBLOCK, V, inv_t)
            z3 = _search_load(row_ptr, lane + 3 * SBLOCK, V, inv_t)
            cnt, mass, imass, itot, nxt, prv = _search_tile(z0, piv, m, lo0, cnt, mass, imass,
                                                            itot, nxt, prv, BY_MASS)
            cnt, mass, imass, itot, nxt, prv = _search_tile(z1, piv, m, lo0, cnt, mass, imass,
                                                            itot, nxt, prv, BY_MASS)
            cnt, mass, imass, itot, nxt, prv = _search_tile(z2, piv, m, lo0, cnt, mass, imass,
                                                            itot, nxt, prv, BY_MASS)
            cnt, mass, imass, itot, nxt, prv = _search_tile(z3, piv, m, lo0, cnt, mass, imass,
                                                            itot, nxt, prv, BY_MASS)
        mass = tl.sum(mass, 0)
        nxt = tl.min(nxt, 0)
        prv = tl.max(prv, 0)
        if BY_MASS:
            # The reference's float64 operations on the same integers: identical results.
            need = top_p.to(tl.float64) * tl.sum(itot, 0).to(tl.float64)
            ok = tl.sum(imass, 0).to(tl.float64) >= need
        else:
            ok = tl.sum(cnt, 0) >= need_count
        n_ok = tl.sum(ok.to(tl.int32), 0)  # crit is monotone: pivots 0..n_ok-1 pass
        last_ok = piv_i == n_ok - 1
        lo_new = tl.max(tl.where(last_ok, nxt, NEG_INF), 0)
        mass_new = tl.sum(tl.where(last_ok, mass, 0.0), 0)
        hi_new = tl.max(tl.where(piv_i == n_ok, prv, NEG_INF), 0)
        all_ok = n_ok == P
        lo = tl.where(all_ok, hi, tl.where(n_ok > 0, lo_new, lo))
        lo_mass = tl.where(n_ok > 0, mass_new, lo_mass)
        hi = tl.where(all_ok, hi, hi_new)
        it += 1
    return lo, lo_mass


@triton.jit
def keep_cut(row_ptr, V, inv_t, m, s, zmin, top_k_ptr, top_p_ptr, min_p_ptr, b,
             HAS_MIN_P: tl.constexpr, P: tl.constexpr, SBLOCK: tl.constexpr,
             GBLOCK: tl.constexpr):
    """(tau, sum of exp(z - m) over z >= tau) of row ``b``: the processed law keeps exactly
    {z >= tau} (``reference.keep_threshold``: min-p, then top-k, then top-p; tau = -inf keeps
    all). ``m``, ``s``, ``zmin``: the row's max, sum of exp(z - m) and min (``first_pass``)."""
    tau = NEG_INF + inv_t * 0.0
    s_tau = s
    top_k = tl.load(top_k_ptr + b).to(tl.int32)
    top_p = tl.load(top_p_ptr + b)
    n_kept = V  # tokens min-p keeps
    if HAS_MIN_P:
        log_min_p = tl.load(min_p_ptr + b)
        if log_min_p > NEG_INF:
            tau, s_tau, n_kept = min_p_pass(row_ptr, V, inv_t, m, m + log_min_p, GBLOCK)
    # top-k after min-p: if min-p keeps more than k tokens, the k-th largest z overall
    # is among them (so >= the min-p cut) and is the threshold; else min-p's cut is.
    if (top_k > 0) & (top_k < V) & (n_kept > top_k):
        tau, s_tau = threshold_search(row_ptr, V, inv_t, m, zmin, m, s, top_k, 0.0,
                                      False, P, SBLOCK)
    if top_p < 1:
        lo = tl.where(tau == NEG_INF, zmin, tau)
        tau, s_tau = threshold_search(row_ptr, V, inv_t, m, lo, m, s_tau, 0, top_p, True, P,
                                      SBLOCK)
    return tau, s_tau


@triton.jit
def final_pass(row_ptr, q_row_ptr, map_ptr, draft_row_ptr, parents_ptr, k0, k1, pos, j, n, N,
               V, inv_t, tau, m, s, use_q, HAS_MAP: tl.constexpr, IS_TREE: tl.constexpr):
    """Races restricted to the kept set {z >= tau}: p itself, and the residual — p without row
    j's children's tokens (point mass) or norm(max(p - q, 0)) (use_q). Same E as pass 1.
    ``HAS_MAP``: q is over the drafter's vocabulary, token ``t`` at column ``map[t]`` (q = 0
    where that is -1), so the residual still covers every target token."""
    G: tl.constexpr = RNG_GROUP
    lane = tl.arange(0, G)
    c0, c1, c2 = _race_counter(pos, j)
    g1 = tl.full([G], NEG_INF, tl.float32)
    g2 = g1
    i1 = tl.full([G], -1, tl.int32)
    i2 = i1
    x_ex = _chain_child_token(draft_row_ptr, j, n, IS_TREE)
    for base in range(0, V, 4 * G):
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
            # use_q is 0/1: lanes < V * use_q are the valid lanes exactly when q is needed.
            if HAS_MAP:
                col = tl.load(map_ptr + at, mask=at < V * use_q, other=-1).to(tl.int64)
                q = tl.load(q_row_ptr + col, mask=col >= 0, other=0.0).to(tl.float32)
            else:
                q = tl.load(q_row_ptr + at, mask=at < V * use_q, other=0.0).to(tl.float32)
            r = tl.maximum(tl.where(kept, tl.exp(z - m) / s, 0.0) - q, 0.0)  # max(p - q, 0)
            key = tl.where(use_q != 0, tl.where(r > 0, r / e, -1.0), g)
            i2 = tl.where(key > g2, at, i2)
            g2 = tl.maximum(g2, key)
    _, i1 = _lowest_argmax(g1, i1)
    top2, i2 = _lowest_argmax(g2, i2)
    found = tl.where(use_q != 0, top2 > 0, i2 >= 0)
    return i1, tl.where(found, i2, i1)
