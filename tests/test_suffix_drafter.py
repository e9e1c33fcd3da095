"""Suffix drafter (issue 14 item 2): the per-prompt suffix index against its definition,
eviction, the drafter's sibling / epoch / preemption bookkeeping, the hybrid's choice, and
losslessness through the engine (greedy equal to k=0, sampled law by chi-square), plus the
GRPO behaviour the drafter exists for (second epoch)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import test_sampling_lossless as joint_law
from lossless import assert_greedy_lossless
from test_sampling_lossless import NUM_SEQS, P_MIN, chi_square_p, exact_joint, run_joint

from specengine import _C, SamplingParams, SpecEngine
from specengine.arith_task import encode, heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.core.sequence import SeqStatus, Sequence
from specengine.drafters import make_drafter
from specengine.drafters.eagle3 import Eagle3Drafter
from specengine.drafters.hybrid import HybridDrafter
from specengine.drafters.ngram import NgramDrafter
from specengine.drafters.suffix import SuffixDrafter
from specengine.drafters.suffix_index import (
    Node,
    SuffixCacheRef,
    SuffixIndex,
    SuffixParams,
    draft_from,
)
from specengine.tree import DraftTree


def index_with(docs: list[list[int]], depth: int = 8) -> SuffixIndex:
    """A trie indexing ``docs`` (seq ids 0..)."""
    idx = SuffixIndex(depth)
    for i, tokens in enumerate(docs):
        idx.append(idx.open(i, 0), tokens)
    return idx


def dump(node: Node) -> dict[int, object]:
    """The trie as nested ``{token: (count, cont, subtree)}``."""
    return {t: (c.count, c.cont, dump(c)) for t, c in (node.children or {}).items()}


def substring_counts(docs: list[list[int]], depth: int) -> Counter:
    """The definition of the trie's counts: occurrences of every substring of <= depth."""
    out: Counter = Counter()
    for doc in docs:
        for i in range(len(doc)):
            for d in range(1, min(depth, len(doc) - i) + 1):
                out[tuple(doc[i: i + d])] += 1
    return out


def scan_draft(docs: list[list[int]], context: list[int], limit: int, p: SuffixParams
               ) -> tuple[list[int], list[float], int]:
    """The proposal by its definition, from substring counts: every match length m, the
    greedy path below the context's last m tokens (ties: smaller token), extended while the
    product of count / (continuations + smoothing) stays >= min_prob and within
    min(limit, int(m * factor + offset)); the best sum of probabilities (ties: longer m)."""
    counts = substring_counts(docs, p.max_depth)

    def cont(s: tuple[int, ...]) -> dict[int, int]:
        if len(s) >= p.max_depth:
            return {}
        return {k[-1]: c for k, c in counts.items() if len(k) == len(s) + 1 and k[:-1] == s}

    best: tuple[list[int], list[float], int] = ([], [], 0)
    best_score = 0.0
    for m in range(min(len(context), p.max_depth), 0, -1):
        s = tuple(context[len(context) - m:])
        if s not in counts:
            continue
        cap = min(limit, max(0, int(m * p.spec_factor + p.spec_offset + 1e-6)))
        toks: list[int] = []
        probs: list[float] = []
        prob = 1.0
        while len(toks) < cap:
            after = cont(s)
            if not after:
                break
            t = min(after, key=lambda x: (-after[x], x))
            opened = counts[s] - sum(after.values())
            prob *= after[t] / (sum(after.values()) + p.open_weight * opened + p.smoothing)
            if prob < p.min_prob:
                break
            toks.append(t)
            probs.append(prob)
            s = s + (t,)
        if sum(probs) > best_score:
            best, best_score = (toks, probs, m), sum(probs)
    return best


def make_cpp(p: SuffixParams) -> _C.SuffixCache:
    return _C.SuffixCache(p.max_depth, p.max_tokens, p.global_tokens, p.prompt_tokens,
                          p.min_prob, p.smoothing, p.spec_factor, p.spec_offset, p.open_weight)


# ---- the index (the Python reference) --------------------------------------------------------
def test_draft_scoring_on_a_small_example() -> None:
    idx = index_with([[1, 2, 3, 4], [9, 2, 3, 5], [7, 2, 3, 5]])
    p = SuffixParams(smoothing=0.0, min_prob=0.0)
    draft, _ = draft_from(idx.frontier_of([8, 2, 3]), 3, p)
    # (2, 3) is followed by 5 twice and 4 once: 5 at 2/3, nothing after 5
    assert draft.tokens == [5] and draft.probs == pytest.approx([2 / 3])
    assert draft.match_len == 2 and not draft.backed_off
    draft, _ = draft_from(idx.frontier_of([1, 2, 3]), 3, p)
    assert draft.tokens == [4] and draft.match_len == 3  # the longer context beats frequency
    # min_prob stops the path; smoothing makes one observation weaker than many
    assert draft_from(idx.frontier_of([8, 2, 3]), 3, replace(p, min_prob=0.7))[0].tokens == []
    one = draft_from(idx.frontier_of([1, 2, 3]), 3, replace(p, smoothing=1.0))[0]
    assert one.probs == [0.5]


def test_match_length_caps_the_draft() -> None:
    """max_spec_factor / offset: a match of m tokens drafts at most int(m * factor + offset),
    so a one-token match (weak evidence) cannot send a long draft."""
    idx = index_with([[5, 1, 2, 3, 4, 6, 7]])
    p = SuffixParams(smoothing=0.0, min_prob=0.0)
    assert draft_from(idx.frontier_of([9, 1]), 8, p)[0].tokens == [2]
    assert draft_from(idx.frontier_of([5, 1]), 8, p)[0].tokens == [2, 3]
    assert draft_from(idx.frontier_of([9, 1]), 8, replace(p, spec_offset=2.0))[0].tokens == [
        2, 3, 4]
    assert draft_from(idx.frontier_of([9, 1]), 8, replace(p, spec_factor=4.0))[0].tokens == [
        2, 3, 4, 6]
    assert draft_from(idx.frontier_of([9, 1]), 8, replace(p, spec_offset=-1.0))[0].tokens == []


def test_counts_and_drafts_match_the_definition() -> None:
    rng = random.Random(0)
    for trial in range(120):
        p = SuffixParams(max_depth=rng.choice((2, 3, 5, 8)), min_prob=rng.choice((0.0, 0.1)),
                         smoothing=rng.choice((0.0, 0.5)), spec_factor=rng.choice((1.0, 2.0)),
                         spec_offset=rng.choice((0.0, 1.0)), open_weight=rng.choice((0.0, 1.0)))
        vocab = rng.choice((2, 3, 6))
        idx = SuffixIndex(p.max_depth)
        docs: dict[int, list[int]] = {}
        for _ in range(rng.randrange(1, 25)):  # interleaved appends, like running siblings
            sid = rng.randrange(6)
            if sid not in docs:
                docs[sid] = []
                idx.open(sid, 0)
            new = [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
            docs[sid] += new
            idx.append(idx.docs[sid], new)
        if trial % 3 == 0 and len(docs) > 1:  # and removals
            gone = rng.choice(sorted(docs))
            idx.remove(idx.docs[gone])
            del docs[gone]
        idx.check()
        assert idx.num_tokens == sum(map(len, docs.values()))
        for _ in range(5):
            query = [rng.randrange(vocab) for _ in range(rng.randrange(0, 7))]
            draft, _ = draft_from(idx.frontier_of(query), 4, p)
            tokens, probs, m = scan_draft(list(docs.values()), query, 4, p)
            assert draft.tokens == tokens and draft.probs == pytest.approx(probs)
            assert draft.match_len == m


def test_removal_leaves_the_trie_of_the_others() -> None:
    a, b = [1, 2, 1, 2, 3, 1], [2, 1, 2, 4]
    idx = index_with([a, b], depth=4)
    idx.remove(idx.docs[0])
    assert dump(idx.root) == dump(index_with([b], depth=4).root)
    idx.remove(idx.docs[1])
    assert idx.root.children is None and idx.root.cont == 0 and idx.num_tokens == 0


def test_awkward_cases() -> None:
    p = SuffixParams(smoothing=0.0, min_prob=0.0, spec_offset=8.0)
    empty = SuffixIndex(4)
    assert empty.frontier_of([1, 2]) == [] and draft_from([], 3, p)[0].tokens == []
    assert index_with([[]]).num_tokens == 0  # an empty document
    # repeated tokens: every suffix of 5s is followed by 5 until the end
    rep = index_with([[5] * 10], depth=4)
    rep.check()
    # a match of 1 drafts 3 (depth 4 bounds the path), a match of 2 only 2
    assert draft_from(rep.frontier_of([5, 5]), 3, p)[0].tokens == [5, 5, 5]
    assert rep.root.children[5].count == 10 and rep.root.children[5].cont == 9
    # a document indexed twice: counts double, drafts and estimates do not change
    once, twice = index_with([[1, 2, 3, 1, 2, 4]]), index_with([[1, 2, 3, 1, 2, 4]] * 2)
    assert twice.root.children[1].count == 2 * once.root.children[1].count
    for q in ([1, 2], [3], [2, 3, 1]):
        d1, d2 = draft_from(once.frontier_of(q), 3, p)[0], draft_from(twice.frontier_of(q), 3, p)[0]
        assert (d1.tokens, d1.probs) == (d2.tokens, d2.probs)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex(1)


# ---- the cache: per-prompt and global tries, budgets; the C++ against the reference -----------
def batch_of(seqs: dict[int, tuple[list[int], int]], rng: random.Random
             ) -> tuple[np.ndarray, ...]:
    """``(tokens, rows, lens, num_prompt, seq_ids)`` of ``{seq_id: (tokens, num_prompt)}``,
    rows shuffled in a matrix with spare rows and columns (like the engine's arena)."""
    ids = list(seqs)
    width = max(len(seqs[i][0]) for i in ids) + rng.randrange(3)
    tokens = np.full((len(ids) + 2, width), 99, dtype=np.int64)
    rows = np.array(rng.sample(range(len(ids) + 2), len(ids)), dtype=np.int64)
    for r, i in zip(rows, ids):
        tokens[r, : len(seqs[i][0])] = seqs[i][0]
    return (tokens, rows, np.array([len(seqs[i][0]) for i in ids], dtype=np.int64),
            np.array([seqs[i][1] for i in ids], dtype=np.int64), np.array(ids, dtype=np.int64))


@pytest.mark.parametrize("lockstep", [False, True])
def test_cpp_cache_gives_the_reference_proposals(lockstep: bool) -> None:
    """Random token streams of running, preempted and finished sequences over a few prompts,
    tight budgets (evictions) and random options: ``_C.SuffixCache`` gives exactly the
    reference's chains (tokens, estimates, match lengths, sources) and trees, and holds the
    same token counts, step after step. ``lockstep``: new sequences often fork a running one
    and identical ones mostly get the same tokens (GRPO siblings standing at the same trie
    nodes, whose drafts the C++ proposal computes once per batch), asked for different
    numbers of drafts."""
    rng = random.Random(0)
    num_shared = 0
    tree = DraftTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    num_drafted = num_global = 0
    for _ in range(250):
        p = SuffixParams(
            max_depth=rng.choice((2, 3, 5, 8)), max_tokens=rng.choice((10, 40, 10**6)),
            global_tokens=rng.choice((0, 15, 60, 10**6)), prompt_tokens=rng.choice((0, 2, 8)),
            min_prob=rng.choice((0.0, 0.1, 0.3)), smoothing=rng.choice((0.0, 0.25, 1.0)),
            spec_factor=rng.choice((0.5, 1.0, 2.0)), spec_offset=rng.choice((-1.0, 0.0, 1.5)),
            open_weight=rng.choice((0.0, 0.5, 1.0)))
        ref, cpp = SuffixCacheRef(p), make_cpp(p)
        vocab = rng.choice((2, 3, 6))
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 5))] for _ in range(3)]
        seqs: dict[int, tuple[list[int], int]] = {}
        next_id = 0
        for _ in range(40):
            while len(seqs) < 5 and rng.random() < 0.5:
                prompt = rng.choice(prompts)
                seqs[next_id] = (list(prompt), len(prompt))
                if lockstep and len(seqs) > 1 and rng.random() < 0.7:
                    toks, n_prompt = rng.choice(list(seqs.values())[:-1])
                    seqs[next_id] = (list(toks), n_prompt)
                next_id += 1
            if not seqs:
                continue
            same: dict[tuple[int, ...], list[int]] = {}
            for toks, _ in seqs.values():
                new = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
                if lockstep and rng.random() < 0.8:
                    new = same.setdefault(tuple(toks), new)
                toks += new
            src = batch_of(seqs, rng)
            what = rng.random()
            if what < 0.2:
                ref.sync(*src)
                cpp.sync(*src)
            elif what < 0.35:
                args = (tree.parents.astype(np.int64), tree.ranks.astype(np.int64),
                        tree.max_depth)
                assert np.array_equal(ref.propose_tree(*src, *args), cpp.propose_tree(*src, *args))
            else:
                want = np.array([rng.randrange(0, 6) for _ in seqs], dtype=np.int64)
                a, b = ref.propose(*src, want), cpp.propose(*src, want)
                for x, y in zip(a, b):
                    assert x.dtype == y.dtype and np.array_equal(x, y)
                if lockstep:  # rows at the same place as an earlier row, drafting otherwise
                    at = [tuple(t) + (n,) for t, n in seqs.values()]
                    num_shared += sum(
                        at[j] in at[:j] and a[1][j] != a[1][at.index(at[j])]
                        for j in range(len(at)))
                num_drafted += int(a[1].sum())
                num_global += int((a[4] & 1).sum())
            for i in list(seqs):
                if rng.random() < 0.15:
                    finished = rng.random() < 0.7
                    toks, n_prompt = seqs[i]
                    ref.release(i, np.array(toks), n_prompt, finished)
                    cpp.release(i, np.array(toks), n_prompt, finished)
                    if finished:
                        del seqs[i]
            assert (ref.num_tokens, ref.glob.num_tokens, len(ref.indexes), len(ref.by_seq)) == (
                cpp.num_tokens, cpp.num_global_tokens, cpp.num_prompts, cpp.num_seqs)
    assert num_drafted > 1000 and num_global > 100  # the comparison saw real drafts of both
    assert not lockstep or num_shared > 100  # ... and siblings at the same nodes


def test_global_trie_drafts_across_prompts() -> None:
    """A completion of prompt A serves a sequence of prompt B (the per-prompt trie of B is
    empty); with ``global_tokens=0`` it does not."""
    a, b = [40, 41], [50, 51]
    p = SuffixParams(prompt_tokens=0, smoothing=0.0)
    for cache in (SuffixCacheRef(p), make_cpp(p)):
        cache.release(0, np.array(a + [1, 2, 3, 4, 5]), 2, True)  # unknown: ignored
        src = ({0: (a + [1, 2, 3, 4, 5], 2)}, {1: (b + [7, 1, 2, 3], 2)})
        cache.sync(*batch_of(src[0], random.Random(0)))
        cache.release(0, np.array(a + [1, 2, 3, 4, 5]), 2, True)
        ids, counts, _, match, flags = cache.propose(*batch_of(src[1], random.Random(0)),
                                                     np.array([3]))
        assert ids[0, : counts[0]].tolist() == [4, 5] and match[0] == 3 and flags[0] & 1
    off = SuffixCacheRef(replace(p, global_tokens=0))
    off.sync(*batch_of({0: (a + [1, 2, 3, 4, 5], 2)}, random.Random(0)))
    off.release(0, np.array(a + [1, 2, 3, 4, 5]), 2, True)
    assert off.propose(*batch_of({1: (b + [7, 1, 2, 3], 2)}, random.Random(0)),
                       np.array([3]))[1].tolist() == [0]


def test_budgets_evict_least_recently_used_prompts_and_oldest_global_documents() -> None:
    def state(cache: object) -> tuple[int, int, int]:
        if isinstance(cache, SuffixCacheRef):
            return cache.num_tokens, cache.glob.num_tokens, len(cache.indexes)
        return cache.num_tokens, cache.num_global_tokens, cache.num_prompts  # type: ignore

    ref = SuffixCacheRef(SuffixParams(max_tokens=10, global_tokens=7, prompt_tokens=0))
    cpp = make_cpp(ref.p)
    for cache in (ref, cpp):
        rng = random.Random(0)
        for sid, key in enumerate(((1,), (2,), (3,))):  # documents [sid, 7, 7] of 3 prompts
            cache.sync(*batch_of({sid: ([*key, sid, 7, 7], 1)}, rng))
            cache.release(sid, np.array([*key, sid, 7, 7]), 1, True)
        # per-prompt 9 <= 10; global 9 > 7: the oldest finished document went
        assert state(cache) == (9, 6, 3)
        # a new sequence of prompt 1 (now the most recently used): 11 > 10, prompt 2 goes;
        # global 8 > 7: the next oldest finished document goes
        cache.propose(*batch_of({9: ([1, 0, 7], 1)}, rng), np.array([2]))
        assert state(cache) == (8, 5, 2)
        cache.release(9, np.array([1, 0, 7]), 1, False)  # preempted: evictable, resumable
        cache.sync(*batch_of({3: ([4, 1, 2, 3], 1)}, rng))  # prompt 3 is the LRU now
        assert state(cache) == (8, 5, 2)
        # a running document is never evicted, even alone over the budget
        cache.sync(*batch_of({3: ([4, 1, 2, 3, *range(12)], 1)}, rng))
        assert state(cache) == (15, 15, 1)
    assert set(ref.indexes) == {(4,)}
    with pytest.raises(ValueError, match="suffix_max_tokens"):
        SuffixParams(max_tokens=0)


def test_cache_refuses_bad_batches_and_changes_nothing() -> None:
    cache = make_cpp(SuffixParams())
    good = batch_of({0: ([1, 2, 3, 4], 2)}, random.Random(0))
    cache.sync(*good)
    before = (cache.num_tokens, cache.num_global_tokens, cache.num_seqs)
    tokens, rows, lens, num_prompt, ids = good
    late = np.zeros((1, 3), dtype=np.int64)
    late[0] = [1, 2, 2**40]  # a new sequence with a token that is no vocabulary id
    cases = [
        ((tokens, rows + 9, lens, num_prompt, ids), "outside the token matrix"),
        ((tokens, rows, lens + 99, num_prompt, ids), "has length"),
        ((tokens, rows, lens, lens + 1, ids), "has length"),
        ((tokens, rows, np.append(lens, 1), num_prompt, ids), "one entry per sequence"),
        ((tokens.astype(np.float64), rows, lens, num_prompt, ids), "must hold integers"),
        ((late, np.array([0]), np.array([3]), np.array([1]), np.array([7])),
         "not a vocabulary id"),
    ]
    for args, what in cases:
        with pytest.raises((ValueError, TypeError), match=what):
            cache.sync(*args)
        with pytest.raises((ValueError, TypeError), match=what):
            cache.propose(*args, np.array([3]))
    with pytest.raises(ValueError, match="one entry per sequence"):
        cache.propose(*good, np.array([3, 3]))
    with pytest.raises(ValueError, match="parent not before it"):
        cache.propose_tree(*good, np.array([-1, 1]), np.array([0, 0]), 1)
    with pytest.raises(ValueError, match="prompt longer"):
        cache.release(0, np.array([1, 2]), 5, True)
    assert (cache.num_tokens, cache.num_global_tokens, cache.num_seqs) == before
    cache.propose(*good, np.array([3]))  # still usable
    with pytest.raises(ValueError, match="max_depth"):
        make_cpp(replace(SuffixParams(), max_depth=1))


# ---- the drafter on sequences ------------------------------------------------------------------
def seq_with(seq_id: int, prompt: list[int], generated: list[int]) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingParams(), 0, ())
    seq.append(generated, [0.0] * len(generated), 10**6)
    return seq


def chains_of(drafter: SuffixDrafter, seqs: tuple[Sequence, ...], k: int) -> list[list[int]]:
    out = drafter.propose(seqs, [k] * len(seqs), None)
    return [out.token_ids[b, : out.num_draft_tokens[b]].tolist() for b in range(len(seqs))]


def test_learns_from_running_siblings_and_earlier_epochs() -> None:
    # exact shares, no threshold: the chains show what is matched and how far it may go
    drafter = SuffixDrafter(suffix_prompt_tokens=2, suffix_smoothing=0.0, suffix_min_prob=0.0)
    prompt = [10, 11, 12]
    ahead, behind = seq_with(0, prompt, [1, 2, 3, 4, 5]), seq_with(1, prompt, [1, 2])
    other = seq_with(2, [13, 14], [1, 2])
    # the sibling ahead is still running: its tokens already serve the one behind (a match
    # of 4: 11 12 1 2); another prompt's sequence drafts from them through the global trie,
    # as far as its match of 2 (1 2) allows
    assert chains_of(drafter, (ahead, behind, other), 3) == [[], [3, 4, 5], [3, 4]]
    ahead.append([6, 7], [0.0, 0.0], 10**6)  # accepted tokens of the next step
    drafter.observe((ahead, behind, other), None, [])  # type: ignore[arg-type]
    assert chains_of(drafter, (behind,), 5) == [[3, 4, 5, 6]]  # capped by its match of 4
    for s in (ahead, behind, other):
        s.status = SeqStatus.FINISHED
        drafter.release(s)
    assert drafter.cache.num_seqs == 0  # finished sequences leave no record
    # a later epoch: a new sequence of the same prompt drafts from finished completions
    again = seq_with(3, prompt, [1])
    assert chains_of(drafter, (again,), 4) == [[2, 3, 4]]
    # the prompt tail starts each document: the first tokens are drafted before any output,
    # for the same prompt and (global trie) for another with the same tail
    assert chains_of(drafter, (seq_with(4, prompt, []),), 2) == [[1, 2]]
    assert chains_of(drafter, (seq_with(5, [99, 11, 12], []),), 2) == [[1, 2]]
    no_global = SuffixDrafter(suffix_prompt_tokens=2, suffix_global_tokens=0,
                              suffix_smoothing=0.0, suffix_min_prob=0.0)
    assert chains_of(no_global, (ahead, other), 3) == [[], []]


def test_preempted_sequence_resumes_its_document() -> None:
    drafter = SuffixDrafter()
    seq = seq_with(0, [1, 2], [3, 4])
    drafter.propose((seq,), [2], None)
    seq.status = SeqStatus.WAITING  # the scheduler preempts it (blocks freed)
    drafter.release(seq)
    seq.status = SeqStatus.RUNNING
    seq.append([5], [0.0], 10**6)
    drafter.propose((seq,), [2], None)
    # one document per trie, resumed: 1 2 3 4 5 (a restarted one would add 1 2 3 4 5 again)
    assert (drafter.cache.num_tokens, drafter.cache.num_global_tokens) == (5, 5)
    assert drafter.cache.num_seqs == 1


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
                         ({"suffix_max_tokens": 0}, "suffix_max_tokens"),
                         ({"suffix_global_tokens": -1}, "suffix_global_tokens"),
                         ({"suffix_spec_factor": -1.0}, "suffix_spec_factor"),
                         ({"suffix_spec_offset": 1e9}, "suffix_spec_offset")):
        with pytest.raises(ValueError, match=what):
            SuffixDrafter(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pairs a model drafter"):
        HybridDrafter(SuffixDrafter(), SuffixDrafter())


# ---- the hybrid's choice ---------------------------------------------------------------------
def test_hybrid_explores_a_few_rows_then_follows_the_calibration() -> None:
    # estimates 0.97 0.94 0.91 (smoothing 0.25): one calibration cell; a match of 2 may
    # draft 3 (offset 1)
    hybrid = HybridDrafter(NgramDrafter(), SuffixDrafter(suffix_prompt_tokens=0,
                                                         suffix_spec_offset=1.0,
                                                         suffix_smoothing=0.25))
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
    assert hybrid.neural.sample and hybrid.suffix.params.max_depth == 5
    assert hybrid.aux_layers == hybrid.neural.aux_layers and hybrid.module is not None
    assert isinstance(make_drafter(("suffix", "ngram"), ctx), HybridDrafter)
    for bad in (("suffix", "suffix"), ("ngram", "mtp"), ("ngram", "suffix", "suffix")):
        with pytest.raises(ValueError, match="a draft pair is"):
            make_drafter(bad, ctx)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not options of the SuffixDrafter"):
        SpecEngine(DEFAULT_TARGET, draft="suffix", device="cpu",
                   draft_options={"suffix_bogus": 1})


# ---- through the engine ------------------------------------------------------------------------
#: suffix options that make the suffix drafter's estimates bolder than the defaults, so that
#: on these small workloads (a couple of identical greedy siblings) the hybrid verifies both
#: kinds of rows
EAGER_SUFFIX = {"suffix_smoothing": 0.25, "suffix_min_prob": 0.1}


def hybrid_engine(target: object = DEFAULT_TARGET, head: object = DEFAULT_DRAFT,
                  suffix: dict | None = None, **kwargs: object) -> SpecEngine:
    """An engine drafting with ``(head, "suffix")``. ``SpecEngine``'s ``draft=`` takes
    a pair once the engine passes it to ``make_drafter`` as given (``engine.py`` casts a
    draft to ``str``); until then the hybrid is put in place of the engine's EAGLE-3 drafter
    (the same drafter object, so the static path it bound stays valid)."""
    suffix = suffix or {}
    opts = {**(kwargs.pop("draft_options", None) or {}), **suffix}  # type: ignore[dict-item]
    try:
        return SpecEngine(target, draft=(str(head), "suffix"), draft_options=opts,  # type: ignore
                          **kwargs)
    except ValueError:
        pass
    rest = {k: v for k, v in opts.items() if not k.startswith("suffix_")}
    engine = SpecEngine(target, draft=head, draft_options=rest or None, **kwargs)  # type: ignore
    hybrid = HybridDrafter(engine.drafter, SuffixDrafter(**suffix))  # type: ignore[arg-type]
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
    """After the calls: every sequence was released (no record left), budgets held."""
    cache = drafter.cache
    assert cache.num_seqs == 0 and 0 < cache.num_tokens <= drafter.params.max_tokens
    assert 0 < cache.num_global_tokens <= drafter.params.global_tokens


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
    engine = hybrid_engine(device="cpu", cuda_graphs=True, suffix=EAGER_SUFFIX)
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
    # first epoch (siblings in lockstep): the global trie's completions of other prompts
    # (shared steps, arithmetic facts) put it ahead of the n-gram drafter (issue 27: 1.33
    # vs 1.25 here; the per-prompt tries alone were no better than n-gram)
    assert suffix[0] >= ngram[0] + 0.05, (suffix, ngram)
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
              else hybrid_engine(target, eagle_dir, suffix=EAGER_SUFFIX, **kwargs))
    hybrid = engine.drafter
    counts = run_joint(engine, params, NUM_SEQS, **gen_kwargs)
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    if isinstance(hybrid, HybridDrafter):  # both kinds of rows were verified (one-hot rows
        assert 0 < hybrid.num_suffix_rows < hybrid.num_rows  # among sampled ones)
    p = chi_square_p(counts, exact_joint(hf, params), NUM_SEQS)
    assert p > P_MIN, f"{case}: chi-square p = {p:.2e}"
