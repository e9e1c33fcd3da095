"""One speculative step (``core.step``): the draft plan's cuts, and the step's bookkeeping on a
tiny engine (chains and trees, greedy and sampled): outputs equal plain decoding's (greedy),
and the step counters add up to what the requests report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specengine import SamplingParams, SpecEngine
from specengine.core.sequence import Sequence
from specengine.core.step import _filled, _shape, num_drafts_for
from specengine.tree import DraftTree


def _seq(prompt_len: int, generated: int, max_tokens: int) -> Sequence:
    s = Sequence(0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0, ())
    s.append([7] * generated, [0.0] * generated, 1000)
    return s


def test_draft_length_is_cut_by_max_tokens_and_the_context_limit() -> None:
    """``k``, but at most ``max_tokens - generated - 1`` (a step emits drafts + 1) and at most
    ``max_model_len - len`` (the last fed position), never below 0."""
    assert num_drafts_for(_seq(5, 0, 100), 4, 64) == 4
    assert num_drafts_for(_seq(5, 2, 6), 4, 64) == 3  # 4 tokens left: 3 drafts + 1
    assert num_drafts_for(_seq(5, 5, 6), 4, 64) == 0  # 1 token left: plain decoding
    assert num_drafts_for(_seq(5, 0, 100), 4, 7) == 2  # positions 5, 6 then the limit
    assert num_drafts_for(_seq(8, 0, 100), 4, 7) == 0  # (past the limit: none, not negative)
    assert num_drafts_for(_seq(5, 0, 100), 0, 64) == 0


def test_step_shapes_and_filled_rows_are_made_once() -> None:
    a = _filled(3, 2)
    assert a.tolist() == [2, 2, 2] and a.dtype == np.int64 and not a.flags.writeable
    assert _filled(3, 2) is a
    tree = DraftTree([(0,), (1,)])
    s = _shape(4, 3, tree, True, False, True)
    assert _shape(4, 3, tree, True, False, True) is s
    assert (s.num_rows, s.num_tokens, s.tree, s.has_probs, s.masks_stops, s.top_logprobs) == \
        (4, 3, tree, True, False, True)


PROMPTS = [[5, 9, 13, 7, 5, 9, 13], [1, 2, 3], [8] * 11, [4, 6, 4, 6, 4, 6, 4, 6]]


@pytest.fixture(scope="module")
def tiny_pair(tiny_checkpoint: Path) -> SpecEngine:
    return SpecEngine(tiny_checkpoint, str(tiny_checkpoint), device="cpu", dtype="float32",
                      max_model_len=64, kv_cache_tokens=2048, max_batch_size=8)


def _check_counters(eng: SpecEngine, outs, chain: bool = True) -> None:
    st = eng.stats
    assert st.num_steps > 0
    assert st.num_step_tokens == sum(len(o.token_ids) - 1 for o in outs)
    # every request takes part in each step from its prefill to its end
    assert st.num_seq_steps == sum(o.num_steps - 1 for o in outs)
    assert st.num_draft_tokens == sum(o.num_draft_tokens for o in outs)
    if chain:  # (a tree proposes all its nodes, counted per position by depth)
        assert st.num_draft_tokens == sum(st.proposed_per_position)
    assert st.num_accepted_tokens == sum(o.num_accepted_tokens for o in outs) == \
        sum(st.accepted_per_position)
    assert 0 < st.num_accepted_tokens <= st.num_draft_tokens


@pytest.mark.parametrize("tree", [None, [(0,), (1,), (0, 0), (0, 0, 0)]])
def test_greedy_steps_equal_plain_decoding_and_count_what_they_kept(
        tiny_pair: SpecEngine, tree) -> None:
    """Chains and trees of self-drafts (max_tokens ragged: the plan is cut near the end) emit
    plain decoding's tokens, and the step counters equal the requests' own."""
    params = [SamplingParams(temperature=0.0, max_tokens=9 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want = [o.token_ids for o in tiny_pair.generate(PROMPTS, k=0, sampling=params)]
    assert tiny_pair.stats.num_draft_tokens == 0
    assert tiny_pair.stats.num_seq_steps == sum(len(t) - 1 for t in want)
    kw = {"k": 3} if tree is None else {"k": 3, "tree": tree}
    outs = tiny_pair.generate(PROMPTS, sampling=params, **kw)
    assert [o.token_ids for o in outs] == want
    _check_counters(tiny_pair, outs, tree is None)
    st = tiny_pair.stats
    # greedy self-drafts are the target's own greedy tokens: a chain's drafts all pass, and
    # so does a tree's rank-0 path at every depth (it is drafted as the tree asked)
    if tree is None:
        assert st.num_accepted_tokens == st.num_draft_tokens
    else:
        assert st.accepted_per_position == st.proposed_per_position
        assert len([p for p in st.proposed_per_position if p]) == 3  # depths 1..3
        # every step verifies the whole tree (its 4 nodes past the root are the drafts)
        assert [o.num_draft_tokens for o in outs] == [4 * (o.num_steps - 1) for o in outs]


def test_sampled_steps_are_reproducible_and_count_what_they_kept(tiny_pair: SpecEngine) -> None:
    # (a low temperature: the tiny random model's laws are flat, its drafts rarely pass at 1)
    params = SamplingParams(temperature=0.1, max_tokens=12, seed=5, ignore_eos=True)
    a = tiny_pair.generate(PROMPTS, k=3, sampling=params)
    _check_counters(tiny_pair, a)
    assert tiny_pair.stats.num_accepted_tokens < tiny_pair.stats.num_draft_tokens
    b = tiny_pair.generate(PROMPTS, k=3, sampling=params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [len(o.token_ids) for o in a] == [12] * len(PROMPTS)


def test_the_steps_own_tree_compaction_keeps_the_accepted_paths(tiny_pair: SpecEngine) -> None:
    """Under tensor parallelism the verify pass leaves tree paths in place and the step moves
    the accepted nodes' K/V itself (one launch, mirrored to the other ranks): a tree run that
    way still emits plain decoding's tokens, and the mirror gets every move the step made."""
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 2 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want = [o.token_ids for o in tiny_pair.generate(PROMPTS, k=0, sampling=params)]
    verifier, kv = tiny_pair.graphs.verifier, tiny_pair.kv_cache
    mirrored: list[tuple[list[int], list[int]]] = []
    verifier.compacts_trees = False
    kv.mirror_compact = lambda src, dst: mirrored.append((list(src), list(dst)))
    try:
        outs = tiny_pair.generate(PROMPTS, k=3, tree=[(0,), (1,), (0, 0), (0, 0, 0)],
                                  sampling=params)
    finally:
        verifier.compacts_trees = True
        del kv.mirror_compact
    assert [o.token_ids for o in outs] == want
    assert mirrored and all(len(s) == len(d) > 0 for s, d in mirrored)
    assert all(a != b for s, d in mirrored for a, b in zip(s, d))  # only nodes out of place


def test_draft_counts_of_any_integer_dtype_are_taken(tiny_checkpoint: Path) -> None:
    """A drafter that proposes fewer drafts than asked may hand its counts as int32 (a
    ``DraftProposal``'s counts are host ints of any width): the step verifies and counts
    exactly those, losslessly."""
    import dataclasses

    eng = SpecEngine(tiny_checkpoint, "ngram", device="cpu", dtype="float32", max_model_len=64,
                     kv_cache_tokens=2048, max_batch_size=8)
    prompts = [[5, 9, 13, 7, 5, 9, 13, 7, 5, 9], [1, 2, 3, 1, 2, 3, 1, 2]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in eng.generate(prompts, k=0, sampling=params)]
    original = eng.drafter.propose
    proposed = []

    def halved(seqs, num_drafts, tree):
        prop = original(seqs, num_drafts, tree)
        counts = (np.asarray(prop.num_draft_tokens) // 2).astype(np.int32)
        proposed.append(int(counts.sum()))
        return dataclasses.replace(prop, num_draft_tokens=counts, as_asked=False)

    eng.drafter.propose = halved
    outs = eng.generate(prompts, k=4, sampling=params)
    assert [o.token_ids for o in outs] == want
    assert sum(proposed) > 0
    assert eng.stats.num_draft_tokens == sum(o.num_draft_tokens for o in outs) == sum(proposed)


@pytest.mark.parametrize("static", [False, True])
def test_a_chain_step_feeds_k_plus_one_tokens_only_on_the_static_path(
        tiny_checkpoint: Path, static: bool) -> None:
    """With an n-gram drafter that often proposes fewer than k drafts: the static path (one
    graph per k) verifies k + 1 tokens per row every drafting step, the eager path only as
    many as the longest chain of the step needs; both emit plain decoding's tokens."""
    eng = SpecEngine(tiny_checkpoint, "ngram", device="cpu", dtype="float32", max_model_len=64,
                     kv_cache_tokens=2048, max_batch_size=8, cuda_graphs=static,
                     graph_buckets=(1, 2, 4, 8))
    prompts = [[5, 9, 13, 7, 5, 9, 13, 7, 5, 9], [1, 2, 3, 1, 2, 3, 1, 2], [8, 4, 2, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    want = [o.token_ids for o in eng.generate(prompts, k=0, sampling=params)]
    fed: list[int] = []
    longest: list[int] = []
    run, propose = eng.graphs.run, eng.drafter.propose
    eng.graphs.run = lambda shape: fed.append(shape.num_tokens) or run(shape)

    def recorded(seqs, num_drafts, tree):
        prop = propose(seqs, num_drafts, tree)
        longest.append(int(max(prop.num_draft_tokens)))
        return prop

    eng.drafter.propose = recorded
    outs = eng.generate(prompts, k=4, sampling=params)
    assert [o.token_ids for o in outs] == want
    drafting = [n for n in fed if n > 1]
    assert drafting
    if static:
        assert set(drafting) == {5}
    else:  # each step feeds its longest chain + 1, some shorter than k
        assert drafting == [n + 1 for n in longest if n] and min(drafting) < 5


def test_min_tokens_hold_stop_ids_back_in_every_step(tiny_pair: SpecEngine) -> None:
    """A stop id the target would emit early is masked at every position before
    ``min_tokens`` (decode and verify steps alike), and allowed after."""
    prompt = [[5, 9, 13, 7, 5, 9, 13]]
    free = tiny_pair.generate(prompt, k=0, sampling=SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop = free[2]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, min_tokens=6,
                            stop_token_ids=[stop])
    for k in (0, 3):
        out = tiny_pair.generate(prompt, k=k, sampling=params)[0].token_ids
        assert len(out) >= 6 and stop not in out[:5], (k, out)


def test_sampled_drafts_carry_their_distributions_to_the_verify_pass(
        tiny_checkpoint: Path) -> None:
    """A drafter that samples its drafts hands their distributions to the step, which loads
    them and verifies with them (every drafting pass has probabilities)."""
    eng = SpecEngine(tiny_checkpoint, str(tiny_checkpoint), device="cpu", dtype="float32",
                     max_model_len=64, kv_cache_tokens=2048, max_batch_size=8,
                     draft_options={"sample": True})
    shapes = []
    run = eng.graphs.run
    eng.graphs.run = lambda shape: shapes.append(shape) or run(shape)
    params = SamplingParams(temperature=0.5, max_tokens=10, seed=3, ignore_eos=True)
    outs = eng.generate(PROMPTS, k=3, sampling=params)
    assert [len(o.token_ids) for o in outs] == [10] * len(PROMPTS)
    drafting = [s for s in shapes if s.num_tokens > 1]
    assert drafting and all(s.has_probs for s in drafting)
    assert eng.graphs.verifier._probs_all is not None



def test_plain_decoding_leaves_the_drafter_alone(tiny_pair: SpecEngine) -> None:
    """k = 0 requests on an engine with a drafter: the drafter is neither asked for drafts nor
    shown the steps (it catches up when drafting resumes); k > 0 shows it every step."""
    calls: list[str] = []
    d = tiny_pair.drafter
    originals = {name: getattr(d, name) for name in ("propose", "observe_step", "observe")}

    def spy(name):
        return lambda *a, **kw: calls.append(name) or originals[name](*a, **kw)

    for name in originals:
        setattr(d, name, spy(name))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        tiny_pair.generate(PROMPTS, k=0, sampling=params)
        assert calls == []
        tiny_pair.generate(PROMPTS, k=1, sampling=params)
        assert "propose" in calls and "observe_step" in calls
    finally:
        for name in originals:
            delattr(d, name)


@pytest.mark.parametrize("k", [0, 3])
def test_finish_reasons_and_step_count_of_one_request(tiny_pair: SpecEngine, k: int) -> None:
    """A request ends with "stop" at a stop id and with "length" at max_tokens; the engine
    counts one step per verify pass after the prefill."""
    prompt = [[5, 9, 13, 7, 5, 9, 13]]
    free = tiny_pair.generate(prompt, k=k, sampling=SamplingParams(
        temperature=0.0, max_tokens=9, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 9
    assert tiny_pair.stats.num_steps == free.num_steps - 1 > 1
    stopped = tiny_pair.generate(prompt, k=k, sampling=SamplingParams(
        temperature=0.0, max_tokens=9, ignore_eos=True, stop_token_ids=[free.token_ids[4]]))[0]
    first = free.token_ids.index(free.token_ids[4])
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]


def test_static_self_drafts_catch_up_through_the_verify_outputs(tiny_checkpoint: Path) -> None:
    """On the static path the drafter catches up from the verify pass's own outputs: greedy
    self-drafts keep passing whole, and the tokens are plain decoding's."""
    eng = SpecEngine(tiny_checkpoint, str(tiny_checkpoint), device="cpu", dtype="float32",
                     max_model_len=64, kv_cache_tokens=2048, max_batch_size=8, cuda_graphs=True,
                     graph_buckets=(1, 2, 4, 8))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in eng.generate(PROMPTS, k=0, sampling=params)]
    outs = eng.generate(PROMPTS, k=3, sampling=params)
    assert [o.token_ids for o in outs] == want
    assert 0 < eng.stats.num_accepted_tokens == eng.stats.num_draft_tokens
