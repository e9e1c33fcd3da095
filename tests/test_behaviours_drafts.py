"""Step bookkeeping no earlier test pinned (issue 37):

- a chain drafter (n-gram, suffix) may propose fewer drafts than the step asked: the step must
  verify and count only those. The drafter here is the engine's own, its counts cut to half,
  with the rest of each row padded by the *right* tokens (the k = 0 run's): a step that kept
  the stale counts would accept the padding (more accepted than drafted) and count drafts
  that were never proposed;
- tokens a stop string cuts off are not counted in the tokens per step
  (``EngineStats.num_step_tokens``: every kept token but each request's first, which its
  prefill samples).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from specengine import SamplingParams, SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    motif = [5, 9, 13, 7, 5, 9]
    return [(motif * 4)[: 10 + i] + rng.integers(1, 120, size=3).tolist() for i in range(6)]


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_fewer_drafts_than_asked_are_verified_and_counted_as_proposed(
        tiny_checkpoint: Path, drafter: str) -> None:
    kw = dict(device="cpu", dtype="float32", max_model_len=96, kv_cache_tokens=4096)
    ps = prompts()
    ref = {tuple(p): list(o.token_ids) for p, o in zip(
        ps, SpecEngine(tiny_checkpoint, **kw).generate(ps, sampling=GREEDY))}
    eng = SpecEngine(tiny_checkpoint, draft=drafter, **kw)
    original = eng.drafter.propose
    proposed: dict[tuple[int, ...], int] = defaultdict(int)

    def fewer(seqs, num_drafts, tree):
        prop = original(seqs, num_drafts, tree)
        ids = prop.token_ids.clone()
        counts = np.asarray(prop.num_draft_tokens, dtype=np.int64) // 2
        for b, seq in enumerate(seqs):
            p = tuple(seq.token_ids[: seq.num_prompt_tokens])
            done = len(seq.token_ids) - len(p)
            right = ref[p][done: done + ids.shape[1]]  # what the target will emit next
            ids[b, counts[b]: len(right)] = torch.tensor(right[counts[b]:], dtype=ids.dtype)
            proposed[p] += int(counts[b])
        return dataclasses.replace(prop, token_ids=ids, num_draft_tokens=counts,
                                   as_asked=False)

    eng.drafter.propose = fewer
    outs = eng.generate(ps, k=4, sampling=GREEDY)
    assert sum(proposed.values()) > 0
    for p, o in zip(ps, outs):
        assert list(o.token_ids) == ref[tuple(p)]  # lossless
        assert o.num_draft_tokens == proposed[tuple(p)]
        assert o.num_accepted_tokens <= o.num_draft_tokens
    stats = eng.stats
    assert stats.num_draft_tokens == sum(proposed.values())
    assert sum(stats.proposed_per_position) == stats.num_draft_tokens


def test_tokens_cut_by_a_stop_string_are_not_counted_per_step() -> None:
    """The bundled pair at k = 3 (several tokens a step): with and without stop strings, the
    tokens counted per step are the kept tokens less each request's prefill token."""
    eng = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                     kv_cache_tokens=4096)
    texts = ["Q:472+385=", "Q:18+904=", "Q:333+333=", "Q:70+7="]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = eng.generate(texts, k=3, sampling=plain)
    assert eng.stats.num_step_tokens == sum(len(o.token_ids) - 1 for o in free)
    cut_any = False
    for stop in (["3"], ["5", "8"], ["\n"], ["=", "1"]):
        outs = eng.generate(texts, k=3, sampling=dataclasses.replace(plain, stop=stop))
        cut_any |= any(len(o.token_ids) < len(f.token_ids) for o, f in zip(outs, free))
        assert eng.stats.num_step_tokens == sum(len(o.token_ids) - 1 for o in outs), stop
    assert cut_any


@pytest.mark.parametrize("k", [0, 3])
def test_top_logprobs_of_every_row_when_some_rows_ask_none(k: int) -> None:
    """A batch mixing requests without ``logprobs`` and with: every request that asked gets
    one entry per token (equal to its run alone), whatever rows come before it."""
    eng = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                     kv_cache_tokens=4096)
    texts = ["Q:472+385=", "Q:18+904=", "Q:333+333=", "Q:70+7="]
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    asked = dataclasses.replace(plain, logprobs=2)
    params = [plain, asked, plain, asked]
    outs = eng.generate(texts, k=k, sampling=params)
    for t, p, o in zip(texts, params, outs):
        if p.logprobs is None:
            assert o.top_logprobs == ()
            continue
        alone = eng.generate([t], k=k, sampling=p)[0]
        assert len(o.top_logprobs) == len(o.token_ids) == 8
        assert [sorted(d) for d in o.top_logprobs] == [sorted(d) for d in alone.top_logprobs]


def test_suffix_open_weight_counts_open_occurrences_against_the_draft() -> None:
    """``suffix_open_weight``: a running sibling standing at the same context (an occurrence
    not continued yet) lowers the estimate of the continuation others took, so at
    min_prob 0.5 the draft is kept with weight 0 and dropped with weight 1."""
    from test_suffix_drafter import chains_of, seq_with

    from specengine.drafters.suffix import SuffixDrafter

    prompt = [10, 11, 12]
    got = {}
    for weight in (0.0, 1.0):
        drafter = SuffixDrafter(suffix_prompt_tokens=2, suffix_smoothing=0.0,
                                suffix_min_prob=0.5, suffix_open_weight=weight)
        seqs = (seq_with(0, prompt, [1, 2, 3, 4, 5]), seq_with(1, prompt, [1, 2]),
                seq_with(2, prompt, [1, 2, 7]))
        got[weight] = chains_of(drafter, seqs, 4)
    assert got == {0.0: [[], [3, 4, 5], []], 1.0: [[], [], []]}
