"""Shared check of greedy losslessness: speculative output equals the engine's own ``k=0``."""

from __future__ import annotations

import random

from specengine import SamplingParams, SpecEngine

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
