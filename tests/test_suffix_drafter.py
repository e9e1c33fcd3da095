"""Suffix drafter (issue 14 item 2): the per-prompt suffix index against its definition,
eviction, the drafter's sibling / epoch / preemption bookkeeping, the hybrid's choice, and
losslessness through the engine (greedy equal to k=0, sampled law by chi-square), plus the
GRPO behaviour the drafter exists for (second epoch)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import test_sampling_lossless as joint_law
from lossless import assert_greedy_lossless
from test_sampling_lossless import NUM_SEQS, P_MIN, chi_square_p, exact_joint, run_joint

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import encode, heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.core.sequence import SeqStatus, Sequence
from specengine.drafters import make_drafter
from specengine.drafters.eagle3 import Eagle3Drafter
from specengine.drafters.hybrid import HybridDrafter
from specengine.drafters.ngram import NgramDrafter
from specengine.drafters.suffix import SuffixDrafter
from specengine.drafters.suffix_index import Node, SuffixIndex, SuffixStore
from specengine.tree import DraftTree


def store_with(docs: list[list[int]], depth: int = 8, budget: int = 10**6,
               key: tuple[int, ...] = (0,)) -> SuffixStore:
    """A store whose prompt ``key`` indexes ``docs`` (seq ids 0..), all finished."""
    store = SuffixStore(depth, budget)
    for i, tokens in enumerate(docs):
        doc = store.open(i, key, 0)
        store.append(doc, tokens)
        store.close(doc, finished=True)
    return store


def dump(node: Node) -> dict[int, object]:
    """The trie as nested ``{token: (count, cont, subtree)}``."""
    return {t: (c.count, c.cont, dump(c)) for t, c in (node.children or {}).items()}


def next_counts(docs: list[list[int]], context: list[int], depth: int) -> tuple[int, Counter]:
    """The definition, by scanning: the longest suffix of ``context`` (at most depth - 1
    tokens) followed by some token somewhere in ``docs``, and the counts of what followed."""
    for d in range(min(depth - 1, len(context)), 0, -1):
        pat = context[len(context) - d:]
        after: Counter = Counter(doc[i + d] for doc in docs for i in range(len(doc) - d)
                                 if doc[i: i + d] == pat)
        if after:
            return d, after
    return 0, Counter()


# ---- the index -------------------------------------------------------------------------------
def test_longest_match_wins_and_most_frequent_continuation() -> None:
    store = store_with([[1, 2, 3, 4], [9, 2, 3, 5], [7, 2, 3, 5]])
    idx = store.indexes[(0,)]
    chain = idx.continuation(idx.frontier_of([8, 2, 3]), 3, 0.0)
    assert chain.tokens == [5]  # (2, 3) is followed by 5 twice, 4 once; nothing after 5
    assert chain.probs == pytest.approx([2 / 3]) and chain.depths == [2]
    chain = idx.continuation(idx.frontier_of([1, 2, 3]), 3, 0.0)
    assert chain.tokens == [4] and chain.depths == [3]  # the longer context beats frequency
    # min_prob stops the chain; smoothing makes one observation weaker than many
    assert idx.continuation(idx.frontier_of([8, 2, 3]), 3, 0.7).tokens == []
    assert idx.continuation(idx.frontier_of([1, 2, 3]), 3, 0.0, smoothing=1.0).probs == [0.5]


def test_counts_and_chains_match_the_definition() -> None:
    rng = random.Random(0)
    for trial in range(150):
        depth = rng.choice((2, 3, 5, 8))
        vocab = rng.choice((2, 3, 6))
        store = SuffixStore(depth, 10**6)
        docs: dict[int, list[int]] = {}
        for _ in range(rng.randrange(1, 25)):  # interleaved appends, like running siblings
            sid = rng.randrange(6)
            if sid not in docs:
                docs[sid] = []
                store.open(sid, (0,), 0)
            new = [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
            docs[sid] += new
            store.append(store.by_seq[sid], new)
        idx = store.indexes[(0,)]
        if trial % 3 == 0 and len(docs) > 1:  # and removals
            gone = rng.choice(sorted(docs))
            idx.remove(idx.docs[gone])
            del docs[gone]
        idx.check()
        assert idx.num_tokens == sum(map(len, docs.values()))
        for _ in range(5):
            query = [rng.randrange(vocab) for _ in range(rng.randrange(0, 7))]
            smoothing = rng.choice((0.0, 0.5))
            chain = idx.continuation(idx.frontier_of(query), 4, 0.05, smoothing)
            ctx, p = list(query), 1.0
            for j in range(4):
                d, after = next_counts(list(docs.values()), ctx, depth)
                if not after:
                    assert len(chain.tokens) == j
                    break
                best = max(after.values())
                p_next = p * best / (sum(after.values()) + smoothing)
                if p_next < 0.05:
                    assert len(chain.tokens) == j
                    break
                assert chain.tokens[j] in {t for t, c in after.items() if c == best}
                assert chain.depths[j] == d and chain.probs[j] == pytest.approx(p_next)
                p = p_next
                ctx.append(chain.tokens[j])
            else:
                assert len(chain.tokens) == 4


def test_removal_leaves_the_trie_of_the_others() -> None:
    a, b = [1, 2, 1, 2, 3, 1], [2, 1, 2, 4]
    both = store_with([a, b], depth=4)
    idx = both.indexes[(0,)]
    idx.remove(idx.docs[0])
    assert dump(idx.root) == dump(store_with([b], depth=4).indexes[(0,)].root)
    idx.remove(idx.docs[1])
    assert idx.root.children is None and idx.root.cont == 0 and idx.num_tokens == 0


def test_awkward_cases() -> None:
    empty = SuffixIndex(4)
    assert empty.frontier_of([1, 2]) == [] and empty.continuation([], 3, 0.0).tokens == []
    assert store_with([[]]).indexes[(0,)].num_tokens == 0  # an empty document
    # repeated tokens: every suffix of 5s is followed by 5 until the end
    rep = store_with([[5] * 10], depth=4).indexes[(0,)]
    rep.check()
    assert rep.continuation(rep.frontier_of([5, 5]), 3, 0.0).tokens == [5, 5, 5]
    assert rep.root.children[5].count == 10 and rep.root.children[5].cont == 9
    # a prompt indexed twice: counts double, proposals and shares do not change
    once = store_with([[1, 2, 3, 1, 2, 4]]).indexes[(0,)]
    twice = store_with([[1, 2, 3, 1, 2, 4]] * 2).indexes[(0,)]
    assert twice.root.children[1].count == 2 * once.root.children[1].count
    for q in ([1, 2], [3], [2, 3, 1]):
        c1 = once.continuation(once.frontier_of(q), 3, 0.0)
        c2 = twice.continuation(twice.frontier_of(q), 3, 0.0)
        assert (c1.tokens, c1.probs) == (c2.tokens, c2.probs)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex(1)


def test_token_budget_evicts_least_recently_used_prompts_first() -> None:
    store = SuffixStore(4, max_tokens=10)
    for sid, key in enumerate(((1,), (2,), (3,))):
        doc = store.open(sid, key, 0)
        store.append(doc, [sid, 7, 7])
        store.close(doc, finished=True)
    assert list(store.indexes) == [(1,), (2,), (3,)] and store.num_tokens == 9
    store.touch(store.indexes[(1,)])  # a proposal for prompt 1: prompt 2 is the least recent
    doc = store.open(3, (4,), 0)
    store.append(doc, [1, 2, 3])
    assert sorted(store.indexes) == [(1,), (3,), (4,)] and store.num_tokens == 9
    # the live document is never evicted, even alone over the budget
    store.append(doc, list(range(12)))
    assert list(store.indexes) == [(4,)] and store.num_tokens == 15
    assert set(store.by_seq) == {3} and not doc.evicted
    store.indexes[(4,)].check()
    # within one prompt, the oldest finished document goes first
    store = store_with([[1, 2], [3, 4], [5, 6]], budget=5)
    assert list(store.indexes[(0,)].docs) == [1, 2] and store.num_tokens == 4
    with pytest.raises(ValueError, match="suffix_max_tokens"):
        SuffixStore(4, 0)


# ---- the drafter on sequences ------------------------------------------------------------------
def seq_with(seq_id: int, prompt: list[int], generated: list[int]) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingParams(), 0, ())
    seq.append(generated, [0.0] * len(generated), 10**6)
    return seq


def chains_of(drafter: SuffixDrafter, seqs: tuple[Sequence, ...], k: int) -> list[list[int]]:
    out = drafter.propose(seqs, [k] * len(seqs), None)
    return [out.token_ids[b, : out.num_draft_tokens[b]].tolist() for b in range(len(seqs))]


def test_learns_from_running_siblings_and_earlier_epochs() -> None:
    drafter = SuffixDrafter(suffix_prompt_tokens=2)
    prompt = [10, 11, 12]
    ahead, behind = seq_with(0, prompt, [1, 2, 3, 4, 5]), seq_with(1, prompt, [1, 2])
    other = seq_with(2, [13, 14], [1, 2])
    # the sibling ahead is still running: its tokens already serve the one behind
    assert chains_of(drafter, (ahead, behind, other), 3) == [[], [3, 4, 5], []]
    ahead.append([6, 7], [0.0, 0.0], 10**6)  # accepted tokens of the next step
    drafter.observe((ahead, behind, other), None, [])  # type: ignore[arg-type]
    assert chains_of(drafter, (behind,), 5) == [[3, 4, 5, 6, 7]]
    for s in (ahead, behind, other):
        s.status = SeqStatus.FINISHED
        drafter.release(s)
    assert drafter.store.by_seq == {}
    # a later epoch: a new sequence of the same prompt drafts from finished completions
    again = seq_with(3, prompt, [1])
    assert chains_of(drafter, (again,), 4) == [[2, 3, 4, 5]]
    # the prompt tail starts each document: the first token is drafted before any output;
    # another prompt with the same tail has an index of its own (nothing to draft)
    assert chains_of(drafter, (seq_with(4, prompt, []),), 2) == [[1, 2]]
    assert chains_of(drafter, (seq_with(5, [99, 11, 12], []),), 2) == [[]]


def test_preempted_sequence_resumes_its_document() -> None:
    drafter = SuffixDrafter()
    seq = seq_with(0, [1, 2], [3, 4])
    drafter.propose((seq,), [2], None)
    seq.status = SeqStatus.WAITING  # the scheduler preempts it (blocks freed)
    drafter.release(seq)
    seq.status = SeqStatus.RUNNING
    seq.append([5], [0.0], 10**6)
    drafter.propose((seq,), [2], None)
    idx = drafter.store.indexes[(1, 2)]
    assert list(idx.docs) == [0] and idx.docs[0].tokens == [1, 2, 3, 4, 5]
    idx.check()


def test_tree_proposals_fill_every_node_by_rank() -> None:
    drafter = SuffixDrafter(suffix_prompt_tokens=0)
    prompt = [9]
    for sid, run in enumerate(([1, 2, 3], [1, 2, 3], [1, 4, 5])):
        s = seq_with(sid, prompt, run)
        drafter.propose((s,), [1], None)
        s.status = SeqStatus.FINISHED
        drafter.release(s)
    tree = DraftTree([(0,), (1,), (2,), (0, 0), (1, 0)])
    out = drafter.propose((seq_with(5, prompt, [1]),), [tree.num_nodes - 1], tree)
    assert out.num_draft_tokens.tolist() == [5]
    # nodes (0,) (1,) (2,) (0,0) (1,0): after 1 come 2 (twice) and 4 (once); rank 2 has no
    # candidate and repeats rank 0; after 1 2 comes 3, after 1 4 comes 5
    assert out.token_ids[0].tolist() == [2, 4, 2, 3, 5]


def test_bad_options_are_refused() -> None:
    for kwargs, what in (({"suffix_max_depth": 1}, "suffix_max_depth"),
                         ({"suffix_min_prob": 1.5}, "suffix_min_prob"),
                         ({"suffix_prompt_tokens": -1}, "suffix_prompt_tokens"),
                         ({"suffix_smoothing": -1.0}, "suffix_smoothing"),
                         ({"suffix_max_tokens": 0}, "suffix_max_tokens")):
        with pytest.raises(ValueError, match=what):
            SuffixDrafter(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pairs a model drafter"):
        HybridDrafter(SuffixDrafter(), SuffixDrafter())


# ---- the hybrid's choice ---------------------------------------------------------------------
def test_hybrid_explores_a_few_rows_then_follows_the_calibration() -> None:
    hybrid = HybridDrafter(NgramDrafter(), SuffixDrafter(suffix_prompt_tokens=0))
    prompt = [7, 1, 2, 9]  # "1 2" occurs in the prompt: the n-gram drafter proposes 9 1 2
    for sid in range(8):  # an earlier epoch: eight completions 1 2 3 4 5 6
        s = seq_with(sid, prompt, [1, 2, 3, 4, 5, 6])
        hybrid.suffix.catch_up((s,))
        s.status = SeqStatus.FINISHED
        hybrid.release(s)

    def step(seqs: tuple[Sequence, ...], accepted: int) -> list[list[int]]:
        out = hybrid.propose(seqs, [3] * len(seqs), None)
        hybrid.observe(seqs, None, [list(range(accepted + 1))] * len(seqs))  # type: ignore
        return [out.token_ids[b, : out.num_draft_tokens[b]].tolist() for b in range(len(seqs))]

    rows = tuple(seq_with(10 + b, prompt, [1, 2]) for b in range(3))
    # unexplored: the suffix's prior (2.8 expected) beats the n-gram's (0.875), two rows try
    assert step(rows, accepted=3) == [[3, 4, 5], [3, 4, 5], [9, 1, 2]]
    assert hybrid.num_suffix_rows == 2 and hybrid.num_rows == 3
    # those drafts were all accepted: now every row takes the suffix
    assert step(rows, accepted=3) == [[3, 4, 5]] * 3
    # the suffix's drafts start failing: within a few steps every row is back on the n-gram's
    chosen = [step(rows, accepted=0) for _ in range(12)]
    assert chosen[0] == [[3, 4, 5]] * 3 and chosen[-1] == [[9, 1, 2]] * 3


def test_draft_pairs_through_the_factory() -> None:
    from dataclasses import replace

    engine = SpecEngine(DEFAULT_TARGET, device="cpu")
    ctx = engine.draft_context
    opts = (("sample", True), ("suffix_max_depth", 5))
    hybrid = make_drafter((str(DEFAULT_DRAFT), "suffix"),
                          replace(ctx, config=replace(ctx.config, draft_options=opts)))
    assert isinstance(hybrid, HybridDrafter) and isinstance(hybrid.neural, Eagle3Drafter)
    assert hybrid.neural.sample and hybrid.suffix.store.max_depth == 5
    assert hybrid.aux_layers == hybrid.neural.aux_layers and hybrid.module is not None
    assert isinstance(make_drafter(("suffix", "ngram"), ctx), HybridDrafter)
    for bad in (("suffix", "suffix"), ("ngram", "mtp"), ("ngram", "suffix", "suffix")):
        with pytest.raises(ValueError, match="a draft pair is"):
            make_drafter(bad, ctx)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not options of the SuffixDrafter"):
        SpecEngine(DEFAULT_TARGET, draft="suffix", device="cpu",
                   draft_options={"suffix_bogus": 1})


# ---- through the engine ------------------------------------------------------------------------
def hybrid_engine(target: object = DEFAULT_TARGET, head: object = DEFAULT_DRAFT,
                  **kwargs: object) -> SpecEngine:
    """An engine drafting with ``(head, "suffix")``. ``SpecEngine``'s ``draft=`` takes
    a pair once the engine passes it to ``make_drafter`` as given (``engine.py`` casts a
    draft to ``str``); until then the hybrid is put in place of the engine's EAGLE-3 drafter
    (the same drafter object, so the static path it bound stays valid)."""
    try:
        return SpecEngine(target, draft=(str(head), "suffix"), **kwargs)  # type: ignore
    except ValueError:
        pass
    engine = SpecEngine(target, draft=head, **kwargs)  # type: ignore
    hybrid = HybridDrafter(engine.drafter, SuffixDrafter())  # type: ignore[arg-type]
    engine.drafter = engine.core.drafter = hybrid
    engine.scheduler.on_preempt = hybrid.release
    return engine


def sibling_requests(num_prompts: int = 6, group: int = 2, seed: int = 0
                     ) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy requests of held-out prompts, each ``group`` times, mixed max_tokens and stops."""
    rng = random.Random(seed)
    semicolon = encode(";")[0]
    prompts, params = [], []
    for i, text in enumerate(heldout_prompts(num_prompts)):
        for j in range(group):
            prompts.append(encode(text))
            params.append(SamplingParams(temperature=0.0, max_tokens=rng.randrange(6, 48),
                                         stop_token_ids=(semicolon,) if (i + j) % 4 == 0
                                         else ()))
    return prompts, params


def check_index(drafter: SuffixDrafter) -> None:
    """Every index equals a recount of its documents; no sequence has two documents."""
    seen: list[int] = []
    for idx in drafter.store.indexes.values():
        idx.check()
        seen += list(idx.docs)
    assert len(seen) == len(set(seen))
    assert drafter.store.num_tokens == sum(i.num_tokens for i in drafter.store.indexes.values())


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_greedy_equals_k0_on_the_bundled_pair(cuda_graphs: bool) -> None:
    engine = SpecEngine(DEFAULT_TARGET, draft="suffix", device="cpu", cuda_graphs=cuda_graphs)
    prompts, params = sibling_requests()
    # chains k = 1, 3, 5 and a tree; the index keeps growing across the calls (epochs)
    assert_greedy_lossless(engine, prompts, params, ks=(1, 3, 5), trees=("binary2",))
    assert engine.stats.num_accepted_tokens > 0
    check_index(engine.drafter)  # type: ignore[arg-type]


def test_greedy_equals_k0_with_preemption() -> None:
    # 12 blocks of 16 tokens for 12 requests of up to 4 blocks: sequences get preempted and
    # recomputed, and their documents must resume (not restart) in the index.
    engine = SpecEngine(DEFAULT_TARGET, draft="suffix", device="cpu", kv_cache_tokens=192)
    prompts, params = sibling_requests()
    assert_greedy_lossless(engine, prompts, params, ks=(3,), trees=())
    assert engine.scheduler.num_preemptions > 0
    check_index(engine.drafter)  # type: ignore[arg-type]


def test_hybrid_greedy_equals_k0_on_the_bundled_pair() -> None:
    engine = hybrid_engine(device="cpu", cuda_graphs=True)
    prompts, params = sibling_requests()
    assert_greedy_lossless(engine, prompts, params, ks=(3,), trees=("binary2",))
    hybrid = engine.drafter
    assert isinstance(hybrid, HybridDrafter) and 0 < hybrid.num_suffix_rows < hybrid.num_rows


def grpo_tokens_per_step(engine: SpecEngine, epochs: int = 2) -> list[float]:
    """Tokens kept per step per sequence of each epoch: 8 held-out prompts x 8 samples,
    k = 3, temperature 1 (the issue's GRPO setting)."""
    batch = [p for p in heldout_prompts(8) for _ in range(8)]
    out = []
    for _ in range(epochs):
        engine.generate(batch, k=3, sampling=SamplingParams(temperature=1.0, max_tokens=64))
        out.append(engine.stats.num_step_tokens / engine.stats.num_seq_steps)
    return out


def test_second_grpo_epoch_drafts_from_the_first() -> None:
    suffix = grpo_tokens_per_step(SpecEngine(DEFAULT_TARGET, draft="suffix", device="cpu"))
    ngram = grpo_tokens_per_step(SpecEngine(DEFAULT_TARGET, draft="ngram", device="cpu"))
    head = grpo_tokens_per_step(SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu"))
    hybrid = grpo_tokens_per_step(hybrid_engine(device="cpu"))
    # The bar: >= 2.5 tokens per step per sequence in the second epoch (n-gram: 1.25)
    assert suffix[1] >= 2.5 and suffix[1] > ngram[1] + 1.0, (suffix, ngram)
    assert suffix[1] > suffix[0] + 1.0  # the gain comes from the first epoch's completions
    # the pair keeps at least what the head alone keeps, in both epochs
    assert min(hybrid[0] - head[0], hybrid[1] - head[1]) >= -0.02, (hybrid, head)


# The joint-law test's module fixtures: the target, and an EAGLE-3 head fitted to it.
models = joint_law.models
eagle_dir = joint_law.eagle_dir

SAMPLED = {
    # name: (drafter, generate kwargs, sampling params, sample neural drafts?)
    "suffix-chain-t1": ("suffix", dict(k=2), dict(temperature=1.0), False),
    "suffix-tree-t0.8-topk-topp": ("suffix", dict(tree=[(0,), (1,), (0, 0)]),
                                   dict(temperature=0.8, top_k=8, top_p=0.9), False),
    "hybrid-chain-sampled-draft-t1": ("hybrid", dict(k=2), dict(temperature=1.0), True),
}


@pytest.mark.parametrize("case", list(SAMPLED))
def test_sampled_output_follows_the_policy(models, eagle_dir, case: str) -> None:  # noqa: F811
    """The exact law of the 2nd and 3rd tokens (``test_sampling_lossless``) against 2·10⁴
    sequences of one prompt: the suffix drafter drafts from the siblings that finished
    earlier in the same call (and the ones still running)."""
    hf, target, _ = models
    kind, gen_kwargs, sp, sample = SAMPLED[case]
    params = SamplingParams(max_tokens=3, **sp)
    kwargs = dict(device="cpu", dtype="float32", max_model_len=32, max_batch_size=2048,
                  kv_cache_tokens=2048 * 32, seed=7,
                  draft_options={"sample": True} if sample else None)
    engine = (SpecEngine(target, draft="suffix", **kwargs) if kind == "suffix"
              else hybrid_engine(target, eagle_dir, **kwargs))
    hybrid = engine.drafter
    counts = run_joint(engine, params, NUM_SEQS, **gen_kwargs)
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    if isinstance(hybrid, HybridDrafter):  # both kinds of rows were verified (one-hot rows
        assert 0 < hybrid.num_suffix_rows < hybrid.num_rows  # among sampled ones)
    p = chi_square_p(counts, exact_joint(hf, params), NUM_SEQS)
    assert p > P_MIN, f"{case}: chi-square p = {p:.2e}"
