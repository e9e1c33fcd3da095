"""Shared check of greedy losslessness: speculative output equals the engine's own ``k=0``."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from specengine import SamplingParams, SpecEngine
from specengine.model.attention import AttentionBackend
from specengine.tree import DraftTree

TREES = {
    "binary2": [(0,), (1,), (0, 0), (0, 1), (1, 0)],
    "deep_chain_and_branch": [(0,), (1,), (2,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 1), (1, 0)],
}


def ragged_requests(vocab: int, n: int = 16, seed: int = 0,
                    stop_pool: tuple[int, ...] = ()) -> tuple[list[list[int]],
                                                              list[SamplingParams]]:
    """``n`` prompts of lengths 1..40 (some repetitive, so n-gram drafts hit), with mixed
    ``max_tokens`` and, for every third request, stop tokens."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        base = [rng.randrange(vocab) for _ in range(rng.randrange(1, 14))]
        prompts.append((base * 3)[: rng.randrange(1, 41)] if i % 2 else base)
        stop = tuple(rng.sample(stop_pool, 1)) if stop_pool and i % 3 == 0 else ()
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 33),
                                     stop_token_ids=stop))
    return prompts, params


def assert_greedy_lossless(engine: SpecEngine, prompts: list[list[int]],
                           params: list[SamplingParams], ks: tuple[int, ...] = (1, 3, 5, 7),
                           trees: tuple[str, ...] = tuple(TREES), atol: float = 1e-5) -> None:
    """Every chain length in ``ks`` and every tree gives exactly the tokens of ``k=0`` and
    their logprobs within ``atol``; the KV cache ends empty."""
    base = engine.generate(prompts, k=0, sampling=params)
    runs = [(f"k={k}", dict(k=k)) for k in ks] + [(t, dict(tree=TREES[t])) for t in trees]
    for label, kwargs in runs:
        outs = engine.generate(prompts, sampling=params, **kwargs)
        for i, (o, b) in enumerate(zip(outs, base)):
            assert o.token_ids == b.token_ids, f"{label}: request {i} differs from k=0"
            assert o.finish_reason == b.finish_reason, f"{label}: request {i}"
            assert max((abs(x - y) for x, y in zip(o.logprobs, b.logprobs)), default=0.0) <= atol
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, label
        assert engine.stats.num_draft_tokens > 0, f"{label}: nothing was drafted"


class DenseCausal(AttentionBackend):
    """Plain causal attention over the tokens of one call (no cache): the reference that
    drafters' paged passes are checked against."""

    def write_kv(self, k, v, k_cache, v_cache, meta) -> None:  # type: ignore[no-untyped-def]
        self.k, self.v = k, v

    def attend(self, q, k_cache, v_cache, meta, scale):  # type: ignore[no-untyped-def]
        group = q.shape[1] // self.k.shape[1]
        k = self.k.repeat_interleave(group, 1)
        v = self.v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        n = q.shape[0]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


Proposal = tuple[list[int], list[int], DraftTree | None]


def record_proposals(engine: SpecEngine, runs: list[dict[str, object]], prompts: list[list[int]],
                     params: list[SamplingParams]) -> list[Proposal]:
    """Generate ``prompts`` once per ``runs`` entry (``generate`` kwargs) and return every
    ``(sequence tokens, drafts, tree)`` the drafter proposed on the way."""
    drafter = engine.drafter
    seen: list[Proposal] = []
    inner = drafter.propose  # type: ignore[union-attr]

    def recording(seqs, num_drafts, tree):  # type: ignore[no-untyped-def]
        out = inner(seqs, num_drafts, tree)
        for b, seq in enumerate(seqs):
            n = int(out.num_draft_tokens[b])
            seen.append((list(seq.token_ids), out.token_ids[b, :n].tolist(), tree))
        return out

    drafter.propose = recording  # type: ignore[union-attr, method-assign]
    try:
        for kwargs in runs:
            engine.generate(prompts, sampling=params, **kwargs)
    finally:
        del drafter.propose  # type: ignore[union-attr]
    return seen


def assert_proposals_ranked(seen: list[Proposal],
                            logits_after: Callable[[list[int], list[int]], torch.Tensor],
                            every: int = 3) -> None:
    """Each proposed chain / tree node is the rank-``r`` choice (``r`` = its tree rank, 0 for
    chains; 0 too where rank ``r`` is past the draft's finite logits) of
    ``logits_after(tokens, path)``, a from-scratch recomputation after the sequence's tokens
    and the node's drafted ancestors."""
    assert len(seen) > 20
    for tokens, drafts, tree in seen[::every]:
        if not drafts:
            continue
        tree = tree or DraftTree.chain(len(drafts))
        paths: list[list[int]] = [[]]
        for i in range(1, tree.num_nodes):
            path = paths[int(tree.parents[i])]
            logits = logits_after(tokens, path)
            ranked = logits.sort(descending=True).values
            rank = int(tree.ranks[i])  # a rank the draft cannot fill repeats rank 0
            rth = ranked[rank] if rank < len(ranked) and ranked[rank] > -math.inf else ranked[0]
            assert abs(logits[drafts[i - 1]] - rth) <= 1e-4
            paths.append(path + [drafts[i - 1]])


def processed_law(logits: torch.Tensor, temp: float, top_k: int, top_p: float,
                  min_p: float = 0.0, banned: tuple[int, ...] = ()) -> torch.Tensor:
    """The exact target law of one row of ``logits`` in float64, independently of the
    implementation (sort-based): ``banned`` ids removed (``min_tokens`` masks EOS / stop ids),
    then temperature, min-p (p < min_p * max p dropped), top-k, top-p (vLLM's order);
    temperature 0 is the argmax as a point mass."""
    logits = logits.double().clone()
    logits[list(banned)] = float("-inf")
    if temp == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    x = logits / temp
    if min_p > 0:
        p = torch.softmax(x, -1)
        x = x.masked_fill(p < min_p * p.max(), float("-inf"))
    if 0 < top_k < x.numel():
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    p = torch.softmax(x, -1)
    if top_p < 1:
        sp = p.sort(descending=True).values
        t = sp[int(((sp.cumsum(0) - sp) < top_p).sum()) - 1]
        p = torch.where(p >= t, p, 0.0)
        p = p / p.sum()
    return p
