"""Pieces every model-based drafter shares: its KV budget, the draft token choice (greedy, or
sampled on the drafter's own seeded stream), the chain loop and the level-by-level tree
expansion. The drafters differ only in how one draft pass runs (``advance`` / ``run_level``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specengine.core.kv_cache import KVCache, kv_bytes_per_token, num_kv_blocks
from specengine.core.sequence import Sequence
from specengine.core.step_types import DraftProposal
from specengine.core.transfer import to_device
from specengine.tree import DraftTree

if TYPE_CHECKING:
    from specengine.drafters.context import DraftContext


def _signed(c: int) -> int:
    c %= 1 << 64
    return c - (1 << 64) if c >= 1 << 63 else c


_K = tuple(_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB,
                                 0xD6E8FEB86659FD93))


def draft_uniforms(seeds: Tensor, positions: Tensor, vocab: int,
                   token_ids: Tensor | None = None) -> Tensor:
    """``[B, V]`` uniforms in (0, 1): a counter-based hash (splitmix64 finaliser, int64
    arithmetic wrapping) of (request seed, draft position, token id). This is the drafter's
    own stream, independent of the target sampler's Philox draws; the same (seed, position)
    always gives the same numbers, and no host sync is needed. ``token_ids [V]``: the target
    ids of the columns (a draft vocabulary), so a token gets the same number either way."""
    ids = token_ids if token_ids is not None else torch.arange(vocab, device=seeds.device,
                                                               dtype=torch.int64)
    x = seeds[:, None] * _K[0] + positions[:, None] * _K[1] + ids[None, :] * _K[3] + _K[2]
    for shift, mul in ((30, _K[1]), (27, _K[2]), (31, 1)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mul
    return (((x >> 40) & 0xFFFFFF).float() + 0.5) / float(1 << 24)


def processed_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The policy's sampling distribution per row, computed as the rejection sampler computes
    its ``p`` (``kernels.reference``: ``z = logits · (1/T)``, keep ``z >= keep_threshold``, i.e.
    top-k then top-p with ties kept, softmax over the kept set). ``temperature`` > 0."""
    from specengine.kernels.reference import keep_threshold

    z = logits.float() * temperature.reciprocal()[:, None]
    kept = z >= keep_threshold(z, top_k, top_p)[:, None]
    w = torch.where(kept, torch.exp(z - z.max(1, keepdim=True).values), 0.0)
    return w / w.sum(1, keepdim=True)


def samples_drafts(sample: bool, seqs: list[Sequence]) -> bool:
    """Whether a chain over ``seqs`` draws its drafts: the drafter's ``sample`` option is on and
    at least one request samples. A batch of greedy requests takes argmaxes and carries no
    distributions, so it costs what a point-mass drafter's chain costs (no ``[B, k, V]``
    one-hots for the verify pass to read). Decided once per chain, never per depth: a row's
    drafts are all sampled or all point masses."""
    return sample and max([s.params.temperature for s in seqs], default=0.0) > 0


def choose_tokens(logits: Tensor, seqs: list[Sequence], positions: list[int],
                  sample: bool, vocab_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Draft tokens from ``logits [B, V]``: the argmax (``sample`` False, or greedy requests),
    else a draw from :func:`processed_probs` with the request's temperature / top-k / top-p,
    made with :func:`draft_uniforms` of (request seed, ``positions[b]``) by an exponential race
    (``argmax q / Exp(1)`` is distributed as ``q``). Returns the tokens ``[B]`` and, when
    sampling, the distributions they were drawn from ``[B, V]`` float32 (one-hot for greedy
    requests). ``vocab_ids [Vd]``: ``logits`` are over a draft vocabulary whose column ``d``
    is target token ``vocab_ids[d]`` (:func:`choose_from`)."""
    if not sample:
        cols = logits.float().argmax(-1)
        return (cols if vocab_ids is None else vocab_ids[cols]), None
    dev = logits.device
    params = [s.params for s in seqs]
    return choose_from(
        logits, True,
        to_device(np.array([p.temperature for p in params], np.float32), dev),
        to_device(np.array([p.top_k for p in params], np.int64), dev),
        to_device(np.array([p.top_p for p in params], np.float32), dev),
        to_device(np.array([_signed(s.seed) for s in seqs], np.int64), dev),
        to_device(np.array(positions, np.int64), dev), vocab_ids=vocab_ids)


def choose_from(logits: Tensor, sample: bool, temperature: Tensor, top_k: Tensor,
                top_p: Tensor, seeds: Tensor, positions: Tensor,
                vocab_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`choose_tokens` on per-row device tensors (all ``[B]``; no host data), as the
    static draft loop reads them from the persistent batch.

    ``vocab_ids [Vd]`` int64: the logits cover a draft vocabulary (an EAGLE-3 head's), column
    ``d`` being target token ``vocab_ids[d]``. The choice is made over those columns, the
    tokens returned are target ids, and ``q`` stays over the columns ``[B, Vd]``: the
    rejection sampler reads it through the inverse map (``draft_index``), so no ``[B, V]``
    copy with zeros at the tokens the head cannot propose is ever made. The race keys every
    column by its target id (:func:`draft_uniforms`): the same draw as over the target
    vocabulary with those tokens at probability 0."""
    logits = logits.float()
    cols = logits.argmax(-1)
    tokens = cols if vocab_ids is None else vocab_ids[cols]
    if not sample:
        return tokens, None
    greedy = temperature == 0
    q = processed_probs(logits, torch.where(greedy, 1.0, temperature), top_k, top_p)
    one_hot = torch.zeros_like(logits).scatter_(-1, cols[:, None], 1.0)
    q = torch.where(greedy[:, None], one_hot, q)
    u = draft_uniforms(seeds, positions, logits.shape[-1], vocab_ids)
    drawn = (q / -torch.log(u)).argmax(-1)
    if vocab_ids is not None:
        drawn = vocab_ids[drawn]
    return torch.where(greedy, tokens, drawn), q


def draft_kv_cache(ctx: DraftContext, num_layers: int, num_kv_heads: int,
                   head_dim: int) -> KVCache:
    """A drafter's own paged cache, holding as many tokens as the target's (so the draft never
    runs out first); on CUDA the free memory is split between both caches."""
    cfg = ctx.config
    bpt = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, cfg.torch_dtype)
    blocks = num_kv_blocks(cfg, ctx.model_config, ctx.device, extra_bytes_per_token=bpt,
                           measured_peak=ctx.measured_peak)
    return KVCache(blocks, cfg.block_size, num_layers, num_kv_heads, head_dim, cfg.torch_dtype,
                   ctx.device)


def tree_level_mask(tree: DraftTree, n: int, batch: int, device: torch.device) -> Tensor:
    """Packed mask of tree nodes ``1 .. n-1`` (the root sits in the context), per sequence."""

    return to_device(tree.prefix_masks_host[n], device).repeat(batch, 1)


def run_chain(seqs: tuple[Sequence, ...], num_drafts: list[int], logits: Tensor,
              advance: Callable[[list[int], list[int], Tensor, int], Tensor], sample: bool,
              device: torch.device, vocab_ids: Tensor | None = None
              ) -> tuple[Tensor, Tensor | None]:
    """The chain loop: draft ``j`` of row ``b`` is chosen from the logits after draft ``j - 1``.

    ``logits [R, V]`` are those of the rows ``b`` with ``num_drafts[b] > 0`` (in order) for
    draft 0. ``advance(keep, rows, fed, j)`` runs one draft pass for the rows that want a
    draft ``j`` (``keep`` indexes them in the previous ``rows``; ``fed`` are their drafts
    ``j - 1``, on the device: no host sync between draft steps) and returns their logits.
    Returns ``ids [B, max k]`` and, when sampling, the draft distributions ``[B, max k, V]``
    (``[B, max k, Vd]`` over a draft vocabulary ``vocab_ids``: :func:`choose_from`)."""
    width = max(num_drafts)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64, device=device)
    probs = None
    rows = [b for b, n in enumerate(num_drafts) if n > 0]
    sample = samples_drafts(sample, [seqs[b] for b in rows])
    tokens = ids[:0, 0]
    for j in range(width):
        if j > 0:
            keep = [i for i, b in enumerate(rows) if num_drafts[b] > j]
            rows = [rows[i] for i in keep]
            fed = tokens if len(keep) == len(tokens) else tokens[_index(keep, device)]
            logits = advance(keep, rows, fed, j)
        tokens, q = choose_tokens(logits, [seqs[b] for b in rows],
                                  [len(seqs[b]) + j for b in rows], sample, vocab_ids)
        sel = _index(rows, device)
        ids[sel, j] = tokens
        if q is not None:
            if probs is None:
                probs = torch.zeros(len(seqs), width, q.shape[-1], device=device)
            probs[sel, j] = q
    return ids, probs


def top_children(logits: Tensor, num: int) -> Tensor:
    """The ``num`` most likely tokens of each row of ``logits [B, V]`` ``[B, num]``, by rank.
    A rank the draft cannot fill (past the vocabulary, or at a ``-inf`` logit: a target id
    with no draft id) repeats the rank-0 token: a wasted but harmless point mass, never a
    token of draft probability 0."""
    values, ids = logits.topk(min(num, logits.shape[-1]), dim=-1)
    ids = torch.where(values > float("-inf"), ids, ids[:, :1])
    return torch.cat([ids, ids[:, :1].expand(-1, num - ids.shape[1])], dim=1)


#: ``choose(logits [B * m, Vc], m, depth) -> (children [B * m, width] target ids, q [B * m,
#: Vc])``: the children of ``m`` nodes per sequence, at ``depth``, drawn (:func:`sample_children`)
ChildChooser = Callable[[Tensor, int, int], tuple[Tensor, Tensor]]


def sample_children(logits: Tensor, num: int, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                    seeds: Tensor, positions: Tensor, vocab_ids: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
    """``num`` children per row of ``logits [R, Vc]`` drawn one after another without
    replacement from ``q`` (:func:`processed_probs` with the row's settings), and ``q``
    ``[R, Vc]`` float32. The order of ``q / E`` (``E = -log u``, :func:`draft_uniforms` of
    (seed, position), one per token) is such a draw: the exponential race run again over the
    tokens not yet drawn. Past ``q``'s support the ranks are tokens of probability 0 (the
    rejection sampler skips them). Greedy rows (temperature 0) take the ``num`` most likely
    tokens and a one-hot ``q`` (their verify pass keeps the child that is the argmax).
    ``vocab_ids [Vc]``: the target ids of the columns (:func:`choose_from`)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = temperature == 0
    q = processed_probs(logits, torch.where(greedy, 1.0, temperature), top_k, top_p)
    u = draft_uniforms(seeds, positions, vocab, vocab_ids)
    keys = torch.where(greedy[:, None], logits, q / -torch.log(u))
    cols = keys.topk(min(num, vocab), dim=-1).indices
    cols = torch.cat([cols, cols[:, :1].expand(-1, num - cols.shape[1])], dim=1)
    one_hot = torch.zeros_like(q).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    q = torch.where(greedy[:, None], one_hot, q)
    return (cols if vocab_ids is None else vocab_ids[cols]), q


def expand_tree(tree: DraftTree, root_logits: Tensor,
                run_level: Callable[[int, Tensor], Tensor],
                compute_logits: Callable[[Tensor], Tensor],
                index: Callable[[np.ndarray], Tensor] | None = None,
                choose: ChildChooser | None = None) -> tuple[Tensor, Tensor | None]:
    """Level by level: node ``i`` of depth ``d`` is its parent's rank-``ranks[i]`` child.
    ``run_level(n, node_ids [B, n-1])`` feeds nodes ``1 .. n-1`` (every node down to depth
    ``d``, ancestor mask) and returns their output hidden states ``[B, n-1, H]``, whose logits
    (``compute_logits``) rank the children of the depth-``d`` nodes. Returns the node tokens
    ``[B, N-1]`` (root excluded) and, with ``choose``, the distribution each node was drawn
    from ``[B, N-1, Vc]`` (its parent's ``q``; siblings share it), else None. Without
    ``choose`` the rank-``r`` child is the ``r``-th most likely token (a point mass); with it,
    the ``r``-th draw without replacement. ``index(host array)`` makes the device index
    tensors (a captured pass passes one that hands out constants made once: no copy inside a
    graph)."""
    batch, width, dev = root_logits.shape[0], tree.max_rank + 1, root_logits.device
    if index is None:
        def index(a: np.ndarray) -> Tensor:
            return _index(a, dev)
    # top[:, i, r]: the rank-r child of node i. One LM-head pass per level (the nodes of the
    # level that have children, batched) and one gather per level, not one per node.
    top = torch.zeros(batch, tree.num_nodes, width, dtype=torch.int64, device=dev)
    q_of = probs = None  # q_of[:, i]: the distribution node i's children were drawn from
    if choose is None:
        top[:, 0] = top_children(root_logits, width)
    else:
        top[:, 0], q0 = choose(root_logits, 1, 1)
        q_of = q0.new_zeros(batch, tree.num_nodes, q0.shape[-1])
        q_of[:, 0] = q0
        probs = q0.new_zeros(batch, tree.num_nodes, q0.shape[-1])
    node_ids = torch.zeros(batch, tree.num_nodes, dtype=torch.int64, device=dev)
    has_children = np.zeros(tree.num_nodes, dtype=bool)
    has_children[tree.parents[1:]] = True
    for d in range(1, tree.max_depth + 1):
        level = np.flatnonzero(tree.depths == d)
        parents = index(tree.parents[level])
        ranks = index(tree.ranks[level])
        node_ids[:, index(level)] = top[:, parents, ranks]
        if probs is not None:
            probs[:, index(level)] = q_of[:, parents]  # type: ignore[index]
        if d == tree.max_depth:
            break
        n = int((tree.depths <= d).sum())
        out = run_level(n, node_ids[:, 1:n])
        inner = level[has_children[level]]
        h = out[:, index(inner - 1)]  # [B, m, H]
        logits = compute_logits(h.reshape(-1, h.shape[-1]))
        if choose is None:
            ranked = top_children(logits, width)
        else:
            ranked, q = choose(logits, len(inner), d + 1)
            q_of[:, index(inner)] = q.view(batch, len(inner), -1)  # type: ignore[index]
        top[:, index(inner)] = ranked.view(batch, len(inner), width)
    return node_ids[:, 1:], (None if probs is None else probs[:, 1:])


def children_chooser(width: int, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                     seeds: Tensor, positions: Tensor,
                     vocab_ids: Tensor | None = None) -> ChildChooser:
    """The :data:`ChildChooser` of :func:`sample_children` for one tree per row of the ``[B]``
    device tensors: the children of depth ``d`` are drawn at ``positions + d - 1``
    (``positions``: where each row's chain draws its draft 0), with the row's seed,
    temperature, top-k and top-p (:func:`choose_from`'s per-row arguments)."""

    def choose(logits: Tensor, m: int, depth: int) -> tuple[Tensor, Tensor]:
        def each(t: Tensor) -> Tensor:  # one entry per node: m nodes per row, row-major
            return t.repeat_interleave(m)
        return sample_children(logits, width, each(temperature), each(top_k), each(top_p),
                               each(seeds), each(positions + depth - 1), vocab_ids)

    return choose


def tree_chooser(seqs: tuple[Sequence, ...] | list[Sequence], width: int, device: torch.device,
                 vocab_ids: Tensor | None = None) -> ChildChooser:
    """:func:`children_chooser` for ``seqs``: draft 0 of a chain sits at ``len(seq)``
    (:func:`choose_tokens`), so the children of depth ``d`` at ``len(seq) + d - 1``."""
    params = [s.params for s in seqs]
    return children_chooser(
        width, to_device(np.array([p.temperature for p in params], np.float32), device),
        to_device(np.array([p.top_k for p in params], np.int64), device),
        to_device(np.array([p.top_p for p in params], np.float32), device),
        to_device(np.array([_signed(s.seed) for s in seqs], np.int64), device),
        to_device(np.array([len(s) for s in seqs], np.int64), device), vocab_ids)


def tree_proposal(nodes: Tensor, probs: Tensor | None, counts: np.ndarray) -> DraftProposal:
    """A tree's :class:`DraftProposal`: the node tokens ``[B, N-1]`` (and, for sampled
    children, each node's ``q`` ``[B, N-1, Vc]``) padded with zeros to the step's widest
    row (``counts``: the drafts each row verifies)."""
    batch, nodes_n = nodes.shape
    width = int(counts.max())
    ids = torch.zeros(batch, width, dtype=torch.int64, device=nodes.device)
    ids[:, :nodes_n] = nodes
    if probs is not None and probs.shape[1] < width:
        probs = torch.cat([probs, probs.new_zeros(batch, width - probs.shape[1],
                                                  probs.shape[2])], 1)
    return DraftProposal(ids, counts, probs)


def _index(rows: list[int] | np.ndarray, device: torch.device) -> Tensor:
    """An int64 index tensor on ``device`` from host data (a non-blocking copy)."""
    return to_device(np.asarray(rows, dtype=np.int64), device)
