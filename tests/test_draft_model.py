"""Small-LM drafter: greedy losslessness, full acceptance when the draft is the target, draft
proposals equal to a plain transformers forward, vocabulary checks, sampled drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint
from lossless import (
    TREES,
    assert_greedy_lossless,
    assert_proposals_ranked,
    ragged_requests,
    record_proposals,
)

from specengine import SamplingParams, SpecEngine
from specengine.drafters.draft_model import DraftModelDrafter

STOPS = (3, 17, 64, 99)


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint  # conftest's random Qwen3, written once per session


@pytest.fixture(scope="module")
def draft_hf() -> torch.nn.Module:
    return make_hf_model("llama", num_layers=1, seed=3)  # random: near-zero acceptance


@pytest.fixture(scope="module")
def draft_dir(draft_hf: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(draft_hf, tmp_path_factory.mktemp("draft"))


def make_engine(target: Path, draft: Path, **kwargs: object) -> SpecEngine:
    return SpecEngine(target, draft=str(draft), device="cpu", dtype="float32", max_model_len=96,
                      max_batch_size=16, kv_cache_tokens=4096, **kwargs)


def assert_draft_cache_empty(engine: SpecEngine) -> None:
    drafter = engine.drafter
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.kv_cache.num_free_blocks == drafter.kv_cache.num_blocks
    assert not drafter._states


def test_random_draft_greedy_lossless(target_dir: Path, draft_dir: Path) -> None:
    engine = make_engine(target_dir, draft_dir)
    prompts, params = ragged_requests(128, stop_pool=STOPS)
    assert_greedy_lossless(engine, prompts, params)
    assert_draft_cache_empty(engine)


def test_draft_equal_to_target_accepts_everything(target_dir: Path) -> None:
    engine = make_engine(target_dir, target_dir)
    prompts, params = ragged_requests(128, stop_pool=STOPS, seed=1)
    base = engine.generate(prompts, k=0, sampling=params)
    for kwargs in (dict(k=1), dict(k=4), dict(k=7), dict(tree=TREES["binary2"])):
        outs = engine.generate(prompts, sampling=params, **kwargs)
        assert [o.token_ids for o in outs] == [b.token_ids for b in base], kwargs
        stats = engine.stats
        assert stats.num_draft_tokens > 0
        # every rank-0 draft is the target's own choice: nothing is ever rejected
        assert stats.accepted_per_position == stats.proposed_per_position, kwargs
        if "k" in kwargs:
            assert stats.num_accepted_tokens == stats.num_draft_tokens, kwargs
            assert all(o.num_accepted_tokens == o.num_draft_tokens for o in outs)
    assert_draft_cache_empty(engine)


def test_proposals_equal_a_plain_forward(target_dir: Path, draft_dir: Path,
                                         draft_hf: torch.nn.Module) -> None:
    """Every chain / tree the drafter proposed mid-generation is what a fresh transformers
    forward of the draft over the same tokens ranks first (so the incremental KV is right)."""
    engine = make_engine(target_dir, draft_dir)
    prompts, params = ragged_requests(128, n=6, seed=2)
    seen = record_proposals(engine, [dict(k=3), dict(tree=TREES["deep_chain_and_branch"])],
                            prompts, params)

    def ranked(tokens: list[int], path: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return draft_hf(torch.tensor([tokens + path])).logits[0, -1].float()

    assert_proposals_ranked(seen, ranked)


def test_vocab_mismatch_is_a_clear_error(target_dir: Path,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    other = save_checkpoint(make_hf_model("llama", vocab_size=96, num_layers=1),
                            tmp_path_factory.mktemp("other_vocab"))
    with pytest.raises(ValueError, match="vocab_size 96 but the target has 128"):
        make_engine(target_dir, other)


def test_sampled_drafts_carry_their_distributions(target_dir: Path, draft_dir: Path) -> None:
    engine = make_engine(target_dir, draft_dir, draft_options={"sample": True})
    drafter = engine.drafter
    assert isinstance(drafter, DraftModelDrafter) and not drafter.point_mass
    from specengine.core.sequence import Sequence

    def propose(seed: int, params: SamplingParams) -> tuple[list[int], torch.Tensor | None]:
        seq = Sequence(10**6 + seed, [5, 9, 2, 7], params, seed, ())
        try:
            out = drafter.propose((seq,), [4], None)
        finally:
            drafter.release(seq)
        return out.token_ids[0].tolist(), None if out.probs is None else out.probs[0]

    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    tokens, probs = propose(1, sp)
    assert probs is not None and probs.shape == (4, 128) and probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    assert all(probs[j, t] > 0 for j, t in enumerate(tokens))
    assert int((probs > 0).sum(-1).max()) <= 20  # top-k applied
    assert propose(1, sp)[0] == tokens  # own seeded stream: reproducible
    assert len({tuple(propose(s, sp)[0]) for s in range(2, 8)}) > 1
    # A greedy request's chain is the argmax chain and carries no distribution (point masses:
    # the verify pass reads none, drafting.samples_drafts).
    assert propose(1, SamplingParams(temperature=0.0))[1] is None
    # Next to a sampled request, a greedy one's drafts are one-hot point masses.
    seqs = (Sequence(7, [5, 9, 2, 7], sp, 1, ()),
            Sequence(8, [5, 9, 2, 7], SamplingParams(temperature=0.0), 1, ()))
    try:
        out = drafter.propose(seqs, [4, 4], None)
    finally:
        for seq in seqs:
            drafter.release(seq)
    assert out.probs is not None and out.token_ids[0].tolist() == tokens
    assert torch.equal(out.probs[1].max(-1).values, torch.ones(4))


def test_sampled_draft_equal_to_target_is_accepted(target_dir: Path) -> None:
    """Sampled drafts from the target itself: q == p, so rejection sampling keeps (nearly)
    every draft, and the same seeds give the same completions."""
    engine = make_engine(target_dir, target_dir, draft_options={"sample": True})
    prompts, _ = ragged_requests(128, seed=3)
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=16, seed=i)
              for i in range(len(prompts))]
    outs = engine.generate(prompts, k=4, sampling=params)
    stats = engine.stats
    assert stats.num_draft_tokens > 100
    assert stats.num_accepted_tokens >= 0.99 * stats.num_draft_tokens
    again = engine.generate(prompts, k=4, sampling=params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert_draft_cache_empty(engine)


def test_static_slot_bookkeeping_equals_eager(tiny_checkpoint: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The static path keeps the draft cache's state by arena slot and catches up after each
    verify step with one array update (``StaticLMChain.observe``); the eager path keeps its
    per-sequence loop. Both give the same tokens while sequences join, finish, are preempted
    (a 10-block cache) and run above the largest bucket (12 rows > 8), with full and partial
    acceptance (greedy self-drafts against greedy and sampled rows), and free every draft
    block."""
    from test_static_path import both_paths, mixed_params

    from specengine.drafters.static_lm_chain import StaticLMChain

    observed: list[bool] = []
    array_observe = StaticLMChain.observe

    def counted(self: StaticLMChain, num_rows: int, num_accepted: object) -> bool:
        observed.append(array_observe(self, num_rows, num_accepted))  # type: ignore[arg-type]
        return observed[-1]

    monkeypatch.setattr(StaticLMChain, "observe", counted)
    prompts, _ = ragged_requests(128, n=12, seed=4)
    # greedy rows accept every draft (the draft is the target), sampled rows some
    params = [SamplingParams(temperature=0.7 * (s % 2), max_tokens=p.max_tokens, seed=s)
              for s, p in enumerate(mixed_params(12, 0.7, 0))]
    engines = both_paths(tiny_checkpoint, str(tiny_checkpoint), prompts, 3, params,
                         static_passes=("verify", "lm-draft"), max_model_len=96,
                         kv_cache_tokens=160)
    assert all(e.scheduler.num_preemptions > 0 for e in engines)
    stats = engines[1].stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # partial acceptance
    assert len(observed) > 5 and all(observed)  # every static step observed with arrays
    for engine in engines:
        assert_draft_cache_empty(engine)
